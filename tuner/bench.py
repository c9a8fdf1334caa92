"""Benchmark over a grid of shapes, all in one process on one GPU: the tuned kernel, the
seed's default config, fla's ``chunk_simple_gla`` and plain torch, each against the
shape's HBM floor (the bytes of Q, K, V and O and of the final state, over the copy
bandwidth measured in the same run); then a packed batch of sequences of mixed lengths,
``kernel.ops.attention.decay_attention`` against fla with ``cu_seqlens``; then, per shape, the
backward and forward plus backward of ``decay_attention``'s autograd against fla's
``chunk_simple_gla`` with autograd, each against its floor (``backward_bytes``).

Each row times the GPU with the host's launches queued ahead (``kernel.timing.time_gpu``'s
``host_ahead``) and gives the host's time per call beside it (``host_ms``).

Every implementation runs the model form, with the same arguments: RetNet's decay per
head (``kernel.config.retnet_decay``; fla's ``g_gamma`` is its log), the query scale
``DK^-1/2`` and the final state returned (``kernel.config.model_call``). Each is checked
against reference C before timing; its error is the larger of the output's and the final
state's.

"Tuned" is the config a dispatch table (``python -m tuner dispatch``) picks for the shape
when one is given; otherwise the fastest correct config among the tuner's first configs
(``tuner.space.wave_seeds``), timed on that very shape.
"""

import csv
import importlib.util
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import refs
from kernel.builder import build, constant_decay, cuda_arch, precompile, sm_count
from kernel.config import SEED_CONFIG, Call, KernelConfig, Problem, model_call, retnet_decay
from kernel.ops.dispatch import Dispatch
from kernel.resources import ProbeFailure
from kernel.timing import time_gpu
from kernel.validate import random_qkv
from tuner import space
from tuner.options import BENCH_PACKED, Packed
from tuner.peers import fla_simple_gla, torch_chunked

COPY_BYTES = 1 << 30
STATE_BYTES = 4  # the final state is fp32


def traffic_bytes(problem: Problem, *, sequences: int | None = None) -> int:
    """Fewest bytes a forward pass moves: Q, K and V read once, O written once (fp16 /
    bf16 elements), and the fp32 final state of each sequence (``problem.batch``, or
    ``sequences`` of a packed batch) written once."""
    p = problem
    n = p.batch if sequences is None else sequences
    return p.batch * p.seqlen * p.heads * (2 * p.dk + 2 * p.dv) * 2 + n * p.heads * p.dk * p.dv * STATE_BYTES


def backward_bytes(problem: Problem) -> int:
    """Fewest bytes a backward moves: Q, K, V and dO read, dQ, dK and dV written once."""
    p = problem
    return p.batch * p.seqlen * p.heads * (4 * p.dk + 3 * p.dv) * 2


