"""How the search went, from the trial log (``reports.data.report_frame``'s frame): the
Pareto fronts, each knob's spread, the knobs' importance and the history of the best.
Pure functions, as ``reports.data``'s; ``reports.figures`` draws them."""

import warnings
from typing import Any, NamedTuple

import numpy as np
import optuna
import pandas as pd

from kernel.config import knob_choices
from kernel.trial_schema import PARAMS
from reports.data import FINISHED, StudyInfo, best_feasible, finite, native, objectives_of, plain_text


class ParetoInfo(NamedTuple):
    """Trials on an (x, y) plane, both minimised."""

    x: str
    y: str
    feasible: pd.DataFrame  # feasible trials with both coordinates
    infeasible: pd.DataFrame  # infeasible trials with both coordinates (e.g. incorrect, timed)
    untimed: pd.DataFrame  # trials with an x but no y (over a budget, never timed)
    front: pd.DataFrame  # the non-dominated feasible trials, sorted by x


class Importance(NamedTuple):
    values: dict[str, float]  # knob -> fANOVA importance (sums to 1), most important first
    note: str | None  # why there are none, when there are none


def pareto_mask(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """True where (x, y) is dominated by no other point (both minimised; ties all stay)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    le = (x[None, :] <= x[:, None]) & (y[None, :] <= y[:, None])  # [i, j]: j is no worse than i
    lt = (x[None, :] < x[:, None]) | (y[None, :] < y[:, None])
    return ~(le & lt).any(axis=1)


def pareto_info(frame: pd.DataFrame, *, x: str, y: str) -> ParetoInfo:
    """Split ``frame`` for an (x, y) Pareto plot and find the feasible front."""
    done = frame[frame.state.isin(FINISHED)]
    both = done[done[x].notna() & done[y].notna()]
    feasible = both[both.feasible].sort_values("number")
    front = feasible[pareto_mask(feasible[x].to_numpy(), feasible[y].to_numpy())]
    return ParetoInfo(
        x=x,
        y=y,
        feasible=feasible,
        infeasible=both[~both.feasible].sort_values("number"),
        untimed=done[done[x].notna() & done[y].isna()].sort_values("number"),
        front=front.sort_values([x, y, "number"]),
    )


def knob_frame(frame: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Long form of the feasible trials: one row per (trial, knob) with ``knob``, ``choice``
    (as text, ordered by value), ``value`` (the metric), ``number`` and ``hover``."""
    ok = frame[frame.feasible & frame[metric].notna()]
    cols = ["knob", "choice", "value", "number", "hover"]
    parts = [
        ok.sort_values([knob, "number"]).assign(
            knob=knob, choice=lambda f, k=knob: f[k].map(plain_text), value=lambda f: f[metric]
        )[cols]
        for knob in PARAMS
    ]
    return pd.concat(parts, ignore_index=True) if len(ok) else pd.DataFrame(columns=cols)


def importance(frame: pd.DataFrame, info: StudyInfo, metric: str = "median_ms") -> Importance:
    """Each knob's importance for ``metric`` (a column of the trial log, e.g. the latency),
    over the feasible trials only. A failure becomes the note, with its class.

    The evaluator is Optuna's PED-ANOVA: which knobs it takes to reach the best 10 % of the
    feasible trials. Optuna's default, fANOVA, would need scikit-learn, which the tool does
    not otherwise use; PED-ANOVA needs only numpy and is deterministic. The trials go to a
    scratch in-memory study, over the knobs' choices (``kernel.config.knob_choices``).
    """
    objectives = objectives_of(info)
    ranked = best_feasible(frame, objectives)
    feasible = ranked[[finite(v) for v in ranked[metric]]]
    if len(feasible) < 2:
        return Importance(
            {}, f"needs at least 2 feasible trials with {metric}, the study has {len(feasible)}"
        )
    if feasible[metric].nunique() < 2:
        return Importance({}, f"all {len(feasible)} feasible trials have the same {metric}")
    scratch = optuna.create_study(directions=["minimize"] * len(objectives))
    rows = feasible[list(dict.fromkeys([*PARAMS, *objectives, metric]))].to_dict("records")
    dists = _distributions(rows, info.problem.get("dv"))
    try:
        scratch.add_trials(
            [
                optuna.trial.create_trial(
                    params={k: native(r[k]) for k in PARAMS},
                    distributions=dists,
                    values=[float(r[o]) for o in objectives],
                    user_attrs={metric: float(r[metric])},
                )
                for r in rows
            ]
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PED-ANOVA warns when few trials reach the top 10 %
            values = optuna.importance.get_param_importances(
                scratch,
                evaluator=optuna.importance.PedAnovaImportanceEvaluator(),
                target=lambda t: float(t.user_attrs[metric]),
            )
    except (ValueError, RuntimeError, ZeroDivisionError) as exc:
        return Importance({}, f"not computed: {type(exc).__name__}: {exc}".splitlines()[0])
    if not values:
        return Importance({}, "no knob varies among the feasible trials")
    return Importance(dict(values), None)


def _distributions(
    rows: list[dict[str, Any]], dv: Any
) -> dict[str, optuna.distributions.CategoricalDistribution]:
    """Each knob over its choices for the problem's DV; over the values seen where the
    problem is unknown or a value is not among the choices."""
    table = knob_choices(int(dv)) if isinstance(dv, int) and dv > 0 else {}
    dists = {}
    for knob in PARAMS:
        seen = list(dict.fromkeys(native(r[knob]) for r in rows))
        choices = table.get(knob, ())
        if not all(v in choices for v in seen):
            choices = tuple(sorted(seen, key=lambda v: (isinstance(v, str), v)))
        dists[knob] = optuna.distributions.CategoricalDistribution(choices)
    return dists


def history(frame: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Finished trials by number: ``value`` (the metric, NaN unless feasible) and ``best``
    (the best feasible value so far, NaN before the first)."""
    done = frame[frame.state.isin(FINISHED)].sort_values("number")
    value = done[metric].where(done.feasible)
    return pd.DataFrame(
        {
            "number": done.number.to_numpy(),
            "value": value.to_numpy(),
            "best": value.cummin().ffill().to_numpy(),
            "feasible": done.feasible.to_numpy(),
            "hover": done.hover.to_numpy(),
        }
    )


def predicted_against_measured(frame: pd.DataFrame) -> pd.DataFrame:
    """The feasible trials that were measured (not copied from another trial) and have a
    predicted time (a GPU study with the latency model's predictions), each with ``ratio``:
    measured over predicted."""
    both = frame[
        frame.feasible & frame.median_ms.notna() & frame.predicted_ms.notna() & frame.cached_from.isna()
    ]
    return both.assign(ratio=both.median_ms / both.predicted_ms)


def prediction_check(frame: pd.DataFrame, *, least: int = 5, off: float = 1.3) -> list[str]:
    """How far the latency model's predictions are from the measurements, one line per GPU
    with ``least`` or more trials that have both; a line says where the GPU's own model
    comes from where the median ratio is over ``off`` or under ``1 / off``."""
    lines = []
    for gpu, rows in predicted_against_measured(frame).groupby("env_gpu", dropna=False):
        if len(rows) < least:
            continue
        ratio, gpu = float(rows.ratio.median()), gpu if isinstance(gpu, str) else "an unrecorded GPU"
        text = f"latency model on {gpu}: measured / predicted {ratio:.2f} (median of {len(rows)} trials)"
        if not 1 / off <= ratio <= off:
            text += (
                f"; the model is off by {max(ratio, 1 / ratio) - 1:.0%} on this GPU: a GPU run refits this "
                "GPU's own from its trials at its end (python -m tuner model show lists them)"
            )
        lines.append(text)
    return lines
