"""The README's table, from bench.jsonl: python3 experiments/decode/table.py"""

import json
from pathlib import Path

rows = [json.loads(line) for line in (Path(__file__).parent / "bench.jsonl").open()]
shapes: dict = {}
for r in rows:
    shapes.setdefault((r["n"], r["heads"]), {})[r["what"]] = r
print(
    "| N x H | ours GPU us | floor us | ours/floor | fla+gather/scatter us | fla/ours | ours host us/call |",
    "config |",
)
print("|---|---|---|---|---|---|---|---|")
for (n, h), d in shapes.items():
    o, f, fla = d["ours"], d["copy (floor)"], d["fla fused_recurrent + gather/scatter"]
    print(
        f"| {n}x{h} | {o['gpu_us']:.1f} | {f['gpu_us']:.1f} | {o['over_floor']:.3f} | {fla['gpu_us']:.1f} "
        f"| {fla['gpu_us'] / o['gpu_us']:.2f} | {o['host_us']:.1f} | {o['config']} |"
    )
