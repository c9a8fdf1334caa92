"""The report's data: pure functions of a study's trial log and its study-level attrs.

The input is the trial log as ``tuner.trials.trials_frame`` returns it (one row per trial;
``FRAME_COLUMNS`` are the columns read here) and a ``StudyInfo``. Nothing here draws, and
nothing imports the tuner: the dependency runs tuner -> reports. Every function returns a
pandas frame or a NamedTuple that ``reports.figures`` turns into a plotly figure, so the
numbers are tested exactly and the drawing only smoke-tested (Optuna's
``_get_pareto_front_info`` / ``_get_pareto_front_plot``).
"""

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from kernel import formats
from kernel.config import KernelConfig
from kernel.decode import DECODE_KNOBS
from kernel.trial_schema import FLOOR, MEASURES, OUTSIDE, PARAMS, PREDICTED, TRIAL_COLUMNS
from kernel.trial_schema import RESOURCES as RESOURCES_ALL
from reports.decays import decay_label

# The trial log's columns (``kernel.trial_schema.TRIAL_COLUMNS``) are what the report reads.
# ``constraints``: the trial's Optuna constraints, name -> value (> 0: violated), as a JSON
# object text (``json.dumps(t.constraints)``) or a dict.
FRAME_COLUMNS = TRIAL_COLUMNS
# The resource a constraint bounds: constraint = column value - limit.
CONSTRAINT_COLUMNS = {
    "spills": "spill_bytes",
    "smem": "smem_bytes",
    "registers": "registers",
    "correctness": "rel_l2",
}
RESOURCES = ("spill_bytes", "smem_bytes", "registers")
FINISHED = ("COMPLETE", "FAIL", "PRUNED")


class StudyInfo(NamedTuple):
    """The study-level facts the page shows, beside the trial log.

    ``problem``: ``Problem.to_dict()`` of the tuned problem; ``mode``: "gpu" or
    "compile-only" (None: read from the trials); ``objectives``: the frame columns the
    study minimised, in order (None: ``["median_ms"]``); ``peers``: peer timings,
    ``{name: median_ms}`` measured in the same run (validated by ``peers``); ``decays``:
    the one decay an early study checked its trials with (``kernel.formats.study_record``;
    None: RetNet's per head, ``reports.decays.study_decays``).
    """

    name: str
    problem: dict[str, Any]
    mode: str | None = None
    objectives: tuple[str, ...] | None = None
    peers: Any = None
    decays: tuple[float, ...] | None = None
    sweep: str | None = None  # the kernel tuned: "forward", "dkdv" or "decode" (None: unrecorded)

    @classmethod
    def from_attrs(cls, name: str, attrs: Mapping[str, Any]) -> "StudyInfo":
        """From a study's name and user attrs ("problem", "mode", "objectives", "peers"),
        of any version (``kernel.formats.study_record``); other attrs are ignored."""
        record = formats.study_record(dict(attrs), name=name)
        objectives, decays = record.get("objectives"), record.get("decays")
        return cls(
            name=name,
            problem=dict(record.get("problem") or {}),
            mode=record.get("mode"),
            objectives=tuple(objectives) if objectives else None,
            peers=record.get("peers"),
            decays=tuple(decays) if decays else None,
            sweep=record.get("sweep"),
        )


class Summary(NamedTuple):
    """What the page's header says about the study."""

    study: str
    mode: str  # "gpu" or "compile-only"
    timed: bool  # some trial has a latency: the fronts are over latency, else over resources
    metric: str  # what the fronts' y axis, the knob plots and the history are over
    objectives: list[str]
    problem: dict[str, Any]
    environment: dict[str, Any]
    counts: dict[str, int]  # status -> trials
    n_trials: int
    best: int | None  # trial number of the best feasible config (as ``export`` picks it)
    baseline: int | None  # trial number of the seed's default config
    budgets: dict[str, float]  # frame column -> the limit its constraint used
    decays: tuple[float, ...] | None = None  # StudyInfo's


def report_frame(frame: pd.DataFrame, info: StudyInfo) -> pd.DataFrame:
    """A copy of the trial log plus ``config`` (``KernelConfig.label``, the ``--enqueue``
    form), ``violated`` (names of the violated constraints), ``decay`` (``decay_label``),
    ``predicted_rank`` (``predicted_x_floor`` where the model covers the config's knobs,
    what a compile-only study ranks by; NaN for an extrapolation) and ``hover`` (the full
    config and measurements, one HTML line each)."""
    missing = [c for c in FRAME_COLUMNS if c not in frame.columns and c not in FLOOR]
    if missing:
        raise ValueError(f"the trial log lacks the columns {missing} (see reports.data.FRAME_COLUMNS)")
    frame = frame.copy()
    for column in FLOOR:  # a log written before decode trials recorded their floor
        if column not in frame.columns:
            frame[column] = math.nan
    numeric = (*MEASURES, *RESOURCES_ALL, *PREDICTED[:-1], *FLOOR)  # all but predicted_by, a text
    for column in numeric:  # all-None columns (e.g. no latency) come back as objects
        frame[column] = pd.to_numeric(frame[column], errors="coerce").astype(float)
    frame["config"] = [config_label(row) for row in frame[list(PARAMS)].to_dict("records")]
    frame["violated"] = [
        ", ".join(k for k, v in sorted(constraints(c).items()) if v > 0) for c in frame.constraints
    ]
    frame["decay"] = decay_label(info.problem, info.decays)
    outside = frame.predicted_by.fillna("").astype(str).str.endswith(OUTSIDE)
    frame["predicted_rank"] = frame.predicted_x_floor.where(~outside)
    frame["hover"] = [_hover(row) for row in frame.to_dict("records")]
    return frame


