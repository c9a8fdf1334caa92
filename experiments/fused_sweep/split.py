"""Issue 18: the fused dk+dv sweep split along the sequence, prototyped outside the product
(since its H200 run, ``kernel.dkdv`` builds it, and this script times the product's).

Where the batch has few (batch, head) pairs the backward runs its sweeps split
(``kernel.seq_split``, reversed), since the fused sweep's one block per pair leaves SMs
idle (at 2x16x16384: 1.080 ms fused, 0.635 in three split sweeps). Split, the fused
sweep is three kernels: the dv sweep's reversed ``states`` and ``carry`` kernels of
``kernel.seq_split`` on (K := Q, V := dO), which give dS entering each segment from its
end, then one block per (batch, head, segment) running ``kernel.dkdv.sweep_macro`` over
its segment from that state; segment 0's blocks leave dS at the first token. It reads Q
and dO twice and K, V once, and writes dK, dV: 8 tensor moves where the two split sweeps
make 12.

    python3 experiments/fused_sweep/split.py --compile-only   # CPU: ptxas's figures
    python3 experiments/fused_sweep/split.py --out DIR        # GPU: check, then time

On the GPU: dK, dV and dH0 against ``refs.chunked_backward`` in fp64 (NaN-filled outputs,
ragged last segments and chunks, states in and out), then at 2x16x16384 fp16 the split
fused sweep (2, 4 and 8 segments) against the two split sweeps ``decay_attention`` runs
there, in one run (``kernel.timing.alternating``). Writes DIR/split.json.
"""

import argparse
import dataclasses
import itertools
import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from kernel.config import Problem  # noqa: E402

TIMED = Problem(2, 16, 16384, 128, 128, "float16")
SEGMENTS = (2, 4, 8)


def prim_funcs(
    problem: Problem, segments: int, *, scale: float, initial_state: bool, final_state: bool, arch: str
):
    """``(config, (states, carry, outputs))``: the split fused sweep, since this run the
    product's (``kernel.dkdv.prim_funcs`` with ``segments``), whose generated CUDA is
    byte-identical to the prototype's of 6a86f39 (README)."""
    from kernel import dkdv

    config = dataclasses.replace(dkdv.dkdv_config(problem, arch), segments=segments)
    call = {"scale": scale, "initial_state": initial_state, "final_state": final_state}
    return config, tuple(dkdv.prim_funcs(problem, config, arch=arch, packed=False, **call))


def compile_split(problem: Problem, segments: int, initial: bool, final: bool, arch: str):
    """``(config, prim funcs, compiled kernels)``, compiled through TileLang's disk cache."""
    from kernel.arch import target
    from kernel.probe import _compile

    config, funcs = prim_funcs(
        problem, segments, scale=problem.dk**-0.5, initial_state=initial, final_state=final, arch=arch
    )
    return config, funcs, _compile(list(funcs), target(arch))


def _compiles(job: tuple) -> str:
    try:
        compile_split(*job)
    except Exception as exc:  # a case TileLang cannot lower: say why
        return f"{type(exc).__name__}: {exc}"[:300]
    return "ok"


def compile_only() -> list[dict]:
    """ptxas's figures of each kernel at the timed shape, sm_90a, with states and without."""
    from kernel.probe import _ptxas, launch_resources, lower, parse_ptxas

    rows = []
    for segments, (initial, final) in itertools.product(SEGMENTS, [(False, False), (True, True)]):
        row: dict = {"segments": segments, "states": initial}
        try:
            _, funcs, kernels = compile_split(TIMED, segments, initial, final, "sm_90a")
        except Exception as exc:
            rows.append(row | {"error": f"{type(exc).__name__}: {exc}"[:500]})
            continue
        for name, func, kernel in zip(("states", "carry", "outputs"), funcs, kernels):
            ok, log = _ptxas(kernel.get_kernel_source(), "sm_90a")
            figures = parse_ptxas(log) if ok else {"ptxas_error": log[-1000:]}
            smem, threads = launch_resources(kernel.artifact or lower(func, arch="sm_90a"))
            rows.append(
                row | {"kernel": name} | figures | {"dynamic_smem": smem, "threads_launched": threads}
            )
    return rows


