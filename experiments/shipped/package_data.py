"""The sweeps' JSON lines trimmed to what ``tuner.latency_fit.from_sweep`` and
``tuner.rule_score`` read, written to the package's data folder (``tuner/data/``):

    python3 experiments/shipped/package_data.py tuner/data SWEEP.jsonl ...

Kept: the env row (GPU, architecture, SMs, kernel key), each timed config's probe (its
registers, shared memory and threads) and every timed row's shape, config and median.
Dropped: the checks, the failed probes, the spread and host times. Times are copied as
written, so a fit to the trimmed lines is the fit to the raw ones.
"""

import json
import sys
from pathlib import Path

FIGURES = ("registers", "static_smem", "dynamic_smem", "threads_launched")
PROBE = ("dk", "dv", "heads", "sweep", "config")
TIME = ("b", "h", "s", "dk", "dv", "dtype", "sweep", "config", "median_ms")


def trim(rows: list[dict]) -> list[dict]:
    timed = {(r["dk"], r["dv"], r["h"], r["sweep"], r["config"]) for r in rows if r.get("kind") == "time"}
    out = []
    for r in rows:
        kind = r.get("kind")
        if kind == "env":
            env = {k: r["env"][k] for k in ("gpu", "arch", "kernel")}
            out.append({"kind": "env", "env": env, "sms": r["sms"]})
        elif kind == "probe" and "resources" in r and tuple(r[k] for k in PROBE) in timed:
            probe = {"kind": "probe", **{k: r[k] for k in PROBE}}
            if "ragged" in r:
                probe["ragged"] = r["ragged"]
            out.append(probe | {"resources": {k: r["resources"][k] for k in FIGURES}})
        elif kind == "time" and "median_ms" in r:
            out.append({"kind": "time", **{k: r[k] for k in TIME}})
    return out


def main(folder: str, paths: list[str]) -> None:
    for path in map(Path, paths):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        lines = [json.dumps(r, separators=(",", ":")) for r in trim(rows)]
        (Path(folder) / path.name).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
