"""Benchmark over a grid of shapes, all in one process on one GPU, for the forward and for
the backward and forward plus backward, each against the shape's HBM floor
(``tuner.bench_rows``): what a model gets **out of the box** (no table of the user's: the
table shipped for this GPU, else the rule of ``kernel.rule``), the **tuned** kernel,
the seed's config (forward), fla's ``chunk_simple_gla`` and plain torch (forward); then
a packed batch of sequences of mixed lengths with ``cu_seqlens``, ours against fla.

"Tuned" is the config the user's dispatch table (``python -m tuner dispatch``) picks for
the shape when one is given; otherwise, for the forward, the fastest correct config
among the tuner's first configs (``tuner.space.wave_seeds``), timed on that very shape.

Every implementation runs the model form, with the same arguments: RetNet's decay per
head (``kernel.config.retnet_decay``; fla's ``g_gamma`` is its log), the query scale
``DK^-1/2`` and, forward, the final state returned (``kernel.config.model_call``). Each
is checked before timing: the output and final state against reference C, gradients
against reference E.
"""

import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import torch

import refs
from kernel.builder import build, constant_decay, cuda_arch, memory_bandwidth, precompile, sm_count
from kernel.config import SEED_CONFIG, Call, Problem, model_call, retnet_decay
from kernel.environment import environment
from kernel.ops.dispatch import Dispatch
from kernel.ops.tables import shipped_table
from kernel.probe import ProbeFailure
from kernel.validate import random_qkv
from tuner import space
from tuner.bench_rows import (
    OUT_OF_THE_BOX,
    TUNED,
    backward_bytes,
    copy_bandwidth,
    floor_row,
    print_table,
    shape_row,
    timed_row,
    write_csv,
)
from tuner.occupancy import traffic_bytes
from tuner.options import BENCH_PACKED, Packed
from tuner.peers import fla_simple_gla, torch_chunked

TORCH_CHUNK = 64  # the plain-torch peer's chunk: it serves lengths of whole chunks alone


def out_of_the_box() -> tuple[Dispatch | None, str]:
    """What a fresh process serves where the user names no table (``DECAY_TUNER_TABLE`` is
    not read): the table shipped for this GPU, else None (the rule); and where it came from."""
    table = shipped_table(environment())
    return table, "the shipped table" if table else "the rule (kernel.rule)"


