"""Check the kernel against reference C on the GPU, and time it.

``check`` is what the GPU tests assert on; ``python -m kernel.validate --out DIR`` runs the
sweep that fills the seed's "GPU measurements pending" table: error against reference C by
decay, dtype and config, and the latency of every single-pass config of the knob table at
the headline shape, all in the model form the tuner measures (``kernel.config.model_call``).
"""

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

import refs
from kernel.builder import TORCH_DTYPES, ScalarDecayKernel, build, constant_decay, cuda_arch, precompile
from kernel.config import (
    GATE_RANGE,
    HEADLINE,
    SEED_CONFIG,
    Call,
    KernelConfig,
    Problem,
    config_grid,
    model_call,
    retnet_decay,
)
from kernel.decode import DecodeCase
from kernel.decode_build import DecodeKernel
from kernel.environment import environment
from kernel.probe import ProbeFailure
from kernel.timing import time_gpu

# Constant decays (one alpha for every head) checked besides RetNet's per-head gammas.
ALPHAS = (1.0, 0.99, 0.9, 0.8, 0.5)
# A sweep case: the problem, the config, whether to time it, and its decay: one alpha for
# every head, or None for RetNet's gammas (``kernel.config.retnet_decay``).
Case = tuple[Problem, KernelConfig, bool, float | None]


def validation_grid(dv: int) -> list[KernelConfig]:
    """Every single-pass config of the knob table (the split is checked at chosen cases)."""
    return [c for c in config_grid(dv) if c.segments == 1]


