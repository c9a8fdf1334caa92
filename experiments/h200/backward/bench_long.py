"""The bench's backward rows alone (``tuner.bench.run_backward``: ours and fla's, same run)
at the shapes given:

    python3 experiments/h200/backward/bench_long.py --out DIR 2x16x16384

Writes DIR/bench_long.jsonl (one row per line, as the bench's log)."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def main() -> int:
    from kernel.config import Problem
    from tuner.bench import copy_bandwidth, run_backward

    parser = argparse.ArgumentParser()
    parser.add_argument("shapes", nargs="+", help="BxHxS, DK = DV = 128, fp16")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    problems = [Problem(*map(int, s.split("x")), 128, 128) for s in args.shapes]
    args.out.mkdir(parents=True, exist_ok=True)
    for row in run_backward(
        problems, dispatch=None, bandwidth=copy_bandwidth(), log=args.out / "bench_long.jsonl"
    ):
        print(row.get("impl", "floor"), row.get("pass"), row.get("median_ms"), row.get("x_floor"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
