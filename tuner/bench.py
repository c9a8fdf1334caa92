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

``bench --gate token [--groups G]`` times a per-token gate's forward (``kernel.gated``)
the same way, out of the box, tuned and against fla's ``chunk_simple_gla(g=...)``, each
checked against reference C's per-token form, over a floor that counts the gate's bytes
(``tuner.occupancy.traffic_bytes``); it has no seed config, torch, packed or backward rows.
"""

import importlib.util
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

import refs
from kernel.builder import build, constant_decay, cuda_arch, memory_bandwidth, precompile, sm_count
from kernel.config import SEED_CONFIG, Call, KernelConfig, Problem, model_call, retnet_decay
from kernel.environment import environment
from kernel.ops.dispatch import Dispatch
from kernel.ops.tables import shipped_table
from kernel.probe import ProbeFailure
from kernel.validate import gated_inputs, random_qkv
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


class Case(NamedTuple):
    """One shape's implementations on the same fresh inputs, each a call returning the
    output and the final state: ours for a config (compiled on first use, writing into
    NaN-filled tensors of its own), fla's, plain torch's (None where it has none), and the
    reference C result they are checked against."""

    ref: tuple[torch.Tensor, torch.Tensor]
    ours: Callable[[KernelConfig], Callable[[], tuple]]
    fla: Callable[[], tuple]
    plain: Callable[[], tuple] | None


def retnet_case(problem: Problem, call: Call) -> Case:
    """A constant decay's shape: RetNet's decay per head (fla's ``g_gamma`` is its log)."""
    q, k, v = random_qkv(problem, seed=0)
    decay = constant_decay(retnet_decay(problem.heads), problem.heads, q.device)
    g_gamma = decay.log()  # fla's log-decay, made once as a model holds it
    ref = refs.kernel_mimic(q, k, v, decay, 64, scale=call.scale, output_final_state=True)

    def ours(config: KernelConfig) -> Callable[[], tuple]:
        kern, out = build(problem, config, call), torch.full_like(v, math.nan)
        final = torch.full((problem.batch, problem.heads, problem.dk, problem.dv), math.nan, device=q.device)
        return lambda: (kern(q, k, v, decay=decay, final_state=final, out=out), final)

    plain = None
    if problem.seqlen % TORCH_CHUNK:
        print(f"{problem}: S is not whole chunks of {TORCH_CHUNK}: no torch column", file=sys.stderr)
    else:
        plain = lambda: torch_chunked(q, k, v, decay, scale=call.scale, chunk=TORCH_CHUNK)  # noqa: E731
    return Case(ref, ours, lambda: fla_simple_gla(q, k, v, g_gamma, scale=call.scale), plain)


def gated_case(problem: Problem, call: Call) -> Case:
    """A per-token gate's shape (``Problem.gate``): log-gates from -1e-4 to -20
    (``kernel.validate.gated_inputs``), fla's ``chunk_simple_gla(g=...)``, which takes no
    groups: its q and k are repeated to H heads outside the timed call."""
    from kernel.gated_build import compile_gated

    p = problem
    q, k, v, g = gated_inputs(p, seed=0)
    ref = refs.gated_kernel_mimic(q, k, v, g, 64, scale=call.scale, output_final_state=True)
    rows, f32 = p.batch * p.heads, dict(dtype=torch.float32, device=q.device)

    def ours(config: KernelConfig) -> Callable[[], tuple]:
        kern = compile_gated(p, config, call, arch=cuda_arch())
        gamma, h0 = torch.zeros(p.heads, **f32), torch.empty(rows, 1, p.dk, p.dv, **f32)
        out, final = torch.full_like(v, math.nan), torch.full((rows, 1, p.dk, p.dv), math.nan, **f32)

        def launch() -> tuple:
            kern(q, k, v, g, gamma, h0, out, final)
            return out, final.view(ref[1].shape)

        return launch

    qh, kh = (x.repeat_interleave(p.heads // p.qk_heads, dim=2) for x in (q, k))
    return Case(ref, ours, lambda: fla_simple_gla(qh, kh, v, None, g=g, scale=call.scale), None)


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
    gate: str = "head",
    groups: int | None = None,
) -> list[dict]:
    """The bench's rows (see the module); ``gate`` and ``groups``: a per-token gate's
    forward (``Problem.gate``: no seed config, torch, packed or backward rows)."""
    from kernel.ops.serve import config_for

    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    arch, sms, rate = cuda_arch(), sm_count(), memory_bandwidth()
    table, source = out_of_the_box()
    problems = [Problem(b, h, s, dk, dv, dtype, gate, groups) for b, h, s in shapes]
    default = {p: config_for(p, table, arch=arch, sms=sms, bandwidth=rate) for p in problems}
    candidates = {
        p: [dispatch.pick(p).config]
        if dispatch
        else space.wave_seeds(space.search_space(p, arch=arch), sms=sms, bandwidth=rate)
        for p in problems
    }
    seed = [SEED_CONFIG] if gate == "head" else []  # the seed's config is a constant decay's
    configs = {p: list(dict.fromkeys([*seed, *candidates[p], default[p]])) for p in problems}
    jobs = [(p, c, model_call(p)) for p in problems for c in configs[p]]
    probes = dict(zip(jobs, precompile(jobs, arch=arch)))
    rows = []
    for problem in problems:
        shape, call = shape_row(problem), model_call(problem)
        floor_ms = traffic_bytes(problem) / bandwidth * 1e3
        case = (retnet_case if gate == "head" else gated_case)(problem, call)
        rows.append(floor_row(shape, floor_ms, bandwidth))
        timed = {}
        for config in configs[problem]:
            res = probes[problem, config, call]
            if isinstance(res, ProbeFailure) or not res.fits_smem:
                print(f"{problem}: {config.label} does not compile or fit: not timed", file=sys.stderr)
                continue
            impl, extra = "seed config" if config == SEED_CONFIG else "candidate", {}
            if config not in (SEED_CONFIG, *candidates[problem]):  # the out-of-box config alone
                impl, extra = OUT_OF_THE_BOX, {"tuned_by": source}
            timed[config] = timed_row(shape | extra, impl, config, case.ours(config), case.ref, floor_ms, log)
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
            rows.append(timed_row(shape, "fla chunk_simple_gla", None, case.fla, case.ref, floor_ms, log))
        except ImportError:
            print("fla is not installed: no fla column", file=sys.stderr)
        if case.plain is not None:
            rows.append(timed_row(shape, "torch chunked", None, case.plain, case.ref, floor_ms, log))
        del case
    if gate == "token":
        return rows
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
    gate: str = "head",
    groups: int | None = None,
) -> None:
    """Run the bench and write ``out``/bench.csv, bench.jsonl and bench.html; print a table."""
    from reports.bench_figure import figure

    out.mkdir(parents=True, exist_ok=True)
    log = out / "bench.jsonl"
    log.unlink(missing_ok=True)
    rows = run(
        shapes, dk=dk, dv=dv, dtype=dtype, dispatch=dispatch, packed=packed, backward=backward, log=log,
        gate=gate, groups=groups,
    )  # fmt: skip
    write_csv(rows, out / "bench.csv")
    figure(rows).write_html(out / "bench.html", include_plotlyjs=True)
    print_table(rows)
