"""Would a shipped table serve shapes nobody tuned better than the rule? Leave one shape
out: per (head size, dtype, sweep), a dispatch table built from the sweeps' other shapes
serves the left-out one as a user's call is served (``Dispatch.pick``: the nearest entry,
its segment count by ``same_wave``); its measured time there over the best config the
sweep timed there, beside the rule's (``kernel.rule`` for 132 SMs). Tables:
``best``, each entry its shape's fastest config (what ``table.py`` writes); ``robust``, the
rule's config unless another was 3 % faster at the entry's shape. "untimed": the served
config was not timed at the left-out shape.

    PYTHONPATH=. python3 experiments/shipped/table_loo.py SWEEP.jsonl [...]
"""

import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from kernel.config import KernelConfig, Problem
from kernel.ops.dispatch import Dispatch, DispatchEntry
from kernel.rule import default_config, dkdv_config
from tuner.options import parse_config


def rule(p: Problem, sweep: str) -> KernelConfig:
    return dkdv_config(p, "sm_90a", 132) if sweep == "dkdv" else default_config(p, "sm_90a", 132)


def entry_config(p: Problem, sweep: str, timed: dict[str, float], table: str) -> str:
    fastest = min(timed, key=timed.get)
    ruled = rule(p, sweep).label
    if table == "best" or ruled not in timed:
        return fastest
    return fastest if timed[fastest] < 0.97 * timed[ruled] else ruled


def main(paths: list[str]) -> None:
    times: dict[tuple, dict[tuple, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            if r["kind"] == "time" and "median_ms" in r:
                shape = times[r["dk"], r["dv"], r["dtype"], r["sweep"]][r["b"], r["h"], r["s"]]
                shape[r["config"]] = r["median_ms"]
    print("| DK/DV | sweep | served by | shapes | untimed | median | worst | over 1.10x | geomean |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (dk, dv, dtype, sweep), shapes in sorted(times.items()):
        ratios: dict[str, list[float | None]] = defaultdict(list)
        for left, timed in shapes.items():
            p, best = Problem(*left, dk, dv, dtype), min(timed.values())
            ratios["rule"].append(timed[rule(p, sweep).label] / best)
            for table in ("best", "robust"):
                entries = []
                for shape, others in shapes.items():
                    if shape != left:
                        q = Problem(*shape, dk, dv, dtype)
                        label = entry_config(q, sweep, others, table)
                        entries.append(DispatchEntry(q, parse_config(label), others[label], sweep))
                served = Dispatch(entries, {}).pick(p, sweep).config.label
                ratios[table].append(timed[served] / best if served in timed else None)
        for name in ("rule", "best", "robust"):
            got = [r for r in ratios[name] if r is not None]
            geomean = math.exp(statistics.mean(map(math.log, got)))
            cells = [f"{dk}/{dv}", sweep, name, len(ratios[name]), ratios[name].count(None)]
            over = sum(r > 1.10 for r in got)
            cells += [f"{statistics.median(got):.3f}", f"{max(got):.3f}", over, f"{geomean:.3f}"]
            print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