def copy_bandwidth() -> float:
    """Device-to-device copy rate in bytes/s (bytes read plus bytes written)."""
    src = torch.randn(COPY_BYTES // 4, device="cuda")
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / (time_gpu(lambda: dst.copy_(src)).median_ms * 1e-3)


def model_error(got: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> dict:
    """``rel_l2``: the largest relative L2 of the results against the reference's (NaN if
    any is): the output and the final state against reference C, or the gradients against
    reference E; for an output and a state, ``state_rel_l2``: the state's alone."""
    errors = [refs.rel_l2(g, r) for g, r in zip(got, ref)]
    worst = math.nan if any(math.isnan(e) for e in errors) else max(errors)
    return {"rel_l2": worst} | ({"state_rel_l2": errors[1]} if len(errors) == 2 else {})


def _row(
    shape: dict[str, Any],
    impl: str,
    config: KernelConfig | str | None,
    fn: Callable[[], tuple[torch.Tensor, ...]],
    ref: tuple[torch.Tensor, ...],
    floor_ms: float,
    log: Path | None,
) -> dict[str, Any]:
    label = config.label if isinstance(config, KernelConfig) else config or ""
    row = {**shape, "impl": impl, "config": label, **model_error(fn(), ref)}
    if row["rel_l2"] < refs.TOLERANCE:
        row |= time_gpu(fn, host_ahead=True).to_dict()
        row["x_floor"] = row["median_ms"] / floor_ms
    print(row, flush=True)
    if log is not None:  # one JSON line per measurement, so a killed run keeps what it measured
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def _floor_row(shape: dict[str, Any], floor_ms: float, bandwidth: float) -> dict[str, Any]:
    return {
        **shape,
        "impl": "floor",
        "median_ms": floor_ms,
        "x_floor": 1.0,
        "bandwidth_tb_s": bandwidth / 1e12,
    }


def served_by(dispatch: Dispatch, problem: Problem) -> str:
    """Where the dispatch table's pick for ``problem`` comes from, for the bench's rows."""
    entry = dispatch.pick(problem)
    tuned = entry.problem
    if (tuned.batch, tuned.heads, tuned.seqlen) == (problem.batch, problem.heads, problem.seqlen):
        return "dispatch table: tuned at this shape"
    return f"dispatch table: served by the entry tuned at {tuned.batch}x{tuned.heads}x{tuned.seqlen}"


def _shape(problem: Problem) -> dict[str, Any]:
    p = problem
    return {"batch": p.batch, "heads": p.heads, "seqlen": p.seqlen, "dk": p.dk, "dv": p.dv, "decay": "retnet"}


def run(
    shapes: list[tuple[int, int, int]],
    *,
    dk: int = 128,
    dv: int = 128,
    dtype: str = "float16",
    dispatch: Dispatch | None = None,
    packed: Packed | None = BENCH_PACKED,
    backward: bool = True,
    log: Path | None = None,
) -> list[dict]:
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    problems = [Problem(b, h, s, dk, dv, dtype) for b, h, s in shapes]
    candidates = {
        p: [dispatch.pick(p).config] if dispatch else space.wave_seeds(p, arch=cuda_arch(), sms=sm_count())
        for p in problems
    }
    jobs = [(p, c, model_call(p)) for p in problems for c in dict.fromkeys([SEED_CONFIG, *candidates[p]])]
    probes = dict(zip(jobs, precompile(jobs, arch=cuda_arch())))
    rows = []
    for problem in problems:
        shape, call = _shape(problem), model_call(problem)
        floor_ms = traffic_bytes(problem) / bandwidth * 1e3
        q, k, v = random_qkv(problem, seed=0)
        decay = constant_decay(retnet_decay(problem.heads), problem.heads, q.device)
        g_gamma = decay.log()  # fla's log-decay, made once as a model holds it
        ref = refs.kernel_mimic(q, k, v, decay, 64, scale=call.scale, output_final_state=True)
        rows.append(_floor_row(shape, floor_ms, bandwidth))
        out = torch.empty_like(v)
        final = torch.empty(problem.batch, problem.heads, dk, dv, device=q.device)
        timed = {}
        for config in dict.fromkeys([SEED_CONFIG, *candidates[problem]]):
            res = probes[problem, config, call]
            if isinstance(res, ProbeFailure) or not res.fits_smem:
                continue
            kern = build(problem, config, call)

            def ours(kern=kern):
                return kern(q, k, v, decay=decay, final_state=final, out=out), final

            impl = "seed config" if config == SEED_CONFIG else "candidate"
            timed[config] = _row(shape, impl, config, ours, ref, floor_ms, log)
        rows += timed.values()
        ok = [r for c, r in timed.items() if c in candidates[problem] and "median_ms" in r]
        if ok:
            tuned_by = (
                served_by(dispatch, problem) if dispatch else f"best of {len(candidates[problem])} candidates"
            )
            rows.append(min(ok, key=lambda r: r["median_ms"]) | {"impl": "tuned", "tuned_by": tuned_by})
        try:
            fla = lambda: fla_simple_gla(q, k, v, g_gamma, scale=call.scale)  # noqa: E731
            rows.append(_row(shape, "fla chunk_simple_gla", None, fla, ref, floor_ms, log))
        except ImportError:
            print("fla is not installed: no fla column", file=sys.stderr)
        plain = lambda: torch_chunked(q, k, v, decay, scale=call.scale)  # noqa: E731
        rows.append(_row(shape, "torch chunked", None, plain, ref, floor_ms, log))
        del ref
    if packed is not None:
        rows += run_packed(packed, dk=dk, dv=dv, dtype=dtype, dispatch=dispatch, bandwidth=bandwidth, log=log)
    if backward:
        rows += run_backward(problems, dispatch=dispatch, bandwidth=bandwidth, log=log)
    return rows


def run_backward(
    problems: list[Problem], *, dispatch: Dispatch | None, bandwidth: float, log: Path | None = None
) -> list[dict]:
    """Per shape, the backward alone (autograd over a kept graph) and the forward plus
    backward of ``decay_attention`` (serving ``dispatch``'s picks for its sweeps,
    ``kernel.ops.backward``) and of fla's ``chunk_simple_gla``, with the same arguments (RetNet's
    decays, scale, no state), each row's gradients checked against reference E. Their
    kernels compile first, in parallel processes, never inside the timing process, where a
    compile slows the timings (measured: experiments/h200/backward/README.md)."""
    from kernel.ops import decay_attention, serve

    rows = []
    serve.use_table(dispatch)
    try:
        jobs = set()
        for problem in problems:
            jobs |= serve.training_jobs(problem, Call(model_call(problem).scale), problem.batch)
        precompile(sorted(jobs, key=str), arch=cuda_arch())
        for problem in problems:
            shape = _shape(problem)
            floor_ms = backward_bytes(problem) / bandwidth * 1e3
            both_floor_ms = floor_ms + traffic_bytes(problem) / bandwidth * 1e3
            q, k, v = (x.requires_grad_() for x in random_qkv(problem, seed=2))
            do = torch.randn_like(v, dtype=torch.float32).to(v.dtype)
            decay = constant_decay(retnet_decay(problem.heads), problem.heads, q.device)
            g_gamma, scale = decay.log(), model_call(problem).scale
            ref = refs.chunked_backward(q.detach(), k.detach(), v.detach(), decay, 64, do, scale=scale)[:3]
            rows.append(_floor_row(shape | {"pass": "backward"}, floor_ms, bandwidth))
            rows.append(_floor_row(shape | {"pass": "fwd+bwd"}, both_floor_ms, bandwidth))
            forwards = {"decay_attention": lambda: decay_attention(q, k, v, decay, scale=scale)[0]}
            if importlib.util.find_spec("fla") is not None:
                forwards["fla chunk_simple_gla"] = lambda: fla_simple_gla(
                    q, k, v, g_gamma, scale=scale, output_final_state=False
                )[0]
            else:
                print("fla is not installed: no fla column", file=sys.stderr)
            sweeps = serve.backward_configs(problem, Call(scale), problem.batch)
            served = {name: None for name in forwards}  # which sweeps ran ours, with which configs
            served["decay_attention"] = ", ".join(f"{n} {c.label}" for n, c in sweeps.items())
            for name, forward in forwards.items():
                kept = forward()

                def backward_only(kept=kept):
                    return torch.autograd.grad(kept, (q, k, v), do, retain_graph=True)

                def both(forward=forward):
                    return torch.autograd.grad(forward(), (q, k, v), do)

                for label, fn, floor in (
                    ("backward", backward_only, floor_ms),
                    ("fwd+bwd", both, both_floor_ms),
                ):
                    row = _row(shape | {"pass": label}, f"{name} {label}", served[name], fn, ref, floor, log)
                    rows.append(row)
                del kept
            del ref
    finally:
        serve.use_table(None)
    return rows


def run_packed(
    packed: Packed,
    *,
    dk: int,
    dv: int,
    dtype: str,
    dispatch: Dispatch | None,
    bandwidth: float,
    log: Path | None = None,
) -> list[dict]:
    """The packed batch: ``decay_attention`` (serving ``dispatch``'s picks where given,
    else the default config) and fla, each with ``cu_seqlens``, in the model form."""
    from kernel.ops import decay_attention, serve

    offsets = packed.cu_seqlens()
    problem = Problem(1, packed.heads, offsets[-1], dk, dv, dtype)  # [1, T, H, D]
    n = packed.sequences
    shape = _shape(problem) | {"batch": n, "packed": f"{n} sequences of {packed.shortest}-{packed.longest}"}
    floor_ms = traffic_bytes(problem, sequences=n) / bandwidth * 1e3
    q, k, v = random_qkv(problem, seed=1)
    decay = constant_decay(retnet_decay(problem.heads), problem.heads, q.device)
    g_gamma, scale = decay.log(), model_call(problem).scale
    cu = torch.tensor(offsets, dtype=torch.int32, device=q.device)
    cu_long, cu_cpu = cu.long(), torch.tensor(offsets, dtype=torch.long)
    ref = refs.kernel_mimic(q, k, v, decay, 64, scale=scale, cu_seqlens=cu, output_final_state=True)
    rows = [_floor_row(shape, floor_ms, bandwidth)]
    serve.use_table(dispatch)
    try:

        def ours():
            return decay_attention(q, k, v, decay, scale=scale, output_final_state=True, cu_seqlens=cu)

        impl = "decay_attention" + (" (dispatch table)" if dispatch else " (default config)")
        rows.append(_row(shape, impl, None, ours, ref, floor_ms, log))
    finally:
        serve.use_table(None)
    try:
        fla = lambda: fla_simple_gla(  # noqa: E731
            q, k, v, g_gamma, scale=scale, cu_seqlens=cu_long, cu_seqlens_cpu=cu_cpu
        )
        rows.append(_row(shape, "fla chunk_simple_gla", None, fla, ref, floor_ms, log))
    except ImportError:
        print("fla is not installed: no fla column", file=sys.stderr)
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def bench_and_write(
    shapes: list[tuple[int, int, int]],
    out: Path,
    *,
    dk: int,
    dv: int,
    dtype: str = "float16",
    dispatch: Dispatch | None = None,
    packed: Packed | None = BENCH_PACKED,
    backward: bool = True,
) -> None:
    """Run the bench and write ``out``/bench.csv, bench.jsonl and bench.html; print a table."""
    from reports.bench_figure import figure

    out.mkdir(parents=True, exist_ok=True)
    log = out / "bench.jsonl"
    log.unlink(missing_ok=True)
    rows = run(
        shapes, dk=dk, dv=dv, dtype=dtype, dispatch=dispatch, packed=packed, backward=backward, log=log
    )
    write_csv(rows, out / "bench.csv")
    figure(rows).write_html(out / "bench.html", include_plotlyjs=True)
    for r in rows:
        if "median_ms" in r and r["impl"] != "candidate":
            impl = f"{r['pass']} floor" if r["impl"] == "floor" and "pass" in r else r["impl"]
            print(
                f"{r['batch']:>3} {r['heads']:>3} {r['seqlen']:>6} {impl:<32} {r.get('config', ''):<20} "
                f"{r['median_ms']:8.4f} ms {r['x_floor']:6.2f}x floor"
                + (f"  host {r['host_ms']:.3f} ms" if "host_ms" in r else "")
            )
