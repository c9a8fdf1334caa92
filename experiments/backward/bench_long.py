"""The bench's backward rows alone (``tuner.bench.run_backward``: ours and fla's, same run)
at the shapes given:

    python3 experiments/backward/bench_long.py --out DIR 2x16x16384

Writes DIR/bench_long.jsonl (one row per line, as the bench's log).

With ``--gap``: where the bench's forward plus backward rows lose about 0.3 ms (fourth
session: alone, ours took 0.547 ms at 8x16x4096 and fla's 1.854; inside the whole
``python -m tuner bench`` 0.832 and 2.178, while the backward alone matched). The rows are
timed four times in one process: first (``alone``), after the bench's forward section
(``tuner.bench.run`` without its packed and backward parts), after ``gc.collect()``, and
after ``torch.cuda.empty_cache()`` too; a line before each stage's rows names it, with the
process's tracked Python objects and the CUDA memory the allocator holds."""

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
    parser.add_argument("--gap", action="store_true", help="the four stages above")
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes]
    problems = [Problem(b, h, s, 128, 128) for b, h, s in shapes]
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "bench_long.jsonl"
    bandwidth = bench.copy_bandwidth()

    def stage(name: str) -> None:
        if args.gap:  # a line before the stage's rows, which run_backward logs as it measures them
            context = {"stage": name, "gc_objects": len(gc.get_objects())}
            context["cuda_reserved_gb"] = torch.cuda.memory_reserved() / 2**30
            with log.open("a") as f:
                f.write(json.dumps(context) + "\n")
        for row in bench.run_backward(
            problems, servings={bench.OUT_OF_THE_BOX: None}, bandwidth=bandwidth, log=log
        ):
            print(
                name, row.get("impl"), row.get("pass"), row.get("median_ms"), row.get("x_floor"), flush=True
            )

    stage("alone")
    if args.gap:
        bench.run(shapes, packed=None, backward=False)
        stage("after forward")
        gc.collect()
        stage("after gc")
        torch.cuda.empty_cache()
        stage("after empty_cache")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
