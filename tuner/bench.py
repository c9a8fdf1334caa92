"""Benchmark over a grid of shapes, all in one process on one GPU: the tuned kernel, the
seed's default config, fla's ``chunk_simple_gla`` and plain torch, each against the
shape's HBM floor (the bytes of Q, K, V and O over the copy bandwidth measured in the
same run).

"Tuned" is the config a dispatch table (``python -m tuner dispatch``) picks for the shape
when one is given; otherwise the fastest correct config among the tuner's first configs
(``tuner.space.wave_seeds``), timed on that very shape. Every implementation is checked
against reference C before timing.
"""

import csv
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import refs
from kernel.builder import build, cuda_arch, precompile, sm_count
from kernel.config import SEED_CONFIG, KernelConfig, Problem
from kernel.dispatch import Dispatch
from kernel.resources import ProbeFailure
from kernel.timing import bench
from kernel.validate import random_qkv
from tuner import space
from tuner.peers import fla_simple_gla, torch_chunked

COPY_BYTES = 1 << 30


def traffic_bytes(problem: Problem) -> int:
    """Fewest bytes a forward pass moves: Q, K and V read once, O written once."""
    p = problem
    return p.batch * p.seqlen * p.heads * (2 * p.dk + 2 * p.dv) * 2  # fp16 / bf16 elements


def copy_bandwidth() -> float:
    """Device-to-device copy rate in bytes/s (bytes read plus bytes written)."""
    src = torch.randn(COPY_BYTES // 4, device="cuda")
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / (bench(lambda: dst.copy_(src)).median_ms * 1e-3)


def _row(
    problem: Problem,
    impl: str,
    config: KernelConfig | None,
    fn: Callable[[], torch.Tensor],
    ref: torch.Tensor,
    floor_ms: float,
    log: Path | None,
) -> dict[str, Any]:
    err = refs.rel_l2(fn(), ref)
    row = {
        "batch": problem.batch,
        "heads": problem.heads,
        "seqlen": problem.seqlen,
        "dk": problem.dk,
        "dv": problem.dv,
        "alpha": problem.alpha,
        "impl": impl,
        "config": config.label if config else "",
        "rel_l2": err,
    }
    if err < refs.TOLERANCE:
        row |= bench(fn).to_dict()
        row["x_floor"] = row["median_ms"] / floor_ms
    print(row, flush=True)
    if log is not None:  # one JSON line per measurement, so a killed run keeps what it measured
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")
    return row


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
    alpha: float = 0.99,
    dispatch: Dispatch | None = None,
    log: Path | None = None,
) -> list[dict]:
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    problems = [Problem(b, h, s, dk, dv, alpha) for b, h, s in shapes]
    candidates = {
        p: [dispatch.pick(p).config] if dispatch else space.wave_seeds(p, sm_count()) for p in problems
    }
    jobs = [(p, c) for p in problems for c in dict.fromkeys([SEED_CONFIG, *candidates[p]])]
    probes = dict(zip(jobs, precompile(jobs, arch=cuda_arch())))
    rows = []
    for problem in problems:
        floor_ms = traffic_bytes(problem) / bandwidth * 1e3
        q, k, v = random_qkv(problem, seed=0)
        ref = refs.kernel_mimic(q, k, v, problem.alpha, 64)
        rows.append(
            {
                "batch": problem.batch,
                "heads": problem.heads,
                "seqlen": problem.seqlen,
                "impl": "floor",
                "median_ms": floor_ms,
                "x_floor": 1.0,
                "bandwidth_tb_s": bandwidth / 1e12,
            }
        )
        out = torch.empty_like(v)
        timed = {}
        for config in dict.fromkeys([SEED_CONFIG, *candidates[problem]]):
            if isinstance(probes[problem, config], ProbeFailure) or not probes[problem, config].fits_smem:
                continue
            kern = build(problem, config)
            impl = "seed config" if config == SEED_CONFIG else "candidate"
            timed[config] = _row(problem, impl, config, lambda: kern(q, k, v, out=out), ref, floor_ms, log)
        rows += timed.values()
        ok = [r for c, r in timed.items() if c in candidates[problem] and "median_ms" in r]
        if ok:
            tuned_by = (
                served_by(dispatch, problem) if dispatch else f"best of {len(candidates[problem])} candidates"
            )
            rows.append(min(ok, key=lambda r: r["median_ms"]) | {"impl": "tuned", "tuned_by": tuned_by})
        try:
            rows.append(
                _row(
                    problem,
                    "fla chunk_simple_gla",
                    None,
                    lambda: fla_simple_gla(q, k, v, problem.alpha),
                    ref,
                    floor_ms,
                    log,
                )
            )
        except ImportError:
            print("fla is not installed: no fla column", file=sys.stderr)
        rows.append(
            _row(
                problem,
                "torch chunked",
                None,
                lambda: torch_chunked(q, k, v, problem.alpha),
                ref,
                floor_ms,
                log,
            )
        )
        del ref
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
    alpha: float,
    dispatch: Dispatch | None = None,
) -> None:
    """Run the bench and write ``out``/bench.csv, bench.jsonl and bench.html; print a table."""
    from reports.bench import figure

    out.mkdir(parents=True, exist_ok=True)
    log = out / "bench.jsonl"
    log.unlink(missing_ok=True)
    rows = run(shapes, dk=dk, dv=dv, alpha=alpha, dispatch=dispatch, log=log)
    write_csv(rows, out / "bench.csv")
    figure(rows).write_html(out / "bench.html", include_plotlyjs=True)
    for r in rows:
        if "median_ms" in r and r["impl"] != "candidate":
            print(
                f"{r['batch']:>3} {r['heads']:>3} {r['seqlen']:>6} {r['impl']:<22} {r.get('config', ''):<18} "
                f"{r['median_ms']:8.4f} ms {r['x_floor']:6.2f}x floor"
            )
