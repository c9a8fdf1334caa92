"""The rule (``kernel.rule``) scored against sweeps of every candidate config: per head
size and sweep, the rule's time over the fastest checked config at each shape, for the rule
as the code has it now and for the rule before it was fitted (``legacy_config``).

    python experiments/shipped/rule.py experiments/shipped/sweep-*.jsonl

A config the sweep did not time at a shape counts as "untimed" (none should be: the sweep
times both rules' configs at every shape).
"""

import dataclasses
import math
import statistics
import sys

from kernel.config import SEGMENT_COUNTS, KernelConfig, Problem
from kernel.constraints import runs
from kernel.rule import MAX_BLOCK_STATE, default_config, dkdv_config, shorter_pipeline
from tuner.fit_data import timings  # the product's reader; its rule_scores gives the "now" rows


def legacy_config(problem: Problem, sms: int) -> KernelConfig:
    """The forward's rule before the first sweep: 64/./2/256/smem at the widest block_dv
    within ``MAX_BLOCK_STATE``, split into the segment count nearest one block per SM in
    log2, past it or not (fewer segments on a tie)."""
    widest = max(16, min(problem.dv, MAX_BLOCK_STATE // problem.dk))
    block_dv = max(d for d in range(16, widest + 1, 16) if problem.dv % d == 0)
    base = KernelConfig(64, block_dv, 2, 256, "smem", 1)
    splits = [dataclasses.replace(base, segments=n) for n in SEGMENT_COUNTS]
    runnable = [c for c in splits if runs(c, problem)]
    if not runnable:
        return shorter_pipeline(base, problem)
    return min(runnable, key=lambda c: (abs(math.log2(c.blocks(problem) / sms)), c.segments))


def main(paths: list[str]) -> None:
    times, sms = timings(paths)
    groups: dict[tuple, dict[str, list]] = {}
    for key, timed in sorted(times.items()):
        dk, dv, dtype, sweep, b, h, s = key
        p = Problem(b, h, s, dk, dv, dtype)
        best = min(timed.values())
        rules = {
            "now": dkdv_config(p, "sm_90a", sms) if sweep == "dkdv" else default_config(p, "sm_90a", sms)
        }
        if sweep != "dkdv":
            rules["legacy"] = legacy_config(p, sms)
        for name, config in rules.items():
            ms = timed.get(config.label)
            found = groups.setdefault((dk, dv, sweep, name), {"ratios": [], "untimed": []})
            if ms:
                found["ratios"].append((ms / best, f"{b}x{h}x{s}"))
            else:
                found["untimed"].append(f"{b}x{h}x{s}")
    print("| DK/DV | sweep | rule | shapes | median | worst | over 1.10x | untimed |")
    print("|---|---|---|---|---|---|---|---|")
    for (dk, dv, sweep, name), found in sorted(groups.items()):
        ratios = [r for r, _ in found["ratios"]]
        over = ", ".join(f"{x} {r:.2f}" for r, x in sorted(found["ratios"], reverse=True) if r > 1.10) or "-"
        untimed = ", ".join(found["untimed"]) or "-"
        median, worst = statistics.median(ratios), max(ratios)
        cells = [f"{dk}/{dv}", sweep, name, len(ratios), f"{median:.3f}", f"{worst:.3f}", over, untimed]
        print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
