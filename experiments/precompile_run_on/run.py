"""What ``precompile(..., run_on=...)`` saves a test that builds another architecture's code
path for this GPU (``tests/test_arch_gpu.py``), on a CPU: the seconds of that build's
compile (``compile_class`` for sm_80 assembled for sm_90a) in a fresh TileLang cache, and
after ``precompile`` put it there; then a probe twice, cold and from the figures cache.
Each step is its own process on its own empty cache, so nothing is shared between them.

    cd experiments/precompile_run_on && PYTHONPATH=../../.. python3 run.py > run.jsonl
"""

import json
import os
import subprocess
import sys
import tempfile
import time

STEP = """
import json, sys, time
from kernel.builder import compile_class, precompile
from kernel.config import KernelConfig, Problem, model_call
from kernel.probe import probe
p, c = Problem(2, 3, 300, 64, 64), KernelConfig(32, 32, 1, 128, "smem")
build = lambda: compile_class(p, c, model_call(p), "sm_80", run_on="sm_90a")
def timed(f):
    t = time.perf_counter(); f(); return round(time.perf_counter() - t, 1)
if __name__ == "__main__":
    if sys.argv[1] == "cold":
        print(json.dumps({"build_compile_s": timed(build)}))
    elif sys.argv[1] == "ahead":
        ahead = timed(lambda: precompile([(p, c, model_call(p))], arch="sm_80", run_on="sm_90a"))
        print(json.dumps({"precompile_s": ahead, "build_compile_s": timed(build)}))
    else:
        print(json.dumps({"probe_s": [timed(lambda: probe(p, c, arch="sm_90a")) for _ in range(2)]}))
"""

for step in ("cold", "ahead", "probe"):
    with tempfile.TemporaryDirectory() as cache:
        env = os.environ | {"TILELANG_CACHE_DIR": cache}
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", STEP, step], env=env, capture_output=True, text=True, check=True
        )
        row = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            json.dumps({"step": step, **row, "process_s": round(time.perf_counter() - start, 1)}), flush=True
        )
