"""The bench's rows: the HBM floor of a shape (the fewest bytes a pass moves, over the
copy bandwidth measured in the same run) and one implementation's call on it, checked
against a reference and, where within tolerance, timed (``kernel.timing.time_gpu`` with
the host's launches queued ahead; ``host_ms``: the host's time per call)."""

import csv
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import refs
from kernel.config import KernelConfig, Problem
from kernel.files import replacing
from kernel.timing import time_gpu

COPY_BYTES = 1 << 30
# The names of our rows that a user gets: with no table of theirs, and with the one they tuned.
OUT_OF_THE_BOX, TUNED = "out of the box", "tuned"


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


def timed_row(
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


def floor_row(shape: dict[str, Any], floor_ms: float, bandwidth: float) -> dict[str, Any]:
    return {
        **shape,
        "impl": "floor",
        "median_ms": floor_ms,
        "x_floor": 1.0,
        "bandwidth_tb_s": bandwidth / 1e12,
    }


def shape_row(problem: Problem) -> dict[str, Any]:
    """A row's shape columns: the decay is RetNet's per head, or a per-token gate's with the
    heads of q and k (``Problem.gate``, ``qk_heads``)."""
    p = problem
    decay = "retnet" if p.gate == "head" else f"per-token g, G={p.qk_heads}"
    return {"batch": p.batch, "heads": p.heads, "seqlen": p.seqlen, "dk": p.dk, "dv": p.dv, "decay": decay}


def ratios(rows: list[dict]) -> list[dict]:
    """Per shape and pass, the issue's goals as ratios of median times: out of the box over
    tuned (goal: at most 1.10) and fla over out of the box (goal: at least 2.5 forward, 3
    forward plus backward); None where a side was not timed."""
    times: dict[tuple[str, str], dict[str, float]] = {}
    for r in rows:
        if "median_ms" in r and r["impl"] != "floor":
            packed = "packed " if r.get("packed") else ""
            shape = f"{packed}{r['batch']}x{r['heads']}x{r['seqlen']} {r['dk']}/{r['dv']}"
            pass_ = r.get("pass", "forward")
            times.setdefault((shape, pass_), {})[r["impl"].removesuffix(f" {pass_}")] = r["median_ms"]
    ratio = lambda a, b: a / b if a and b else None  # noqa: E731
    return [
        {
            "shape": shape,
            "pass": pass_,
            "out_of_box_over_tuned": ratio(t.get(OUT_OF_THE_BOX), t.get(TUNED)),
            "fla_over_out_of_box": ratio(t.get("fla chunk_simple_gla"), t.get(OUT_OF_THE_BOX)),
        }
        for (shape, pass_), t in times.items()
    ]


def write_csv(rows: list[dict], path: Path) -> None:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with replacing(path) as tmp, tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def print_table(rows: list[dict]) -> None:
    """Print the timed rows (not the candidates), then ``ratios``."""
    for r in rows:
        if "median_ms" in r and r["impl"] != "candidate":
            impl = f"{r['pass']} floor" if r["impl"] == "floor" and "pass" in r else r["impl"]
            print(
                f"{r['batch']:>3} {r['heads']:>3} {r['seqlen']:>6} {impl:<32} {r.get('config', ''):<20} "
                f"{r['median_ms']:8.4f} ms {r['x_floor']:6.2f}x floor"
                + (f"  host {r['host_ms']:.3f} ms" if "host_ms" in r else "")
            )
    fmt = lambda x: f"{x:6.3f}" if x is not None else "     -"  # noqa: E731
    print(f"{'shape':<28} {'pass':<8} out-of-box/tuned  fla/out-of-box")
    for r in ratios(rows):
        print(
            f"{r['shape']:<28} {r['pass']:<8} "
            f"{fmt(r['out_of_box_over_tuned']):>16}  {fmt(r['fla_over_out_of_box']):>14}"
        )
