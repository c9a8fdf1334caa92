"""The latency model in use (the shipped one, or the file DECAY_TUNER_LATENCY_MODEL names)
judged on sweeps it was never fitted to, beside the rule (``kernel.rule``): per (head
size, sweep, shape) with 3 configs or more, Spearman between predicted and measured, the
model's top-1 and the best of its top 5 over the measured best, and the rule's config over
the best where the sweep timed it; then the summary against the issue's goals.

    PYTHONPATH=. python3 experiments/costmodel/judge.py [--shapes BxHxS,...] SWEEP.jsonl [...]

``--shapes``: judge only those (B, H, S), the model's held-out ones, of sweeps that also
hold shapes it was fitted to.
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path

from kernel.arch import get_arch
from kernel.rule import default_config, dkdv_config
from tuner import latency_fit
from tuner.latency import latency_model

parser = argparse.ArgumentParser()
parser.add_argument("--shapes", type=lambda text: set(text.split(",")))
parser.add_argument("sweeps", nargs="+", type=Path)
args = parser.parse_args()
samples = [
    s
    for path in args.sweeps
    for s in latency_fit.from_sweep(path)[0]
    if args.shapes is None or f"{s.problem.batch}x{s.problem.heads}x{s.problem.seqlen}" in args.shapes
]
model = latency_model()
rows = latency_fit.judge(model, samples)  # in the order of the sorted shapes of 3 configs or more
groups = defaultdict(list)
for s in samples:
    groups[s.shape].append(s)
judged = [found for _, found in sorted(groups.items()) if len(found) >= 3]
for row, found in zip(rows, judged, strict=True):
    one = found[0]
    rule_of = dkdv_config if one.sweep == "dkdv" else default_config
    rule = rule_of(one.problem, one.arch, get_arch(one.arch).sms)  # split for the GPU's SMs, as served
    timed = {s.config: s.median_ms for s in found}
    ms = timed.get(rule)
    print(json.dumps(row | {"rule": rule.label, "rule_over_best": ms / min(timed.values()) if ms else None}))
print(json.dumps({"model": model.gpu, "judged": latency_fit.summary(rows)}))
