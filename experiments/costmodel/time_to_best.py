"""How soon a GPU study finds its best: for the study ``--study`` in ``--storage``, started
by a process launched at ``--start`` (seconds since the epoch, taken before the launch),
the seconds until the first trial within 2 % of the study's final best finished, and that
trial, with where those seconds went: from the launch to the first trial's start, that
trial's compile, and the first GPU measurement's wall time (its worker's start included
when the worker started with it). One JSON line.

    python3 experiments/costmodel/time_to_best.py --storage URL --study NAME --start EPOCH
"""

import argparse
import json

from tuner.studies import load_study
from tuner.trials import best_trials, trial_config

parser = argparse.ArgumentParser()
parser.add_argument("--storage", required=True)
parser.add_argument("--study", required=True)
parser.add_argument("--start", type=float, required=True)
args = parser.parse_args()

study = load_study(args.study, args.storage)  # any storage URL the tuner takes, journal: too
best = best_trials(study)[0]
final = best.user_attrs["median_ms"]
done = sorted(best_trials(study), key=lambda t: t.datetime_complete)
first = next(t for t in done if t.user_attrs["median_ms"] <= 1.02 * final)
print(
    json.dumps(
        {
            "study": args.study,
            "trials": len(study.trials),
            "best": trial_config(best).label,
            "best_ms": final,
            "within_2pct": trial_config(first).label,
            "within_2pct_trial": first.number,
            "within_2pct_s": first.datetime_complete.timestamp() - args.start,
            "last_trial_s": max(t.datetime_complete.timestamp() for t in done) - args.start,
            "first_start_s": min(t.datetime_start.timestamp() for t in study.trials) - args.start,
            "within_2pct_compile_s": first.user_attrs["compile_seconds"],
            "first_measure_wall_s": min(done, key=lambda t: t.datetime_complete).user_attrs["wall_s"],
        }
    )
)
