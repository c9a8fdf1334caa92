"""The same configs at 4x16x8192 (128/128, bf16) on the two GPUs, from the committed sweeps:
the rule's split, the unsplit half-width config at 256 threads (both sweeps) and at 128
threads (the H100's alone), each a median of its own process's timings.

    python3 experiments/threads128/gpus.py > experiments/threads128/gpus.txt
"""

import json
from pathlib import Path

HERE = Path(__file__).parent
SWEEPS = {
    "H200": HERE.parent / "shipped" / "sweep-128x128_128x256_64x64_256x256-bfloat16.jsonl",
    "H100": HERE.parent / "shipped" / "sweep-128x128-bfloat16-h100.jsonl",
    "H100, 128 threads": HERE / "threads128-h100.jsonl",
}
SHAPE = (4, 16, 8192)
CONFIGS = ("64/128/3/256/smem/2", "64/64/3/256/smem/1", "64/64/3/128/smem/1")


def main() -> None:
    got = {}
    print(f"{'sweep':<18} " + " ".join(f"{c:>20}" for c in CONFIGS) + "   (ms, 4x16x8192, 128/128)")
    for name, path in SWEEPS.items():
        rows = [json.loads(line) for line in path.open()]
        ms = {
            r["config"]: r["median_ms"]
            for r in rows
            if r["kind"] == "time" and "median_ms" in r and r["sweep"] == "forward"
            and (r["b"], r["h"], r["s"]) == SHAPE and r["dk"] == r["dv"] == 128
        }  # fmt: skip
        print(f"{name:<18} " + " ".join(f"{ms[c]:>20.4f}" if c in ms else f"{'-':>20}" for c in CONFIGS))
        got[name] = ms
    split, half, warp = CONFIGS
    print(f"the split, H100 over H200: {got['H100'][split] / got['H200'][split]:.3f}")
    print(f"unsplit half-width, H100 over H200: {got['H100'][half] / got['H200'][half]:.3f}")
    print(f"on the H100, 256 over 128 threads: {got['H100'][half] / got['H100, 128 threads'][warp]:.3f}")


if __name__ == "__main__":
    main()
