"""Would the backward gain by running its dq sweep and its fused dk+dv sweep at once, on
two streams, each unsplit on half the SMs, instead of one after the other, each split to
fill them? A CPU estimate from the committed H200 sweep rows, no GPU:

    python3 experiments/backward/concurrent.py > experiments/backward/concurrent.txt

Per shape whose two unsplit kernels fit the SMs side by side (128/128, bf16) it prints,
from the sweep's medians: the served order (the forward's rule config as the dq sweep,
then the fused sweep's rule config), and the two unsplit kernels side by side, whose
time is at best the slower of the two
(each block's chunks run one after another, so an unsplit block takes as long alone as
beside another kernel), and the microseconds per chunk of one unsplit block. The dq
sweep of an eager call runs only the split forward's outputs kernel (it reads the
forward's states), so the served sum overstates it; the estimate favours the two streams.
"""

import csv
import json
import sys
from pathlib import Path

SMS = 132  # the H200's: two unsplit kernels run side by side only where 2 * B * H fits them
SWEEP = Path(__file__).parents[1] / "shipped" / "sweep-128x128_128x256_64x64_256x256-bfloat16.jsonl"
BENCH = Path(__file__).parents[1] / "outofbox" / "bench_bf16" / "bench.csv"  # the served backward, timed
GAP = Path(__file__).parents[1] / "costmodel" / "gap-128x128-bfloat16.jsonl"


def main() -> None:
    rows = [json.loads(line) for path in (SWEEP, GAP) for line in path.open()]
    times = [r for r in rows if r["kind"] == "time" and r["dk"] == r["dv"] == 128]
    shapes = sorted({(r["b"], r["h"], r["s"]) for r in times if 2 * r["b"] * r["h"] <= SMS})
    print("shape        B*H  served dq+dkdv ms  unsplit max(dq, dkdv) ms  ratio  us/chunk dq, dkdv")
    for b, h, s in shapes:
        at = [r for r in times if (r["b"], r["h"], r["s"]) == (b, h, s)]

        def best(sweep: str, **match) -> float | None:
            found = [
                r["median_ms"] for r in at if r["sweep"] == sweep and all(r[k] == v for k, v in match.items())
            ]
            return min(found) if found else None

        rule_dq, rule_dkdv = best("forward", rule=True), best("dkdv", rule=True)
        one = [r for r in at if r["config"].endswith("/1")]
        dq1 = min((r["median_ms"] for r in one if r["sweep"] == "forward"), default=None)
        dkdv1 = min((r["median_ms"] for r in one if r["sweep"] == "dkdv"), default=None)
        if None in (rule_dq, rule_dkdv, dq1, dkdv1):
            continue
        served, side = rule_dq + rule_dkdv, max(dq1, dkdv1)
        chunks = s // 64
        print(
            f"{b}x{h}x{s:<6} {b * h:>4}  {served:>17.4f}  {side:>24.4f}  {side / served:>5.2f}"
            f"  {1e3 * dq1 / chunks:.2f} us, {1e3 * dkdv1 / chunks:.2f} us"
        )

    with BENCH.open() as f:
        for row in csv.DictReader(f):
            if row["impl"] == "out of the box backward":
                print(
                    f"bench, the served backward at {row['batch']}x{row['heads']}x{row['seqlen']}: "
                    f"{float(row['median_ms']):.4f} ms ({row['config']})"
                )


if __name__ == "__main__":
    sys.exit(main())
