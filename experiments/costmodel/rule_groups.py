"""Per (sweep, shape) of sweeps' JSON lines: the rule's config (``kernel.rule``, split
for the sweep's SM count) over the group's best, and the best config.

    cd experiments/shipped && PYTHONPATH=../../..:. python3 ../costmodel/rule_groups.py \
        ../costmodel/few-128x128-bfloat16-h100.jsonl > ../costmodel/rule_groups-h100-few.txt
"""

import sys

from rule import timings
from wave_rule import ratios, segments_by

from kernel.config import Problem
from kernel.rule import default_config, dkdv_config

times, sms = timings(sys.argv[1:])
with segments_by(None):
    over = ratios(times, sms)
for key in sorted(times, key=lambda k: (k[3], k[4] * k[5] * k[6], k[6])):
    dk, dv, dtype, sweep, b, h, s = key
    timed = times[key]
    best = min(timed, key=timed.get)
    rule = (dkdv_config if sweep == "dkdv" else default_config)(
        Problem(b, h, s, dk, dv, dtype), "sm_90a", sms
    )
    cells = f"{sweep:8} {b}x{h}x{s:<6} rule {rule.label:22} {over[key]:.3f}"
    print(f"{cells}  best {best:22} {timed[best]:.4f} ms  of {len(timed)}")
