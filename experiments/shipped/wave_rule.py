"""A candidate for the rule's segment count (``kernel.rule.nearest_grid``), scored
against the rule over sweeps of every candidate config, as ``rule.py`` scores the rule.

The rule splits a sequence into the segment count whose grid comes nearest one block per
SM without passing it. At 3x12x6000 that is 72 blocks (2 segments), 1.07x the best
forward and 1.19x the best fused sweep, whose best split, 8 segments (288 blocks), runs
three waves (``../costmodel/heldout-128x128-bfloat16-3x12x6000_1x4x65536_2x32x3000.jsonl``).
The candidate counts waves: it takes the segment count that minimises

    ceil(blocks / SMs) * (segment length * (SPLIT if split else 1) + FIXED)

in tokens: each wave walks one segment's chunks; a split reads K and V twice (its states
pass, then its outputs pass: SPLIT); and each block pays a fixed cost (its pipeline's
fill, its state's store: FIXED tokens). A tie goes to fewer segments. The grid searched
for (SPLIT, FIXED) is printed with each pair's score; a pair is worth shipping only if it
also holds on shapes it was not chosen on (the few-sequence sweep of
``../costmodel/README.md``).

    cd experiments/shipped && python wave_rule.py sweep-*.jsonl ../costmodel/gap-*.jsonl \
        ../costmodel/heldout-*.jsonl > wave_rule.txt
"""

import contextlib
import dataclasses
import math
import statistics
import sys
from collections.abc import Iterator

from rule import timings

import kernel.rule
from kernel.config import SEGMENT_COUNTS, KernelConfig, Problem
from kernel.constraints import runs
from kernel.rule import default_config, dkdv_config

SPLITS, FIXEDS = (1.0, 1.2, 1.4, 1.6, 1.8, 2.0), (0, 128, 256, 384, 512, 768, 1024)


def fewest_waves(split: float, fixed: float):
    """``nearest_grid``'s stand-in: the segment count of the least wave cost."""

    def choose(config: KernelConfig, problem: Problem, sms: int) -> KernelConfig | None:
        candidates = (dataclasses.replace(config, segments=n) for n in SEGMENT_COUNTS)
        runnable = [c for c in candidates if runs(c, problem)]
        if not runnable:
            return None

        def cost(c: KernelConfig) -> tuple:
            tokens = c.segment_length(problem.seqlen) * (split if c.segments > 1 else 1) + fixed
            return math.ceil(c.blocks(problem) / sms) * tokens, c.segments

        return min(runnable, key=cost)

    return choose


@contextlib.contextmanager
def segments_by(choose) -> Iterator[None]:
    """The rule with ``choose`` for its segment count (None: the rule as it is)."""
    kept = kernel.rule.nearest_grid
    kernel.rule.nearest_grid = choose or kept
    try:
        yield
    finally:
        kernel.rule.nearest_grid = kept


def ratios(times: dict[tuple, dict[str, float]], sms: int) -> dict[tuple, float | None]:
    """Each group's pick over its best (None: the pick was not timed)."""
    out = {}
    for key, timed in times.items():
        dk, dv, dtype, sweep, b, h, s = key
        p = Problem(b, h, s, dk, dv, dtype)
        config = dkdv_config(p, "sm_90a", sms) if sweep == "dkdv" else default_config(p, "sm_90a", sms)
        ms = timed.get(config.label)
        out[key] = ms / min(timed.values()) if ms else None
    return out


def score(found: dict[tuple, float | None]) -> str:
    timed = [r for r in found.values() if r]
    geo = math.exp(statistics.mean(map(math.log, timed)))
    untimed = sum(r is None for r in found.values())
    over = sum(r > 1.10 for r in timed)
    return f"geomean {geo:.4f}, worst {max(timed):.3f}, over 1.10x {over}, untimed {untimed}"


def main(paths: list[str]) -> None:
    times, sms = timings(paths)
    with segments_by(None):
        rule = ratios(times, sms)
    print(f"rule: {score(rule)} over {len(rule)} groups")
    found = {}
    for split in SPLITS:
        for fixed in FIXEDS:
            with segments_by(fewest_waves(split, fixed)):
                found[split, fixed] = ratios(times, sms)
            print(f"SPLIT {split} FIXED {fixed}: {score(found[split, fixed])}")
    chosen = found.get((1.6, 384))
    if chosen:
        print("groups where SPLIT 1.6, FIXED 384 picks otherwise than the rule (rule -> candidate):")
        for key in sorted(times):
            if rule[key] != chosen[key]:
                dk, dv, _, sweep, b, h, s = key
                print(f"  {b}x{h}x{s} {dk}/{dv} {sweep}: {rule[key]} -> {chosen[key]}")


if __name__ == "__main__":
    main(sys.argv[1:])
