"""The shipped dispatch table from the sweeps' timings: the fastest checked config of each
(head size, dtype, sweep, shape), an entry each, in the sweep's environment.

    python experiments/h200/shipped/table.py [--write] experiments/h200/shipped/sweep-*.jsonl

prints, per head size and sweep, the rule's time over the best (the README's table); with
``--write`` it also writes ``kernel/ops/tables/<arch>-<gpu>.json`` (package data, served
by ``kernel.ops.tables``).
"""

import json
import re
import statistics
import sys
from pathlib import Path

from kernel.config import Problem
from kernel.environment import write_json
from kernel.ops.dispatch import DISPATCH_FORMAT, DISPATCH_VERSION
from kernel.ops.tables import SHIPPED
from tuner.commands.args import parse_config


def main(paths: list[str], write: bool) -> None:
    env, best, rule = None, {}, {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            if row["kind"] == "env":
                if env not in (None, row["env"]):
                    raise SystemExit(f"{path}: measured in another environment than the other sweeps")
                env = row["env"]
            if row["kind"] != "time" or "median_ms" not in row:
                continue
            key = (row["dk"], row["dv"], row["dtype"], row["sweep"], row["b"], row["h"], row["s"])
            if key not in best or row["median_ms"] < best[key]["median_ms"]:
                best[key] = row
            if row["rule"]:
                rule[key] = row["median_ms"]
    entries = [
        {
            "problem": Problem(b, h, s, dk, dv, dtype).to_dict(),
            "config": parse_config(row["config"]).to_dict(),
            "median_ms": row["median_ms"],
            "sweep": sweep,
        }
        for (dk, dv, dtype, sweep, b, h, s), row in sorted(best.items())
    ]
    if write:
        name = re.sub(r"[^A-Za-z0-9]+", "_", env["gpu"]).strip("_")
        path = SHIPPED / f"{env['arch']}-{name}.json"
        table = {
            "format": DISPATCH_FORMAT,
            "version": DISPATCH_VERSION,
            "environment": env,
            "entries": entries,
        }
        write_json(path, table)
        print(f"{path}: {len(entries)} entries")
    groups: dict[tuple, list[tuple[float, str]]] = {}
    for key, ms in rule.items():
        groups.setdefault(key[:4], []).append((ms / best[key]["median_ms"], f"{key[4]}x{key[5]}x{key[6]}"))
    print("| DK/DV | sweep | shapes | median | worst | shapes over 1.10x |\n|---|---|---|---|---|---|")
    for (dk, dv, _, sweep), found in sorted(groups.items()):
        ratios = [r for r, _ in found]
        over = ", ".join(f"{shape} {r:.2f}" for r, shape in sorted(found, reverse=True) if r > 1.10) or "-"
        median, worst = statistics.median(ratios), max(ratios)
        print(f"| {dk}/{dv} | {sweep} | {len(ratios)} | {median:.3f} | {worst:.3f} | {over} |")


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if a != "--write"], "--write" in sys.argv)