def served_by(dispatch: Dispatch, problem: Problem) -> str:
    """Where the dispatch table's pick for ``problem`` comes from, for the bench's rows."""
    entry = dispatch.pick(problem)
    tuned = entry.problem
    if (tuned.batch, tuned.heads, tuned.seqlen) == (problem.batch, problem.heads, problem.seqlen):
        return "dispatch table: tuned at this shape"
    return f"dispatch table: served by the entry tuned at {tuned.batch}x{tuned.heads}x{tuned.seqlen}"


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
    from kernel.ops.serve import config_for

    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    arch, sms, rate = cuda_arch(), sm_count(), memory_bandwidth()
    table, source = out_of_the_box()
    problems = [Problem(b, h, s, dk, dv, dtype) for b, h, s in shapes]
    default = {p: config_for(p, table, arch=arch, sms=sms, bandwidth=rate) for p in problems}
    candidates = {
        p: [dispatch.pick(p).config]
        if dispatch
        else space.wave_seeds(space.search_space(p, arch=arch), sms=sms, bandwidth=rate)
        for p in problems
    }
    configs = {p: list(dict.fromkeys([SEED_CONFIG, *candidates[p], default[p]])) for p in problems}
    jobs = [(p, c, model_call(p)) for p in problems for c in configs[p]]
    probes = dict(zip(jobs, precompile(jobs, arch=arch)))
    rows = []
    for problem in problems:
        shape, call = shape_row(problem), model_call(problem)
        floor_ms = traffic_bytes(problem) / bandwidth * 1e3
        q, k, v = random_qkv(problem, seed=0)
        decay = constant_decay(retnet_decay(problem.heads), problem.heads, q.device)
        g_gamma = decay.log()  # fla's log-decay, made once as a model holds it
        ref = refs.kernel_mimic(q, k, v, decay, 64, scale=call.scale, output_final_state=True)
        rows.append(floor_row(shape, floor_ms, bandwidth))
        out = torch.empty_like(v)
        final = torch.empty(problem.batch, problem.heads, dk, dv, device=q.device)
        timed = {}
        for config in configs[problem]:
            res = probes[problem, config, call]
            if isinstance(res, ProbeFailure) or not res.fits_smem:
                print(f"{problem}: {config.label} does not compile or fit: not timed", file=sys.stderr)
                continue
            kern = build(problem, config, call)

            def ours(kern=kern):
                return kern(q, k, v, decay=decay, final_state=final, out=out), final

            impl, extra = "seed config" if config == SEED_CONFIG else "candidate", {}
            if config not in (SEED_CONFIG, *candidates[problem]):  # the out-of-box config alone
                impl, extra = OUT_OF_THE_BOX, {"tuned_by": source}
            out.fill_(math.nan)  # what an earlier config wrote cannot pass for this one's
            final.fill_(math.nan)
            timed[config] = timed_row(shape | extra, impl, config, ours, ref, floor_ms, log)
        rows += timed.values()
        served = timed.get(default[problem], {})
        if served.get("impl") not in (None, OUT_OF_THE_BOX):
            rows.append(served | {"impl": OUT_OF_THE_BOX, "tuned_by": source})
        ok = [r for c, r in timed.items() if c in candidates[problem] and "median_ms" in r]
        if ok:
            tuned_by = (
                served_by(dispatch, problem) if dispatch else f"best of {len(candidates[problem])} candidates"
            )
            rows.append(min(ok, key=lambda r: r["median_ms"]) | {"impl": TUNED, "tuned_by": tuned_by})
        try:
            fla = lambda: fla_simple_gla(q, k, v, g_gamma, scale=call.scale)  # noqa: E731
            rows.append(timed_row(shape, "fla chunk_simple_gla", None, fla, ref, floor_ms, log))
        except ImportError:
            print("fla is not installed: no fla column", file=sys.stderr)
        if problem.seqlen % TORCH_CHUNK:
            print(f"{problem}: S is not whole chunks of {TORCH_CHUNK}: no torch column", file=sys.stderr)
        else:
            plain = lambda: torch_chunked(q, k, v, decay, scale=call.scale, chunk=TORCH_CHUNK)  # noqa: E731
            rows.append(timed_row(shape, "torch chunked", None, plain, ref, floor_ms, log))
        del ref
    servings = {OUT_OF_THE_BOX: table, **({TUNED: dispatch} if dispatch else {})}
    if packed is not None:
        rows += run_packed(packed, dk=dk, dv=dv, dtype=dtype, servings=servings, bandwidth=bandwidth, log=log)
    if backward:
        rows += run_backward(problems, servings=servings, bandwidth=bandwidth, log=log)
    return rows


