"""The GPU timings the product is fitted to, shipped as package data (``tuner/data/``): every
candidate config timed at many shapes, trimmed to what a fit reads. The shipped latency
model (``tuner/latency_model.json``) is what ``python -m tuner model fit`` makes of
``MODEL_GRIDS`` with ``MODEL_HELD_OUT`` held out (``model_fit_args``); ``rule_scores``
scores the rule (``kernel.rule``) on them. Each file's GPU, command and raw rows:
``tuner/data/README.md`` and docs/evidence.md.
"""

import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kernel.config import Problem
from kernel.rule import default_config, dkdv_config

DATA = Path(__file__).with_name("data")
# what the shipped latency model was fitted to and judged on (docs/tuning.md)
MODEL_GRIDS = (
    "sweep-128x128_128x256_64x64_256x256-bfloat16.jsonl",
    "sweep-128x128_128x256-bfloat16-heldout.jsonl",
    "gap-128x128-bfloat16.jsonl",
    "heldout-128x128-bfloat16.jsonl",
    "heldout-64x64-bfloat16-64x8x512.jsonl",
    "heldout-64x64-bfloat16-8x24x1000.jsonl",
    "heldout-128x128-bfloat16-3x12x6000_1x4x65536_2x32x3000.jsonl",
)
MODEL_HELD_OUT = "3x24x6000,1x4x65536,64x8x512,8x24x1000,2x32x3000,3x12x6000"
# the grid the rule was fitted to, and the same grid on a GPU of slower memory
RULE_GRID = "sweep-128x128_128x256_64x64_256x256-bfloat16.jsonl"
SLOW_MEMORY_GRID = "sweep-128x128-bfloat16-h100.jsonl"
# the rule's split beside one consumer warpgroup at half the block_dv (kernel.rule.CHAIN)
SLOW_MEMORY_CHAIN = ("threads128-h100.jsonl", "threads128-near64-h100.jsonl")


def path(name: str) -> Path:
    """The package's copy of the grid log ``name``."""
    return DATA / name


def grids_of(gpu: str, arch: str) -> list[Path]:
    """The package's grid logs timed on ``gpu`` (its name as torch gives it) for ``arch``: what
    a refit of that GPU's latency model adds to its own trials (``tuner.latency_cache``)."""
    found = []
    for grid in sorted(DATA.glob("*.jsonl")):
        with grid.open() as f:
            env = json.loads(f.readline()).get("env") or {}  # the env row comes first
        if env.get("gpu") == gpu and env.get("arch") == arch:
            found.append(grid)
    return found


def model_fit_args() -> list[str]:
    """The arguments of ``python -m tuner model fit`` that make the shipped model (less ``--out``)."""
    data = [a for name in MODEL_GRIDS for a in ("--data", str(path(name)))]
    return [*data, "--hold-out", MODEL_HELD_OUT]


def timings(paths: Iterable[Path]) -> tuple[dict[tuple, dict[str, float]], int]:
    """The grid logs' median times, (DK, DV, dtype, sweep, B, H, S) -> config label -> ms, and
    their GPU's SM count (the last log's)."""
    times: dict[tuple, dict[str, float]] = {}
    sms = 0
    for p in paths:
        for line in Path(p).read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if row.get("kind") == "env":
                sms = row["sms"]
            elif row.get("kind") == "time" and "median_ms" in row:
                key = (row["dk"], row["dv"], row["dtype"], row["sweep"], row["b"], row["h"], row["s"])
                times.setdefault(key, {})[row["config"]] = row["median_ms"]
    return times, sms


def rule_ratios(
    paths: Iterable[Path], *, arch: str = "sm_90a", bandwidth: float | None = None
) -> dict[tuple, list[tuple[str, float | None]]]:
    """Per (DK, DV, sweep), each shape's (``BxHxS``, the rule's time over the fastest config
    timed there), None where the grid did not time the rule's config. The rule is
    ``kernel.rule``' for ``arch``, the grid's SM count and ``bandwidth`` (None: the
    rule of fast memory)."""
    times, sms = timings(paths)
    found: dict[tuple, list[tuple[str, float | None]]] = {}
    for (dk, dv, dtype, sweep, b, h, s), timed in sorted(times.items()):
        p = Problem(b, h, s, dk, dv, dtype)
        if sweep == "dkdv":
            config = dkdv_config(p, arch, sms)
        else:
            config = default_config(p, arch, sms, bandwidth)
        ms = timed.get(config.label) if config else None
        found.setdefault((dk, dv, sweep), []).append(
            (f"{b}x{h}x{s}", ms / min(timed.values()) if ms else None)
        )
    return found


def rule_scores(
    paths: Iterable[Path], *, arch: str = "sm_90a", bandwidth: float | None = None, within: float = 1.10
) -> list[dict[str, Any]]:
    """``rule_ratios`` summed up per (DK, DV, sweep): shapes, the median and worst ratio, the
    shapes over ``within`` and those untimed."""
    rows = []
    for (dk, dv, sweep), ratios in rule_ratios(paths, arch=arch, bandwidth=bandwidth).items():
        timed = [r for _, r in ratios if r is not None]
        rows.append(
            {
                "dk": dk,
                "dv": dv,
                "sweep": sweep,
                "shapes": len(timed),
                "median": statistics.median(timed) if timed else None,
                "worst": max(timed, default=None),
                "over": {shape: r for shape, r in ratios if r is not None and r > within},
                "untimed": [shape for shape, r in ratios if r is None],
            }
        )
    return rows
