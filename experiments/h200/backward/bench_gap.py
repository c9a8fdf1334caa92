"""Where the bench's forward plus backward rows lose about 0.3 ms (issue 18, fourth session):
timed alone (``bench_long.py``) ours took 0.547 ms at 8x16x4096 and fla's 1.854; inside
the whole ``python -m tuner bench`` 0.832 and 2.178, while the backward alone matched
(session4/). One process, four stages, each timing the bench's backward rows
(``tuner.bench.run_backward``: ours and fla's, backward alone and forward plus backward):

1. ``alone``: first thing in the process, as ``bench_long.py``;
2. ``after forward``: after the bench's forward section (``tuner.bench.run`` without its
   packed and backward parts: candidates, fla, torch at the same shapes);
3. ``after gc``: then after ``gc.collect()``;
4. ``after empty_cache``: then after ``torch.cuda.empty_cache()`` too.

Each stage's rows carry the process's tracked Python objects and the CUDA memory the
allocator holds. Writes DIR/bench_gap.jsonl, one row per line:

    python3 experiments/h200/backward/bench_gap.py --out DIR 8x16x4096
"""

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def main() -> int:
    import torch

    from kernel.config import Problem
    from tuner import bench

    parser = argparse.ArgumentParser()
    parser.add_argument("shapes", nargs="+", help="BxHxS, DK = DV = 128, fp16")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes]
    problems = [Problem(b, h, s, 128, 128) for b, h, s in shapes]
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "bench_gap.jsonl"
    bandwidth = bench.copy_bandwidth()

    def stage(name: str) -> None:
        context = {
            "stage": name,
            "gc_objects": len(gc.get_objects()),
            "cuda_reserved_gb": torch.cuda.memory_reserved() / 2**30,
        }
        for row in bench.run_backward(problems, dispatch=None, bandwidth=bandwidth):
            row = context | row
            with log.open("a") as f:
                f.write(json.dumps(row) + "\n")
            if "pass" in row and row["impl"] != "floor":
                print(name, row["impl"], round(row["median_ms"], 4), round(row["p20_ms"], 4), flush=True)

    stage("alone")
    bench.run(shapes, packed=None, backward=False)
    stage("after forward")
    gc.collect()
    stage("after gc")
    torch.cuda.empty_cache()
    stage("after empty_cache")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
