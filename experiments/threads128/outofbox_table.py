"""``outofbox.py``'s rows as a table: per shape, the config each mode served, their forward
and forward plus backward times, the H200's rule over this GPU's (above 1: this GPU's rule
is faster), the outputs' error against reference C and the gradients' gap between modes.

    python experiments/threads128/outofbox_table.py experiments/threads128/outofbox-h100.jsonl
"""

import json
import sys
from collections import defaultdict

COLUMNS = [
    "shape",
    "dtype",
    "served (dq sweep)",
    "fwd ms",
    "H200's rule",
    "fwd ms",
    "fwd: it / served",
    "fwd+bwd ms",
    "it",
    "fwd+bwd: it / served",
    "rel L2 vs ref C",
    "grads gap",
]

rows = [json.loads(line) for line in open(sys.argv[1])]
env = next(r for r in rows if r["kind"] == "env")
peak, copy = env["peak_bandwidth"] / 1e12, env["copy_bandwidth"] / 1e12
clock, bus = env["memory_clock_khz"], env["memory_bus_bits"]
print(
    f"{env['gpu']}: peak {peak:.2f} TB/s (memory clock {clock} kHz, bus {bus} bits), copy {copy:.2f} TB/s\n"
)
times = defaultdict(dict)
for r in rows:
    if r["kind"] == "time":
        times[r["b"], r["h"], r["s"], r["dtype"], r["packed"]][r["mode"]] = r
grads = {(r["b"], r["h"], r["s"], r["packed"]): max(r["rel_l2"]) for r in rows if r["kind"] == "grads"}
print("| " + " | ".join(COLUMNS) + " |")
print("|---" * len(COLUMNS) + "|")
for (b, h, s, dtype, packed), modes in times.items():
    if len(modes) < 2:
        continue
    ours, h200 = modes["out of the box"], modes["h200 rule"]
    shape = f"{b}x{h}x{s}" + (f" ({packed} packed)" if packed else "")
    err = max(ours["rel_l2_vs_ref_c"], h200["rel_l2_vs_ref_c"])
    gap = grads.get((b, h, s, packed))
    cells = [
        shape,
        dtype,
        f"{ours['config']} ({ours['sweeps']['dq']})",
        f"{ours['fwd_ms']:.4f}",
        h200["config"],
        f"{h200['fwd_ms']:.4f}",
        f"{h200['fwd_ms'] / ours['fwd_ms']:.3f}",
        f"{ours['fwdbwd_ms']:.4f}",
        f"{h200['fwdbwd_ms']:.4f}",
        f"{h200['fwdbwd_ms'] / ours['fwdbwd_ms']:.3f}",
        f"{err:.1e}",
        "-" if gap is None else f"{gap:.1e}",
    ]
    print("| " + " | ".join(cells) + " |")
