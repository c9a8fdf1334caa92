"""What a study measures first by the model (``tuner.space.predicted_first``: the 4
configs it predicts fastest from figures estimated before any compile), against the
held-out sweep's timings: per (head size, sweep, shape), the best of those 4 that the
sweep timed, over the best it timed.

    PYTHONPATH=. python3 experiments/h200/costmodel/first.py > experiments/h200/costmodel/first.jsonl
"""

import json
from collections import defaultdict
from pathlib import Path

from kernel.config import Problem
from tuner import latency_fit, space
from tuner.latency import latency_model

HELD_OUT = Path(__file__).resolve().parent.parent / "shipped" / "sweep-128x128_128x256-bfloat16-heldout.jsonl"

groups = defaultdict(list)
for s in latency_fit.from_sweep(HELD_OUT)[0]:
    groups[s.shape].append(s)
for (dk, dv, sweep, b, h, seqlen), found in sorted(groups.items()):
    if len(found) < 3:
        continue
    timed = {s.config: s.median_ms for s in found}
    first = space.predicted_first(
        Problem(b, h, seqlen, dk, dv, "bfloat16"), latency_model(), arch="sm_90a", sweep=sweep
    )
    got = [timed[c] for c in first if c in timed]
    best = min(timed.values())
    print(json.dumps({
        "shape": f"{b}x{h}x{seqlen}", "dk": dk, "dv": dv, "sweep": sweep,
        "best": min(timed, key=timed.get).label, "first": [c.label for c in first],
        "first_timed": len(got), "first_best_over_best": min(got) / best if got else None,
    }))  # fmt: skip
