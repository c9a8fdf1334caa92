"""How each trial's outcome is told to Optuna.

Trial outcomes (Kernel Tuner's "failures are values"):
- restricted: breaks a named restriction (``kernel.constraints.violated``); COMPLETE, value inf,
  constraint "restriction" violated, with the restriction's name as the reason.
- compile_failed: the compiler refused it; COMPLETE, value inf, constraint "compiles"
  violated, with the error class and message as the reason.
- infeasible: compiled, but over a resource budget (constraints > 0); COMPLETE, value inf.
  These three are told as values, not failures, because Optuna's samplers learn only from
  COMPLETE trials: TPE then steers away from configs that cannot run (a FAIL trial is
  invisible to it, so it would keep proposing them).
- runtime_failed: the GPU worker hung, crashed or raised; state FAIL with the reason.
- incorrect: relative L2 against reference C at or over the tolerance, or NaN; COMPLETE,
  correctness constraint > 0.
- ok: feasible and correct; value = median latency in ms (GPU) or the predicted time as
  a ratio to the HBM floor (compile-only, where nothing is timed: ``tuner.latency``).
"""

import math
import time

import optuna
from optuna.trial import TrialState

from kernel.probe import Resources
from tuner.latency import Prediction
from tuner.options import Options


def objective_names(gpu: bool, multi: bool) -> list[str]:
    """What a study minimises: latency (then error) on a GPU; compile-only, the latency
    model's predicted time as a ratio to the HBM floor (then shared memory)."""
    first = "median_ms" if gpu else "predicted_x_floor"
    return [first, "rel_l2" if gpu else "smem_bytes"] if multi else [first]


def predicted(trial: optuna.Trial, prediction: Prediction) -> None:
    """Record the latency model's prediction for a compiled config (never a measurement)."""
    for key, value in prediction.record().items():
        trial.set_user_attr(key, value)


# User attributes of a trial that belong to it alone, not to its config's outcome.
OWN_ATTRS = ("host", "pid", "wall_s", "cached_from", "baseline", "requeued_from", "claim_attempt")


def violations(res: Resources, options: Options) -> dict[str, float]:
    """Each resource constraint's value for a compiled config (> 0: over its budget)."""
    return {
        "spills": float(res.spill_bytes - options.max_spill_bytes),
        "smem": float(res.smem_bytes - res.smem_limit),
        "registers": float(res.registers - options.max_registers),
    }


def over_budget_reason(res: Resources, options: Options) -> str:
    """The budgets a compiled config is over, in words."""
    opts = options
    budgets = (
        ("spills", res.spill_bytes, opts.max_spill_bytes, "B spilled"),
        ("shared memory", res.smem_bytes, res.smem_limit, "B"),
        ("registers", res.registers, opts.max_registers, "per thread"),
    )
    return "; ".join(
        f"{name}: {value} {unit}, over the budget of {limit}"
        for name, value, limit, unit in budgets
        if value > limit
    )


def tell(study: optuna.Study, trial: optuna.Trial, values: list[float], status: str, start: float) -> None:
    """Tell ``trial`` with ``values`` and its status and wall time."""
    trial.set_user_attr("status", status)
    trial.set_user_attr("wall_s", time.perf_counter() - start)
    study.tell(trial, values if len(values) > 1 else values[0])


def reject(
    study: optuna.Study,
    trial: optuna.Trial,
    objectives: int,
    status: str,
    constraint: str,
    reason: str,
    start: float,
) -> None:
    """A config that cannot run: the worst value and one violated constraint."""
    trial.set_user_attr("reason", reason[:2000])
    trial.set_constraint(constraint, 1.0)
    tell(study, trial, [math.inf] * objectives, status, start)


def fail(study: optuna.Study, trial: optuna.Trial, status: str, reason: str, start: float) -> None:
    """Tell ``trial`` FAIL (the GPU worker hung, crashed or raised) with the reason."""
    trial.set_user_attr("status", status)
    trial.set_user_attr("reason", reason[:2000])
    trial.set_user_attr("wall_s", time.perf_counter() - start)
    study.tell(trial, state=TrialState.FAIL)


def copy(study: optuna.Study, trial: optuna.Trial, owner: optuna.trial.FrozenTrial) -> None:
    """Tell ``trial`` the outcome its config's owner got (no compile, no measurement)."""
    start = time.perf_counter()
    trial.set_user_attr("cached_from", owner.number)
    for key, value in owner.user_attrs.items():
        if key not in OWN_ATTRS and key not in ("status", "reason"):
            trial.set_user_attr(key, value)
    if owner.state == TrialState.FAIL:
        fail(
            study,
            trial,
            owner.user_attrs.get("status", "runtime_failed"),
            owner.user_attrs.get("reason", ""),
            start,
        )
        return
    for key, value in owner.constraints.items():
        trial.set_constraint(key, value)
    if "reason" in owner.user_attrs:
        trial.set_user_attr("reason", owner.user_attrs["reason"])
    tell(study, trial, list(owner.values), owner.user_attrs.get("status", "ok"), start)


def measured(
    study: optuna.Study, trial: optuna.Trial, result: dict, tolerance: float, objectives: int, start: float
) -> None:
    """Tell ``trial`` what the GPU worker's ``result`` says: runtime_failed, incorrect or ok."""
    if not result.pop("ok"):
        fail(study, trial, "runtime_failed", f"{result['error_type']}: {result['message']}", start)
        return
    for key, value in result.items():
        trial.set_user_attr(key, value)
    err = result["rel_l2"]
    correct = result["finite"] and math.isfinite(err) and err < tolerance
    trial.set_constraint("correctness", (err - tolerance) if math.isfinite(err) else 1.0)
    if not correct:
        tell(study, trial, [math.inf] * objectives, "incorrect", start)
        return
    tell(study, trial, [result["median_ms"], err][:objectives], "ok", start)
