"""Per shape of a ``SWEEP_THREADS=128`` sweep (``../shipped/sweep.py``): the rule's config
and time, the fastest config of one consumer warpgroup (128 threads) and its time, both
from the same process, and the rule's time over it (over 1: the warpgroup was faster).

    python3 experiments/threads128/table.py experiments/threads128/threads128-*.jsonl
"""

import json
import sys


def main(paths: list[str]) -> None:
    ratios: dict[int, list[float]] = {}  # the rule's segment count -> rule / fastest 128-thread
    print("| file | shape | B*H | rule | ms | fastest at 128 threads | ms | blocks | rule / it |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in paths:
        rows = [json.loads(line) for line in open(path)]
        timed = [r for r in rows if r["kind"] == "time" and "median_ms" in r]
        for shape in dict.fromkeys((r["b"], r["h"], r["s"]) for r in timed):
            at = [r for r in timed if (r["b"], r["h"], r["s"]) == shape]
            rule = next(r for r in at if r["rule"])
            warp = min((r for r in at if r["config"].split("/")[3] == "128"), key=lambda r: r["median_ms"])
            b, h, s = shape
            ratios.setdefault(int(rule["config"].split("/")[-1]), []).append(
                rule["median_ms"] / warp["median_ms"]
            )
            print(
                f"| {path.rsplit('/', 1)[-1]} | {b}x{h}x{s} | {b * h} | {rule['config']} | "
                f"{rule['median_ms']:.4f} | {warp['config']} | {warp['median_ms']:.4f} | {warp['blocks']} | "
                f"{rule['median_ms'] / warp['median_ms']:.3f} |"
            )

    print()
    for segments, found in sorted(ratios.items()):
        faster = sum(r >= 1.05 for r in found)
        print(
            f"rule split {segments} way(s): {len(found)} shapes, rule / it {min(found):.3f} to "
            f"{max(found):.3f}, 128 threads 1.05x faster or more at {faster}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
