"""What a study measures first by the model (``tuner.space.predicted_first``: the 4
configs it predicts fastest from figures estimated before any compile), against the
timings of the shapes the model in use was held out from: per (head size, sweep, shape), the
best of those 4 that the sweeps timed, over the best they timed.

    PYTHONPATH=. python3 experiments/costmodel/first.py SHAPE,SHAPE,... SWEEP.jsonl [...] > first.jsonl
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

from kernel.config import Problem
from tuner import latency_fit, space
from tuner.latency import latency_model

held_out = set(sys.argv[1].split(","))
groups = defaultdict(list)
for path in sys.argv[2:]:
    for s in latency_fit.from_sweep(Path(path))[0]:
        if f"{s.problem.batch}x{s.problem.heads}x{s.problem.seqlen}" in held_out:
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
