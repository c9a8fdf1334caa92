"""The shipped dispatch table from the sweeps' timings: the fastest checked config of each
(head size, dtype, sweep, shape), an entry each, in the sweep's environment.

    python experiments/h200/shipped/table.py experiments/h200/shipped/sweep-*.jsonl

writes ``kernel/ops/tables/<arch>-<gpu>.json`` (package data, served by
``kernel.ops.tables``) and prints, per head size and sweep, the rule's time over the best.
"""

import dataclasses
import json
import re
import statistics
import sys
from pathlib import Path

from kernel.config import KernelConfig, Problem
from kernel.environment import write_json
from kernel.ops.dispatch import DISPATCH_FORMAT, DISPATCH_VERSION
from kernel.ops.tables import SHIPPED


def config_of(label: str) -> KernelConfig:
    """The config of a label ('64/128/2/256/smem/1', ``KernelConfig.label``)."""
    fields = dataclasses.fields(KernelConfig)
    values = label.split("/")
    return KernelConfig(**{f.name: v if f.type in (str, "str") else int(v) for f, v in zip(fields, values)})


def main(paths: list[str]) -> None:
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
            "config": config_of(row["config"]).to_dict(),
            "median_ms": row["median_ms"],
            "sweep": sweep,
        }
        for (dk, dv, dtype, sweep, b, h, s), row in sorted(best.items())
    ]
    name = re.sub(r"[^A-Za-z0-9]+", "_", env["gpu"]).strip("_")
    path = SHIPPED / f"{env['arch']}-{name}.json"
    write_json(
        path, {"format": DISPATCH_FORMAT, "version": DISPATCH_VERSION, "environment": env, "entries": entries}
    )
    print(f"{path}: {len(entries)} entries")
    groups: dict[tuple, list[float]] = {}
    for key, ms in rule.items():
        groups.setdefault(key[:4], []).append(ms / best[key]["median_ms"])
    for (dk, dv, dtype, sweep), ratios in sorted(groups.items()):
        print(
            f"{dk}x{dv} {dtype} {sweep}: rule / best median {statistics.median(ratios):.3f}, "
            f"worst {max(ratios):.3f} over {len(ratios)} shapes"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
