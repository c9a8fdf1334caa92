"""How fast against fla the forward can be, at each dense bench shape, given the bytes its
kernel must move. From the committed bench rows (no GPU):

    python3 experiments/outofbox/bounds.py > experiments/outofbox/bounds.txt

The HBM floor (``tuner.occupancy.traffic_bytes``) reads Q, K and V once and writes O and
the final state once. A config whose block_dv is under DV reads Q and K once per DV block;
one split into P segments (``kernel.seq_split``) reads K and V of the first P - 1
segments a second time (its states pass, then its outputs pass) and moves the segments'
fp32 states (written, read by the carry, written again, read): it cannot run faster than
those bytes at the bench's measured copy rate. Per shape: ours (the out-of-the-box config) and fla over
the floor, the split's own bound over the floor, ours over that bound, and fla's time over
the bound: the most any kernel that splits as ours does could be faster than fla. Then,
from the 16-head sweep at 4x16x8192, the unsplit configs over the fastest split.
"""

import json
from pathlib import Path

import pandas as pd

from kernel.config import KernelConfig, Problem
from tuner.occupancy import traffic_bytes
from tuner.options import parse_config

HERE = Path(__file__).parent
STATE_BYTES = 4


def split_bytes(problem: Problem, config: KernelConfig) -> int:
    """The bytes a forward with ``config`` moves at the least: the floor, plus Q and K read
    again by each further DV block; split, K (per DV block) and V of every segment but the
    last read again by the states kernel (``kernel.seq_split``: one block per segment but
    the last), and the segments' fp32 states moved four times."""
    p, n = problem, config.segment_count(problem.seqlen)
    dv_blocks = p.dv // config.block_dv
    total = traffic_bytes(p) + p.batch * p.seqlen * p.heads * 2 * p.dk * (dv_blocks - 1) * 2
    if n == 1:
        return total
    again = p.batch * p.heads * (n - 1) * config.segment_length(p.seqlen) * (p.dk * dv_blocks + p.dv) * 2
    states = 4 * p.batch * p.heads * n * p.dk * p.dv * STATE_BYTES
    return total + again + states


def main() -> None:
    cols = "shape dk/dv config ours/floor fla/floor bound/floor ours/bound fla/ours fla/bound".split()
    print("  ".join(f"{c:>14}" for c in cols))
    for name in ("bench_bf16", "bench_bf16_128x256", "bench_bf16_64x64"):
        rows = pd.read_csv(HERE / name / "bench.csv")
        rows = rows[rows["pass"].isna()] if "pass" in rows else rows  # the forward's rows
        for (b, h, s, dk, dv), shape in rows.groupby(["batch", "heads", "seqlen", "dk", "dv"], sort=False):
            by = shape.set_index("impl")
            if not {"out of the box", "fla chunk_simple_gla"} <= set(by.index):
                continue
            if not isinstance(by.loc["out of the box", "config"], str):  # the packed batch: no split
                continue
            floor_ms, bandwidth = by.loc["floor", "median_ms"], by.loc["floor", "bandwidth_tb_s"] * 1e12
            ours, fla = by.loc["out of the box", "median_ms"], by.loc["fla chunk_simple_gla", "median_ms"]
            config = parse_config(by.loc["out of the box", "config"])
            bound_ms = split_bytes(Problem(b, h, s, dk, dv), config) / bandwidth * 1e3
            cells = [f"{b}x{h}x{s}", f"{dk}/{dv}", config.label]
            cells += [f"{x:.2f}" for x in (ours / floor_ms, fla / floor_ms, bound_ms / floor_ms)]
            cells += [f"{x:.2f}" for x in (ours / bound_ms, fla / ours, fla / bound_ms)]
            print("  ".join(f"{c:>14}" for c in cells))

    sweep = HERE.parent / "shipped" / "sweep-128x128_128x256_64x64_256x256-bfloat16.jsonl"
    rows = [json.loads(line) for line in sweep.read_text().splitlines()]
    timed = {
        r["config"]: r["median_ms"]
        for r in rows
        if r["kind"] == "time"
        and (r["b"], r["s"], r["dk"], r["dv"], r["sweep"]) == (4, 8192, 128, 128, "forward")
    }
    split = min((ms, c) for c, ms in timed.items() if not c.endswith("/1"))
    print(f"\n4x16x8192, 128/128 (16-head sweep): fastest split {split[1]} {split[0]:.4f} ms")
    for config in ("64/128/3/256/smem/1", "64/64/3/256/smem/1"):
        print(f"  unsplit {config}: {timed[config]:.4f} ms, {timed[config] / split[0]:.2f}x the split")


if __name__ == "__main__":
    main()