def gpu(out: Path) -> dict:
    import torch

    import refs
    from kernel.builder import build, constant_decay, cuda_arch, precompile
    from kernel.config import Call, retnet_decay
    from kernel.ops import serve
    from kernel.ops.backward import pass_calls
    from kernel.timing import alternating
    from kernel.validate import random_qkv
    from kernel.variants import launches_carry, states_buffer

    arch = cuda_arch()
    result: dict = {"checks": [], "timing": {}}
    # (b, h, s, dtype, segments): a ragged last segment and chunk, two segments, bf16.
    cases = [(2, 3, 1000, "float16", 4), (1, 2, 300, "float16", 2), (2, 2, 777, "bfloat16", 8)]
    states_cases = [(False, False), (True, True), (True, False)]
    jobs = [
        (Problem(b, h, s, 128, 128, d), p, i, f, arch) for b, h, s, d, p in cases for i, f in states_cases
    ]
    jobs += [(TIMED, p, False, False, arch) for p in SEGMENTS]
    with ProcessPoolExecutor(len(jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        result["compiled"] = dict(zip(map(str, jobs), pool.map(_compiles, jobs)))

    def run(problem, segments, initial, final, q, k, v, do, decay, start):
        config, _, (states_k, carry_k, outputs_k) = compile_split(problem, segments, initial, final, arch)
        states = states_buffer(problem, config, q.device).fill_(float("nan"))
        ht = torch.full((problem.batch * problem.heads, 1, 128, 128), float("nan"), device=q.device)
        dk_, dv_ = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        states_k(q, do, decay, start, states)
        if launches_carry(problem, config, Call(initial_state=initial)):
            carry_k(decay, states)
        outputs_k(q, k, v, do, decay, states, ht, dk_, dv_)
        return dk_, dv_, ht

    for (b, h, s, dtype, segments), (initial, final) in itertools.product(cases, states_cases):
        problem = Problem(b, h, s, 128, 128, dtype)
        q, k, v = random_qkv(problem, seed=s)
        do = torch.randn_like(v, dtype=torch.float32).to(v.dtype)
        decay = torch.tensor([0.05, 0.9, 0.999][:h], device="cuda")
        h0, dht = (torch.randn(b, h, 128, 128, device="cuda") for _ in range(2))
        scale = 128**-0.5
        _, want_dk, want_dv, want_dh0 = refs.chunked_backward(
            q, k, v, decay, 64, do, scale=scale, initial_state=h0, dht=dht if initial else None
        )
        weight = (scale * decay)[:, None, None]  # kernel.backward's start and dH0
        start = (dht / weight if initial else torch.empty_like(dht)).reshape(b * h, 1, 128, 128)
        dk_, dv_, ht = run(problem, segments, initial, final, q, k, v, do, decay, start)
        torch.cuda.synchronize()
        check = {"shape": f"{b}x{h}x{s}", "dtype": dtype, "segments": segments, "state_in": initial}
        check |= {
            "state_out": final,
            "dk_rel_l2": refs.rel_l2(dk_, want_dk),
            "dv_rel_l2": refs.rel_l2(dv_, want_dv),
        }
        nan = int(dk_.isnan().sum() + dv_.isnan().sum())
        if final:
            check["dh0_rel_l2"] = refs.rel_l2(ht.reshape(b, h, 128, 128) * weight, want_dh0)
            nan += int(ht.isnan().sum())
        check["nan"] = nan
        result["checks"].append(check)
        print(json.dumps(check), flush=True)

    # Timing at 2x16x16384: the split fused sweep against the two split sweeps.
    scale = 128**-0.5
    q, k, v = random_qkv(TIMED, seed=1)
    do = torch.randn_like(v, dtype=torch.float32).to(v.dtype)
    decay = constant_decay(retnet_decay(16), 16, q.device)
    (_, _), (p_dk, c_dk), (p_dv, c_dv) = pass_calls(TIMED, Call(scale))
    sweeps = [serve.kernel_job(p_dk, c_dk, 2), serve.kernel_job(p_dv, c_dv, 2)]
    precompile(sweeps, arch=arch)
    dk_sweep, dv_sweep = (build(*job) for job in sweeps)
    calls = {"two sweeps": lambda: (dk_sweep(v, do, q, decay=decay), dv_sweep(k, q, do, decay=decay))}
    unused = torch.empty(2 * 16, 1, 128, 128, device="cuda")
    for segments in SEGMENTS:
        config, _, (states_k, carry_k, outputs_k) = compile_split(TIMED, segments, False, False, arch)
        states = states_buffer(TIMED, config, q.device)
        dk_, dv_ = torch.empty_like(k), torch.empty_like(v)
        carries = launches_carry(TIMED, config)

        def fused(states_k=states_k, carry_k=carry_k, outputs_k=outputs_k, states=states, carries=carries):
            states_k(q, do, decay, unused, states)
            if carries:
                carry_k(decay, states)
            outputs_k(q, k, v, do, decay, states, unused, dk_, dv_)

        calls[f"fused split {segments}"] = fused
    times = alternating(calls)
    result["timing"] = {
        "shape": "2x16x16384",
        "sweep_configs": [dk_sweep.config.label, dv_sweep.config.label],
    }
    result["timing"]["median_ms"] = {n: sorted(t)[1] for n, t in times.items()}
    result["timing"]["rounds_ms"] = times
    out.mkdir(parents=True, exist_ok=True)
    (out / "split.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["timing"], indent=1))
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile-only", action="store_true", help="ptxas's figures (no GPU)")
    parser.add_argument("--out", type=Path, help="where the GPU run writes split.json")
    args = parser.parse_args()
    if args.compile_only:
        for row in compile_only():
            print(json.dumps(row), flush=True)
        return 0
    if args.out is None:
        parser.error("--out is required for the GPU run")
    gpu(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
