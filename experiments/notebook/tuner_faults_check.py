"""Helper of tuner_faults.sh: wait for finished trials, then check nothing finished was lost."""

import json
import sys
import time

import optuna

optuna.logging.set_verbosity(optuna.logging.WARNING)
storage, mode = sys.argv[1], sys.argv[2]


def finished() -> dict[int, dict]:
    try:
        study = optuna.load_study(study_name="faults", storage=storage)
    except KeyError:
        return {}
    return {
        t.number: {
            "state": t.state.name,
            "values": t.values,
            "status": t.user_attrs.get("status"),
            "reason": (t.user_attrs.get("reason") or "")[:160],
            "params": t.params,
        }
        for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL))
    }


if mode == "wait":
    deadline = time.monotonic() + 400
    while len(finished()) < int(sys.argv[3]) and time.monotonic() < deadline:
        time.sleep(1)
    print(json.dumps(finished()))
else:
    before = {int(k): v for k, v in json.load(open(sys.argv[3])).items()}
    after = finished()
    study = optuna.load_study(study_name="faults", storage=storage)
    report = {
        "finished_before_kill": len(before),
        "finished_after_resume": len(after),
        "lost_or_changed": [n for n, t in before.items() if after.get(n) != t],
        "still_running": len(study.get_trials(states=(optuna.trial.TrialState.RUNNING,))),
        "by_status": {
            s: sum(t["status"] == s for t in after.values()) for s in {t["status"] for t in after.values()}
        },
        "first_five": {n: after[n] for n in sorted(after)[:5]},
        "interrupted": {n: t for n, t in after.items() if t["status"] == "interrupted"},
        "best": study.best_trial.params if study.best_trials else None,
    }
    print(json.dumps(report, indent=1))
    sys.exit(0 if not report["lost_or_changed"] and not report["still_running"] else 1)