def constraints(value: Any) -> dict[str, float]:
    """One trial's ``constraints`` cell -> name -> value; names without a value are left out
    (a Parquet round trip gives every row every name)."""
    if isinstance(value, str):
        value = json.loads(value) if value else {}
    if not isinstance(value, Mapping):
        return {}
    return {str(k): float(v) for k, v in value.items() if v is not None}


def config_label(params: Mapping[str, Any]) -> str:
    """{'chunk': 64, 'block_dv': 32, ...} -> '64/32/2/128/regs/1' (``KernelConfig.label``);
    a knob without a value shows as '?'."""
    plain = {k: native(v) for k, v in params.items()}
    if set(DECODE_KNOBS) <= set(plain) and all(
        plain_text(v) == "?" for k, v in plain.items() if k not in DECODE_KNOBS
    ):
        return "/".join(plain_text(plain[k]) for k in DECODE_KNOBS)  # a decode trial's: block_dv/threads
    try:
        return KernelConfig(**plain).label
    except (TypeError, ValueError):  # a missing or impossible value: still say what is known
        return "/".join(plain_text(v) for v in plain.values())


def native(value: Any) -> Any:
    """numpy scalars and integral floats (a column with a NaN is float) -> Python int/str."""
    value = value.item() if isinstance(value, np.generic) else value
    return int(value) if isinstance(value, float) and value.is_integer() else value


def plain_text(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "?"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _hover(row: dict[str, Any]) -> str:
    def num(key: str, fmt: str, unit: str = "") -> str:
        v = row.get(key)
        return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:{fmt}}{unit}"

    lines = [
        f"trial {row['number']} · {row['status'] or row['state'].lower()}"
        + (" · baseline (seed default)" if row["baseline"] else ""),
        (
            f"bDV={plain_text(row['block_dv'])} threads={plain_text(row['threads'])}"
            if plain_text(row["chunk"]) == "?"  # a decode trial's knobs
            else "C={} bDV={} stages={} threads={} scores={} segments={}".format(
                *(plain_text(row[k]) for k in PARAMS)
            )
        ),
        (
            f"median {num('median_ms', '.4f', ' ms')} (p20 {num('p20_ms', '.4f')}, "
            f"p80 {num('p80_ms', '.4f')}) · rel_l2 {num('rel_l2', '.2e')}"
        ),
        (
            f"registers {num('registers', '.0f')} (seed estimate {num('seed_register_estimate', '.0f')})"
            f" · spills {num('spill_bytes', ',.0f', ' B')} · smem {num('smem_bytes', ',.0f', ' B')}"
        ),
    ]
    if isinstance(row.get("predicted_by"), str):  # never a measurement: labelled as predicted
        lines.insert(
            3,
            f"predicted {num('predicted_ms', '.4f', ' ms')}, {num('predicted_x_floor', '.2f', 'x')} floor "
            f"({num('predicted_low', '.2f')} to {num('predicted_high', '.2f')}) · {row['predicted_by']}",
        )
    if row.get("violated"):
        lines.append(f"constraint violated: {row['violated']}")
    if isinstance(row.get("reason"), str) and row["reason"]:
        lines.append(row["reason"].splitlines()[0][:100])
    return "<br>".join(lines)


def budgets(frame: pd.DataFrame) -> dict[str, float]:
    """Frame column -> the limit its constraint was measured against (constraint = value -
    limit), read from the first trial that has both; e.g. ``{"smem_bytes": 232448.0}``."""
    found: dict[str, float] = {}
    for row in frame.sort_values("number").to_dict("records"):
        for name, value in constraints(row["constraints"]).items():
            column = CONSTRAINT_COLUMNS.get(name)
            measured = row.get(column) if column else None
            if column and column not in found and finite(measured):
                found[column] = float(measured) - value
    return found


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def objectives_of(info: StudyInfo) -> list[str]:
    return list(info.objectives or ["median_ms"])