def run_backward(
    problems: list[Problem],
    *,
    servings: dict[str, Dispatch | None],
    bandwidth: float,
    log: Path | None = None,
) -> list[dict]:
    """Per shape, the backward alone (autograd over a kept graph) and the forward plus
    backward of ``decay_attention`` under each of ``servings`` (a name and the table its
    sweeps are served from, ``kernel.ops.serve.use_table``) and of fla's
    ``chunk_simple_gla``, with the same arguments (RetNet's decays, scale, no state), each
    row's gradients checked against reference E. Their kernels compile first, in parallel
    processes, never inside the timing process, where a compile slows the timings
    (measured: experiments/backward/README.md)."""
    from kernel.ops import decay_attention, serve

    rows = []
    try:
        jobs = set()
        for table in servings.values():
            serve.use_table(table)
            for problem in problems:
                jobs |= serve.training_jobs(problem, Call(model_call(problem).scale), problem.batch)
        precompile(sorted(jobs, key=str), arch=cuda_arch())
        for problem in problems:
            shape = shape_row(problem)
            floor_ms = backward_bytes(problem) / bandwidth * 1e3
            both_floor_ms = floor_ms + traffic_bytes(problem) / bandwidth * 1e3
            q, k, v = (x.requires_grad_() for x in random_qkv(problem, seed=2))
            do = torch.randn_like(v, dtype=torch.float32).to(v.dtype)
            decay = constant_decay(retnet_decay(problem.heads), problem.heads, q.device)
            g_gamma, scale = decay.log(), model_call(problem).scale
            ref = refs.chunked_backward(q.detach(), k.detach(), v.detach(), decay, 64, do, scale=scale)[:3]
            rows.append(floor_row(shape | {"pass": "backward"}, floor_ms, bandwidth))
            rows.append(floor_row(shape | {"pass": "fwd+bwd"}, both_floor_ms, bandwidth))
            forwards: dict[str, tuple[Any, Dispatch | None | str]] = {
                name: (lambda: decay_attention(q, k, v, decay, scale=scale)[0], table)
                for name, table in servings.items()
            }
            if importlib.util.find_spec("fla") is not None:
                fla = lambda: fla_simple_gla(q, k, v, g_gamma, scale=scale, output_final_state=False)[0]  # noqa: E731
                forwards["fla chunk_simple_gla"] = (fla, "fla")
            else:
                print("fla is not installed: no fla column", file=sys.stderr)
            for name, (forward, table) in forwards.items():
                served = None  # which sweeps ran ours, with which configs
                if table != "fla":
                    serve.use_table(table)
                    sweeps = serve.backward_configs(problem, Call(scale), problem.batch)
                    served = ", ".join(f"{n} {c.label}" for n, c in sweeps.items())
                kept = forward()

                def backward_only(kept=kept):
                    return torch.autograd.grad(kept, (q, k, v), do, retain_graph=True)

                def both(forward=forward):
                    return torch.autograd.grad(forward(), (q, k, v), do)

                for label, fn, floor in (
                    ("backward", backward_only, floor_ms),
                    ("fwd+bwd", both, both_floor_ms),
                ):
                    rows.append(
                        timed_row(shape | {"pass": label}, f"{name} {label}", served, fn, ref, floor, log)
                    )
                del kept
            del ref
    finally:
        serve.use_table(serve.DEFAULT)
    return rows


def run_packed(
    packed: Packed,
    *,
    dk: int,
    dv: int,
    dtype: str,
    servings: dict[str, Dispatch | None],
    bandwidth: float,
    log: Path | None = None,
) -> list[dict]:
    """The packed batch: ``decay_attention`` under each of ``servings`` (``run_backward``)
    and fla, each with ``cu_seqlens``, in the model form."""
    from kernel.ops import decay_attention, serve

    offsets = packed.cu_seqlens()
    problem = Problem(1, packed.heads, offsets[-1], dk, dv, dtype)  # [1, T, H, D]
    n = packed.sequences
    shape = shape_row(problem) | {
        "batch": n,
        "packed": f"{n} sequences of {packed.shortest}-{packed.longest}",
    }
    floor_ms = traffic_bytes(problem, sequences=n) / bandwidth * 1e3
    q, k, v = random_qkv(problem, seed=1)
    decay = constant_decay(retnet_decay(problem.heads), problem.heads, q.device)
    g_gamma, scale = decay.log(), model_call(problem).scale
    cu = torch.tensor(offsets, dtype=torch.int32, device=q.device)
    cu_long, cu_cpu = cu.long(), torch.tensor(offsets, dtype=torch.long)
    ref = refs.kernel_mimic(q, k, v, decay, 64, scale=scale, cu_seqlens=cu, output_final_state=True)
    rows = [floor_row(shape, floor_ms, bandwidth)]

    def ours():
        return decay_attention(q, k, v, decay, scale=scale, output_final_state=True, cu_seqlens=cu)

    try:
        for name, table in servings.items():
            serve.use_table(table)
            rows.append(timed_row(shape, name, None, ours, ref, floor_ms, log))
    finally:
        serve.use_table(serve.DEFAULT)
    try:
        fla = lambda: fla_simple_gla(  # noqa: E731
            q, k, v, g_gamma, scale=scale, cu_seqlens=cu_long, cu_seqlens_cpu=cu_cpu
        )
        rows.append(timed_row(shape, "fla chunk_simple_gla", None, fla, ref, floor_ms, log))
    except ImportError:
        print("fla is not installed: no fla column", file=sys.stderr)
    return rows


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
    print_table(rows)