def random_qkv(problem: Problem, *, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh normal Q, K, V on the GPU; Q scaled by DK^-1/2 as attention does."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    p, dtype = problem, TORCH_DTYPES[problem.dtype]

    def randn(dim: int) -> torch.Tensor:
        return torch.randn(p.batch, p.seqlen, p.heads, dim, generator=gen, device="cuda")

    return (randn(p.dk) * p.dk**-0.5).to(dtype), randn(p.dk).to(dtype), randn(p.dv).to(dtype)


def check(kernel: ScalarDecayKernel, *, seed: int, decay: torch.Tensor | None = None) -> dict[str, Any]:
    """Run ``kernel`` once on fresh inputs into NaN-filled outputs; compare with reference C.

    ``decay``: fp32 ``[H]`` alphas (default: RetNet's, ``retnet_decay``). Where the
    kernel takes an initial state, it gets a fresh random one; where it returns a final
    state, that lands in a NaN-filled buffer too. Returns ``rel_l2``: the larger relative
    L2 of the outputs and of the final state (fp64, against C computed from the same
    rounded inputs), ``state_rel_l2`` for the state alone (None without one), the count of
    elements still NaN (unwritten, or NaN produced) and whether all are finite. A kernel of
    the backward's fused pass (``call.dkdv``) is checked as ``_check_dkdv`` says.
    """
    if kernel.call.dkdv:
        return _check_dkdv(kernel, seed=seed, decay=decay)
    p, call = kernel.problem, kernel.call
    q, k, v = random_qkv(p, seed=seed)
    decay = _decay(p, q.device) if decay is None else decay
    state_shape = (p.batch, p.heads, p.dk, p.dv)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    h0 = torch.randn(state_shape, generator=gen, device="cuda") if call.initial_state else None
    nan = float("nan")
    out = torch.full((p.batch, p.seqlen, p.heads, p.dv), nan, dtype=q.dtype, device="cuda")
    ht = torch.full(state_shape, nan, device="cuda") if call.final_state else None
    kernel(q, k, v, decay=decay, initial_state=h0, final_state=ht, out=out)
    torch.cuda.synchronize()
    ref, ref_state = refs.kernel_mimic(
        q,
        k,
        v,
        decay,
        kernel.config.chunk,
        block_dv=kernel.config.block_dv,
        scale=call.scale,
        initial_state=h0,
        output_final_state=True,
    )
    return _verdict([(out, ref)] + ([(ht, ref_state)] if ht is not None else []), ht is not None)


def _check_dkdv(kernel: ScalarDecayKernel, *, seed: int, decay: torch.Tensor | None) -> dict[str, Any]:
    """``check`` of the backward's fused pass: its dK and dV for fresh q, k, v and dO
    (and, where the call takes a state, a fresh final-state gradient dHT as
    ``kernel.ops.backward`` hands it in; where it returns one, dH0) into NaN-filled buffers,
    against reference E (``refs.chunked_backward``) in fp64. ``state_rel_l2``: dH0's."""
    p, call = kernel.problem, kernel.call
    q, k, v, do = _dkdv_inputs(p, seed)
    decay = _decay(p, q.device) if decay is None else decay
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    state_shape = (p.batch, p.heads, p.dk, p.dv)
    dht = torch.randn(state_shape, generator=gen, device="cuda") if call.initial_state else None
    weight = (call.scale * decay)[:, None, None]  # kernel.backward's start and dH0
    nan = float("nan")
    dk, dv = torch.full_like(k, nan), torch.full_like(v, nan)
    final = torch.full(state_shape, nan, device="cuda") if call.final_state else None
    kernel.run_dkdv(q, k, v, do, decay, None if dht is None else dht / weight, final, dk=dk, dv=dv)
    torch.cuda.synchronize()
    _, want_dk, want_dv, want_dh0 = refs.chunked_backward(
        q, k, v, decay, kernel.config.chunk, do, scale=call.scale, dht=dht
    )
    pairs = [(dk, want_dk), (dv, want_dv)] + ([(final * weight, want_dh0)] if final is not None else [])
    return _verdict(pairs, final is not None)


def _verdict(pairs: list[tuple[torch.Tensor, torch.Tensor]], with_state: bool) -> dict[str, Any]:
    """``check``'s result for (result, reference) pairs; ``with_state``: the last pair is a
    state's (the final state, or dH0)."""
    errors = [refs.rel_l2(got, want) for got, want in pairs]
    return {
        "rel_l2": math.nan if any(math.isnan(e) for e in errors) else max(errors),
        "state_rel_l2": errors[-1] if with_state else None,
        "nan_count": sum(int(torch.isnan(got).sum()) for got, _ in pairs),
        "finite": all(bool(torch.isfinite(got).all()) for got, _ in pairs),
    }


def _decay(problem: Problem, device: torch.device) -> torch.Tensor:
    """RetNet's decays (``retnet_decay``): what the checks run with unless told."""
    return constant_decay(retnet_decay(problem.heads), problem.heads, device)


def _dkdv_inputs(problem: Problem, seed: int) -> tuple[torch.Tensor, ...]:
    """Fresh q, k, v and dO (like v) for the fused pass."""
    q, k, v = random_qkv(problem, seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 2)
    return q, k, v, torch.randn(v.shape, generator=gen, device="cuda").to(v.dtype)


def check_and_time(
    kernel: ScalarDecayKernel,
    *,
    seed: int,
    tolerance: float = refs.TOLERANCE,
    decay: torch.Tensor | None = None,
) -> dict[str, Any]:
    """``check``; then, when the kernel is correct, its latency (``kernel.timing.time_gpu``)
    on other fresh inputs with the same decay. The tuner passes a kernel built for
    ``model_call``, where correct means the output and the final state are within
    ``tolerance``, or for ``dkdv_call`` (``--sweep dkdv``), where it means dK and dV."""
    result = check(kernel, seed=seed, decay=decay)
    if result["finite"] and result["rel_l2"] < tolerance:
        p, call = kernel.problem, kernel.call
        states = [
            torch.randn(p.batch, p.heads, p.dk, p.dv, device="cuda") if wanted else None
            for wanted in (call.initial_state, call.final_state)
        ]
        if call.dkdv:
            q, k, v, do = _dkdv_inputs(p, seed + 1)
            decay = _decay(p, q.device) if decay is None else decay
            dk, dv = torch.empty_like(k), torch.empty_like(v)

            def timed():
                return kernel.run_dkdv(q, k, v, do, decay, *states, dk=dk, dv=dv)
        else:
            q, k, v = random_qkv(p, seed=seed + 1)
            out = torch.empty_like(v)

            def timed():
                return kernel(q, k, v, decay=decay, initial_state=states[0], final_state=states[1], out=out)

        result |= time_gpu(timed).to_dict()
    return result


def gated_inputs(problem: Problem, *, seed: int) -> tuple[torch.Tensor, ...]:
    """Fresh normal q, k ``[B, S, G, DK]`` and v ``[B, S, H, DV]`` of a per-token gate's
    problem on the GPU, and its fp32 log-gates ``g [B, S, H]``: -lo to -hi of
    ``kernel.config.GATE_RANGE``, their magnitudes spread evenly in log."""
    p, dtype = problem, TORCH_DTYPES[problem.dtype]
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(p.batch, p.seqlen, *shape, generator=gen, device="cuda")

    lo, hi = (math.log(x) for x in GATE_RANGE)
    g = -torch.exp(lo + (hi - lo) * torch.rand(p.batch, p.seqlen, p.heads, generator=gen, device="cuda"))
    q, k, v = (randn(h, d).to(dtype) for h, d in ((p.qk_heads, p.dk), (p.qk_heads, p.dk), (p.heads, p.dv)))
    return q, k, v, g


def check_and_time_gated(
    problem: Problem, config: KernelConfig, call: Call, *, seed: int, tolerance: float = refs.TOLERANCE
) -> dict[str, Any]:
    """``check_and_time`` of a per-token gate's forward (``kernel.gated``, ``tuner run --gate
    token``): ``config`` compiled for ``call`` on this GPU, run once on fresh inputs
    (``gated_inputs``; a fresh initial state where the call takes one) into NaN-filled
    outputs and compared in fp64 with reference C's per-token form
    (``refs.gated_kernel_mimic``: the output and the final state); then, when correct, timed
    on other fresh inputs (``kernel.timing.time_gpu``)."""
    from kernel.gated_build import compile_gated

    p = problem
    kernel = compile_gated(p, config, call, arch=cuda_arch())
    rows = p.batch * p.heads
    gamma = torch.zeros(p.heads, device="cuda")  # no per-head decay beside the gates

    def args(seed: int) -> tuple[torch.Tensor, ...]:
        q, k, v, g = gated_inputs(p, seed=seed)
        gen = torch.Generator(device="cuda").manual_seed(seed + 1)
        h0 = torch.randn(rows, 1, p.dk, p.dv, generator=gen, device="cuda")
        nan = torch.full((rows, 1, p.dk, p.dv), math.nan, device="cuda")
        return q, k, v, g, gamma, h0, torch.full_like(v, math.nan), nan

    q, k, v, g, _, h0, out, ht = checked = args(seed)
    kernel(*checked)
    torch.cuda.synchronize()
    ref, ref_state = refs.gated_kernel_mimic(
        q, k, v, g, config.chunk, block_dv=config.block_dv, scale=call.scale, output_final_state=True,
        initial_state=h0.view(p.batch, p.heads, p.dk, p.dv) if call.initial_state else None,
    )  # fmt: skip
    state = [(ht.view(ref_state.shape), ref_state)] if call.final_state else []
    result = _verdict([(out, ref), *state], call.final_state)
    if result["finite"] and result["rel_l2"] < tolerance:
        timed = args(seed + 2)
        result |= time_gpu(lambda: kernel(*timed)).to_dict()
    return result


# The copy's time of a decode step's states, by their bytes: the floor, measured once a
# process (a worker's) and recorded with every decode trial it times.
_COPY_MS: dict[int, float] = {}


def decode_inputs(kern: DecodeKernel, batch: int, *, seed: int) -> dict[str, torch.Tensor]:
    """Fresh inputs of one decode step of ``batch`` sequences: q, k, v ``[N, 1, H, D]``,
    RetNet's decays, a random pool of 2N rows (the kernel's pool dtype) and N distinct
    random slots among them (the other rows unused)."""
    p = kern.problem
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype, pool_dtype = TORCH_DTYPES[p.dtype], getattr(torch, p.pool_dtype)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k, v = (randn(batch, 1, p.heads, d).to(dtype) for d in (p.dk, p.dk, p.dv))
    rows = 2 * batch
    pool = randn(rows, p.heads, p.dk, p.dv).to(pool_dtype)
    slots = torch.randperm(rows, generator=gen, device="cuda")[:batch].to(getattr(torch, p.slot_dtype))
    decay = constant_decay(retnet_decay(p.heads), p.heads, q.device)
    return {"q": q, "k": k, "v": v, "decay": decay, "slots": slots, "pool": pool}


def check_decode(kern: DecodeKernel, batch: int, *, seed: int) -> dict[str, Any]:
    """One step of ``kern`` on fresh inputs (``decode_inputs``) into a NaN-filled output,
    against one step of reference A in fp64 from the same (rounded) states: ``rel_l2`` the
    largest relative L2 of the output, the updated states and the unused rows (which must
    not change), ``state_rel_l2`` the updated states', ``nan_count`` and ``finite`` as
    ``check``'s."""
    x = decode_inputs(kern, batch, seed=seed)
    pool, slots = x["pool"], x["slots"].long()
    before = pool.clone()
    unused = torch.ones(pool.shape[0], dtype=torch.bool, device="cuda")
    unused[slots] = False
    out = torch.full(x["v"].shape, float("nan"), dtype=x["v"].dtype, device="cuda")
    kern.run(x["q"], x["k"], x["v"], x["decay"], x["slots"], pool, out)
    torch.cuda.synchronize()
    ref_o, ref_state = refs.recurrent(
        x["q"].double(), x["k"].double(), x["v"].double(), x["decay"].double(),
        scale=kern.problem.scale, initial_state=before[slots].double(), output_final_state=True,
    )  # fmt: skip
    verdict = _verdict([(out, ref_o), (pool[slots], ref_state)], with_state=True)
    changed = float((pool[unused].double() - before[unused].double()).norm())
    if changed:  # a write outside the slots: as wrong as a wrong output
        verdict["rel_l2"] = max(
            verdict["rel_l2"], changed / max(float(before[unused].double().norm()), 1e-30)
        )
    return verdict


def check_and_time_decode(
    kern: DecodeKernel, batch: int, *, seed: int, tolerance: float = refs.TOLERANCE
) -> dict[str, Any]:
    """``check_decode``; then, when correct, the step's latency (``kernel.timing.time_gpu``)
    on other fresh inputs, and its floor: ``floor_ms``, the time of a device copy of the
    states it reads and writes (N x H x DK x DV of the pool's dtype, read once and written
    once), timed the same way in this process; ``x_floor`` the one over the other and
    ``copy_bytes_per_s`` the copy's rate (bytes read plus written per second)."""
    result = check_decode(kern, batch, seed=seed)
    if result["finite"] and result["rel_l2"] < tolerance:
        x = decode_inputs(kern, batch, seed=seed + 1)
        out = torch.empty_like(x["v"])
        result |= time_gpu(
            lambda: kern.run(x["q"], x["k"], x["v"], x["decay"], x["slots"], x["pool"], out)
        ).to_dict()
        nbytes = DecodeCase(batch, kern.problem).state_bytes()
        if nbytes not in _COPY_MS:
            src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            _COPY_MS[nbytes] = time_gpu(lambda: dst.copy_(src)).median_ms
        floor = _COPY_MS[nbytes]
        result |= {
            "floor_ms": floor,
            "x_floor": result["median_ms"] / floor,
            "copy_bytes_per_s": 2 * nbytes / (floor * 1e-3),
        }
    return result


def sweep(cases: list[Case], *, log: Path, seed: int = 0) -> list[dict]:
    """Compile all ``cases`` in the model form (``model_call``) in parallel, then check (and
    time, where asked) each in turn with its decay.

    Rows are appended to ``log`` (JSON lines) as they are measured, so a crash keeps them.
    """
    arch = cuda_arch()
    t0 = time.perf_counter()
    jobs = list(dict.fromkeys((p, c, model_call(p)) for p, c, _, _ in cases))
    probes = dict(zip(jobs, precompile(jobs, arch=arch)))
    print(f"compiled {len(jobs)} kernels in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for problem, config, timed, alpha in cases:
        res = probes[problem, config, model_call(problem)]
        row: dict[str, Any] = {
            **problem.to_dict(),
            **config.to_dict(),
            "config": config.label,
            "decay": "retnet" if alpha is None else alpha,
            **res.to_dict(),
        }
        if isinstance(res, ProbeFailure):
            row["status"] = "compile_failed"
        elif not res.fits_smem:
            row["status"] = "over_smem_limit"
        else:
            kernel = build(problem, config, model_call(problem))
            decay = None if alpha is None else constant_decay(alpha, problem.heads, torch.device("cuda"))
            row |= (check_and_time if timed else check)(kernel, seed=seed, decay=decay)
            row["status"] = "ok" if row["rel_l2"] < refs.TOLERANCE else "incorrect"
        rows.append(row)
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    return rows


def headline_cases() -> list[Case]:
    """Every single-pass config at the headline shape with RetNet's decays, timed; the
    notable ones also at every constant decay of ``ALPHAS``, and in bfloat16."""
    cases: list[Case] = [(HEADLINE, c, True, None) for c in validation_grid(HEADLINE.dv)]
    notable = [SEED_CONFIG, KernelConfig(64, 64, 1, 128), KernelConfig(64, 128, 2, 256)]
    bf16 = Problem(**(HEADLINE.to_dict() | {"dtype": "bfloat16"}))
    for config, problem, alpha in itertools.product(notable, (HEADLINE, bf16), (None, *ALPHAS)):
        if (problem, alpha) != (HEADLINE, None):
            cases.append((problem, config, True, alpha))
    return cases


def markdown(rows: list[dict], env: dict[str, Any]) -> str:
    """The committed table: config, decay, dtype, error against C, latency."""
    lines = [
        f"GPU: {env['gpu']} (sm {env['capability']}), torch {env['torch']}, CUDA {env['cuda']}, "
        f"tilelang {env['tilelang']}. Shape B={HEADLINE.batch}, H={HEADLINE.heads}, "
        f"S={HEADLINE.seqlen}, DK=DV={HEADLINE.dk}. Latency: median of CUDA-event timings "
        "after warm-up, L2 flushed before each repetition. Model form: scale DK^-1/2, the final "
        "state returned; the error is the larger of the output's and the state's; decay "
        "'retnet': RetNet's per-head gammas, a number: that alpha for every head.",
        "",
        "| config | decay | dtype | status | rel L2 vs C | median ms | p20-p80 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r.get("median_ms", float("inf")), str(r["decay"]))):
        err = f"{r['rel_l2']:.2e}" if "rel_l2" in r else "-"
        lat = f"{r['median_ms']:.3f}" if "median_ms" in r else "-"
        spread = f"{r['p20_ms']:.3f}-{r['p80_ms']:.3f}" if "median_ms" in r else "-"
        lines.append(
            f"| {r['config']} | {r['decay']} | {r['dtype']} | {r['status']} | {err} | {lat} | {spread} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernel.validate", description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="directory for the JSON and markdown")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel.validate needs a CUDA device; none is visible", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "kernel_validation.jsonl"
    log.unlink(missing_ok=True)
    env = environment()
    rows = sweep(headline_cases(), log=log)
    (args.out / "kernel_validation.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    (args.out / "kernel_validation.md").write_text(markdown(rows, env))
    print(markdown(rows, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
