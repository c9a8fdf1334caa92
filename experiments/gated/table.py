"""The README's table, from bench.jsonl: python3 experiments/gated/table.py"""

import json
from pathlib import Path

rows = [json.loads(line) for line in (Path(__file__).parent / "bench.jsonl").open() if '"shape"' in line]
print("| shape (G) | DK/DV | floor ms | ours best ms (config) | x floor | fla ms | fla / ours | rel L2 |")
print("|---|---|---|---|---|---|---|---|")
for shape in dict.fromkeys(r["shape"] for r in rows):
    at = [r for r in rows if r["shape"] == shape]
    floor = next(r for r in at if r["impl"] == "floor")
    fla = next(r for r in at if r["impl"].startswith("fla"))
    ours = min((r for r in at if r["impl"] == "ours"), key=lambda r: r["median_ms"])
    print(
        f"| {shape} ({ours['groups']}) | {ours['dk']}/{ours['dv']} | {floor['median_ms']:.3f} "
        f"| {ours['median_ms']:.3f} ({ours['config']}) | {ours['x_floor']:.2f} | {fla['median_ms']:.3f} "
        f"| {fla['median_ms'] / ours['median_ms']:.2f} | {ours['rel_l2']:.1e} |"
    )
