"""Issue 17's scale-out measurement, summed up: the wall time of one worker against two,
and each shape's pick in both runs (the same config, or the other run's latency of it).

    python3 experiments/scaleout/summary.py OUT WORK

reads OUT/walls.jsonl and OUT/dispatch_w{1,2}.json, writes OUT/trials.csv (every trial of
both runs, from the journals under WORK) and prints the summary.
"""

import json
import sys
from pathlib import Path

import optuna
import pandas as pd

from kernel.config import KernelConfig
from tuner.storage import get_storage
from tuner.trials import trials_frame

GOAL = 1.7  # two workers at least this much faster than one


def main(out: Path, work: Path) -> None:
    walls = {w["workers"]: w for w in map(json.loads, (out / "walls.jsonl").read_text().splitlines())}
    frames = []
    for n in (1, 2):
        storage = get_storage(f"journal:{work / f'w{n}' / 'studies.journal'}", create=False)
        for name in optuna.get_all_study_names(storage):
            if "/claim/" not in name:
                study = optuna.load_study(study_name=name, storage=storage)
                frames.append(trials_frame(study).assign(workers=n, study=name))
    trials = pd.concat(frames, ignore_index=True)
    trials.to_csv(out / "trials.csv", index=False)

    one, two = walls[1]["wall_s"], walls[2]["wall_s"]
    print(f"wall: 1 worker {one:.1f} s, 2 workers {two:.1f} s: {one / two:.2f}x (goal >= {GOAL}x)")
    tables = {n: json.loads((out / f"dispatch_w{n}.json").read_text())["entries"] for n in (1, 2)}
    for a, b in zip(tables[1], tables[2], strict=True):
        p, ca, cb = a["problem"], KernelConfig.from_dict(a["config"]), KernelConfig.from_dict(b["config"])
        shape = f"{p['batch']}x{p['heads']}x{p['seqlen']}"
        line = (
            f"{shape:>12}: 1 worker {ca.label} {a['median_ms']:.4f} ms, "
            f"2 workers {cb.label} {b['median_ms']:.4f} ms"
        )
        if ca != cb:  # each run's latency of the other's pick, where it measured it
            for n, c in ((1, cb), (2, ca)):
                rows = trials[(trials.workers == n) & (trials.study == a["study"]) & trials.feasible]
                rows = rows[[KernelConfig(**{k: r[k] for k in c.to_dict()}) == c for _, r in rows.iterrows()]]
                got = f"{rows.median_ms.min():.4f} ms" if len(rows) else "not measured"
                line += f"; run {n} had {c.label} at {got}"
        print(line + f" ({b['median_ms'] / a['median_ms'] - 1:+.1%})")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
