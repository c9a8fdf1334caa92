"""Probe two configs for sm_80 and sm_90a and write their results (less compile_seconds) to
argv[1]; the time of each probe to stderr. Run it three times on one fresh TileLang cache:

    export TILELANG_CACHE_DIR=/tmp/tlc-test; rm -rf $TILELANG_CACHE_DIR
    for i in 1 2 3; do PYTHONPATH=. python3 experiments/probe_cache/probe_twice.py /tmp/pp$i.json; done
    cmp /tmp/pp1.json /tmp/pp2.json; cmp /tmp/pp1.json /tmp/pp3.json
"""

import json
import sys
import time

from kernel.config import KernelConfig, Problem, model_call
from kernel.probe import probe

P = Problem(1, 2, 256, 64, 64)
out = []
for c in (KernelConfig(64, 64, 1, 128, "smem"), KernelConfig(64, 64, 2, 128, "smem", segments=2)):
    for arch in ("sm_80", "sm_90a"):
        t = time.perf_counter()
        r = probe(P, c, arch=arch, call=model_call(P))
        d = r.to_dict()
        d.pop("compile_seconds")
        out.append(d)
        print(arch, c.label, round(time.perf_counter() - t, 2), file=sys.stderr)
json.dump(out, open(sys.argv[1], "w"))
