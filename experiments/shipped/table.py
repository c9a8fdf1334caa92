"""The shipped dispatch table from the sweeps' timings: the fastest checked config of each
(head size, dtype, sweep, shape), an entry each, in the sweep's environment.

    python experiments/shipped/table.py experiments/shipped/sweep-*.jsonl

writes ``kernel/ops/tables/<arch>-<gpu>.json`` (package data, served by
``kernel.ops.tables``). How the rule compares with these bests: ``rule.py``.
"""

import json
import re
import sys
from pathlib import Path

from kernel.config import Problem
from kernel.files import write_json
from kernel.ops.dispatch import DISPATCH_FORMAT, DISPATCH_VERSION
from kernel.ops.tables import SHIPPED
from tuner.options import parse_config


def main(paths: list[str]) -> None:
    env, best = None, {}
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
    entries = [
        {
            "problem": Problem(b, h, s, dk, dv, dtype).to_dict(),
            "config": parse_config(row["config"]).to_dict(),
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


if __name__ == "__main__":
    main(sys.argv[1:])