def best_feasible(frame: pd.DataFrame, objectives: Sequence[str]) -> pd.DataFrame:
    """The feasible trials, best first by the objectives in order, then by trial number (as
    ``export`` ranks them, ``tuner.trials.best_trials``): a predicted ratio to the floor
    ranks the configs the latency model covers first (``predicted_rank``), then its
    extrapolations among themselves."""
    ok = frame[frame.feasible.astype(bool) & (frame.state == "COMPLETE")]
    keys = [k for o in objectives for k in (("predicted_rank", o) if o == "predicted_x_floor" else (o,))]
    return ok.sort_values([*keys, "number"], kind="stable")


def summary(frame: pd.DataFrame, info: StudyInfo) -> Summary:
    """The header of the page. ``frame`` is ``report_frame(trials, info)``."""
    best = best_feasible(frame, objectives_of(info))
    baseline = frame[frame.baseline]
    timed = bool(frame.median_ms.notna().any())
    objectives = objectives_of(info)
    return Summary(
        study=info.name,
        mode=info.mode or _mode_of(frame),
        timed=timed,
        metric="median_ms" if timed else _untimed_metric(objectives, frame),
        objectives=objectives,
        problem=dict(info.problem),
        environment=_environment(frame),
        counts={str(k): int(v) for k, v in frame.status.fillna("unknown").value_counts().items()},
        n_trials=len(frame),
        best=int(best.number.iloc[0]) if len(best) else None,
        baseline=int(baseline.number.iloc[0]) if len(baseline) else None,
        budgets=budgets(frame),
        decays=info.decays,
    )


def _environment(frame: pd.DataFrame) -> dict[str, Any]:
    """The ``env_*`` columns of the first trial that recorded an environment, unprefixed."""
    columns = [c for c in frame.columns if c.startswith("env_")]
    for row in frame.sort_values("number")[columns].to_dict("records"):
        known = {c.removeprefix("env_"): v for c, v in row.items() if not pd.isna(v)}
        if known:
            return known
    return {}


def _mode_of(frame: pd.DataFrame) -> str:
    modes = frame["mode"].dropna()
    return str(modes.iloc[0]) if len(modes) else "unknown"


def _untimed_metric(objectives: list[str], frame: pd.DataFrame) -> str:
    """Without latency: the latency model's prediction where the trials recorded one, else a
    resource (``_resource_metric``)."""
    if frame.predicted_rank.notna().any():
        return "predicted_rank"
    return _resource_metric(objectives, frame)


def _resource_metric(objectives: list[str], frame: pd.DataFrame) -> str:
    """Without latency: the first objective that varies among the feasible trials, else
    shared memory. (The default spill budget of 0 B leaves every feasible config at 0 B
    spilled, so the compile-only objective alone would draw flat lines.)"""
    ok = frame[frame.feasible]
    for column in (*(o for o in objectives if o in RESOURCES), "smem_bytes", "registers"):
        if ok[column].nunique() > 1:
            return column
    return next((o for o in objectives if o in RESOURCES), "spill_bytes")


def top_configs(frame: pd.DataFrame, order: Sequence[str], *, n: int = 10) -> pd.DataFrame:
    """The ``n`` best feasible configs, each once, sorted by ``order`` (the objectives) then
    trial number, then the baseline's row when it is not among them (``baseline`` marks it).
    ``speedup`` is the baseline's median latency over the config's (NaN where untimed)."""
    keys = [k for k in order if k in frame.columns]
    ok = frame[frame.feasible & frame[keys[0]].notna()].sort_values([*keys, "number"])
    top = ok.drop_duplicates("config").head(n)
    base = frame[frame.baseline].sort_values("number").head(1)
    if len(base) and not base.config.isin(top.config).all():
        top = pd.concat([top, base])
    base_ms = float(base.median_ms.iloc[0]) if len(base) else math.nan
    cols = [
        "number",
        "config",
        "status",
        "median_ms",
        "p20_ms",
        "p80_ms",
        "rel_l2",
        "registers",
        "seed_register_estimate",
        "spill_bytes",
        "smem_bytes",
        *PREDICTED,
        "baseline",
    ]
    return top[cols].assign(speedup=base_ms / top.median_ms).reset_index(drop=True)


def failures(frame: pd.DataFrame) -> pd.DataFrame:
    """Finished, infeasible trials grouped by status and the first line of their reason (or
    the constraints they violated): ``status``, ``reason``, ``count``, ``trials`` (numbers)."""
    bad = frame[frame.state.isin(FINISHED) & ~frame.feasible]
    first = bad.reason.fillna("").astype(str).str.split("\n").str[0].str.strip().str.slice(0, 160)
    why = first.where(first != "", bad.violated.map(lambda o: f"constraint violated: {o}" if o else ""))
    grouped = (
        pd.DataFrame({"status": bad.status.fillna("unknown"), "reason": why, "number": bad.number})
        .groupby(["status", "reason"], sort=False)
        .agg(count=("number", "size"), trials=("number", lambda s: sorted(s.tolist())))
        .reset_index()
    )
    grouped = grouped.sort_values(["count", "status", "reason"], ascending=[False, True, True])
    return grouped.reset_index(drop=True)
