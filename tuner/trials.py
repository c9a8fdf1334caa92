"""Queries on a study's trials, and the trial log: one pandas row per trial. Pure
functions of the study."""

import json
import math
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
from optuna.trial import FrozenTrial, TrialState

from kernel import formats
from kernel.config import SEED_CONFIG, KernelConfig
from kernel.decode import DECODE_KNOBS, DecodeConfig
from kernel.environment import ENVIRONMENT_KEYS, env_key
from kernel.files import replacing
from kernel.trial_schema import FLOOR, MEASURES, PARAMS, PREDICTED, RESOURCES, TRIAL_COLUMNS
from tuner.claims import interrupted
from tuner.lines import WIDTH
from tuner.options import UsageError

# Outcomes that cost a GPU launch (a cached trial reuses an earlier launch and costs none).
GPU_OUTCOMES = ("ok", "incorrect", "runtime_failed")
# The trial listing's columns, as `trials` and `best` print them.
LISTING_COLUMNS = (
    "number",
    "status",
    "config",
    "median_ms",
    "predicted_ms",
    "rel_l2",
    "spill_bytes",
    "smem_bytes",
    "registers",
    "reason",
)


def is_feasible(trial: FrozenTrial) -> bool:
    """Finished, correct and within every budget: the only trials a best config comes from."""
    return (
        trial.state == TrialState.COMPLETE
        and trial.user_attrs.get("status") == "ok"
        and all(v <= 0 for v in trial.constraints.values())
    )


def trial_env_key(trial: FrozenTrial) -> str | None:
    """The key of the environment the trial was measured in (None: it recorded none)."""
    attrs = trial.user_attrs
    if "env_key" in attrs:
        return attrs["env_key"]
    return env_key(attrs["environment"]) if attrs.get("environment") else None


def best_trials(study: optuna.Study, env: str | None = None) -> list[FrozenTrial]:
    """Feasible trials, best first by the objectives in order, then by the predicted time
    (a compile-only study ranks the configs its latency model does not cover after the
    others, all tied at infinity: among them the extrapolation orders), each config once
    per environment (its best trial, the earliest of equals: a cached copy is never listed
    beside its owner); with ``env``, only those measured in that environment (measurements
    are ranked per environment, never across)."""
    feasible = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if is_feasible(t) and (env is None or trial_env_key(t) == env)
    ]
    best: dict[tuple[str | None, KernelConfig], FrozenTrial] = {}

    def rank(t: FrozenTrial) -> tuple:
        return tuple(t.values), t.user_attrs.get("predicted_x_floor") or math.inf, t.number

    for t in sorted(feasible, key=rank):
        best.setdefault((trial_env_key(t), trial_config(t)), t)
    return list(best.values())


def environments(study: optuna.Study) -> dict[str | None, tuple[dict[str, Any] | None, int]]:
    """Each environment the study's feasible trials were measured in: key -> (environment,
    how many feasible trials)."""
    found: dict[str | None, tuple[dict[str, Any] | None, int]] = {}
    for t in best_trials(study):
        key = trial_env_key(t)
        found[key] = (t.user_attrs.get("environment"), found.get(key, (None, 0))[1] + 1)
    return found


def describe_env(key: str | None, env: dict[str, Any] | None) -> str:
    """'3f2a... (GPU NAME, torch 2.9.0, kernel 1a2b3c)', one line; without a GPU, the
    architecture compiled for."""
    if key is None:
        return "an unrecorded environment"
    env = env or {}
    libraries = ", ".join(f"{k} {env.get(k)}" for k in ("torch", "tilelang", "kernel"))
    where = env.get("gpu") or f"no GPU: compile-only for {env.get('arch')}"
    return f"{key} ({where}, {libraries})"


def choose_env(study: optuna.Study, wanted: str | None, here: Callable[[], str]) -> str | None:
    """The environment whose best trials ``best`` and ``export`` report: ``wanted`` (a key
    or its prefix) when given; else the only one; else this machine's (``here()``, only
    computed then) when it has feasible trials. ``UsageError`` naming the choices otherwise."""
    found = environments(study)
    choices = "; ".join(f"{describe_env(k, env)}: {n} feasible" for k, (env, n) in found.items())
    if wanted is not None:
        matches = [k for k in found if k is not None and k.startswith(wanted)]
        if len(matches) != 1:
            raise UsageError(
                f"--env {wanted!r} names {'no' if not matches else 'more than one'} environment of "
                f"study {study.study_name!r}; it has: {choices or 'none with a feasible trial'}"
            )
        return matches[0]
    if len(found) <= 1:
        return next(iter(found), None)
    key = here()
    if key in found:
        return key
    raise UsageError(
        f"study {study.study_name!r} holds measurements of {len(found)} environments, none of them "
        f"this machine's: choose one with --env KEY ({choices})"
    )


def trial_params(trial: FrozenTrial) -> dict[str, Any]:
    """The trial's params; for one still queued (enqueued, not yet asked), the enqueued ones."""
    return trial.params or trial.system_attrs.get("fixed_params", {})


def trial_config(trial: FrozenTrial) -> KernelConfig | DecodeConfig:
    """The trial's config (``kernel.formats.trial_knobs``: of any study version); a decode
    study's trial (``run --sweep decode``: no chunk) its ``DecodeConfig``."""
    return config_of(trial_params(trial))


def config_of(knobs: dict[str, Any]) -> KernelConfig | DecodeConfig:
    """A trial's params, or an export's config, as its config: the decode step's where they
    are its knobs (``is_decode``), else the forward's of any study version."""
    return DecodeConfig(**knobs) if is_decode(knobs) else KernelConfig(**formats.trial_knobs(knobs))


def is_decode(params: dict[str, Any]) -> bool:
    """Whether a trial's params are the decode step's knobs (``kernel.decode.DECODE_KNOBS``)."""
    return bool(params) and set(params) <= set(DECODE_KNOBS)


def config_label(row: dict[str, Any]) -> str:
    """A trial log row's config as its label: the forward's (``KernelConfig.label``), or a
    decode trial's, whose forward knobs are empty (``DecodeConfig.label``)."""
    knobs = {k: row[k] for k in PARAMS}
    if all(_empty(knobs[k]) for k in PARAMS if k not in DECODE_KNOBS):
        return DecodeConfig(**{k: int(knobs[k]) for k in DECODE_KNOBS}).label
    return KernelConfig(**knobs).label


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def measured_before(study: optuna.Study, params: dict[str, Any], key: str) -> FrozenTrial | None:
    """A finished trial of the same config, measured (not copied) in environment ``key``."""
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if t.params == params and t.user_attrs.get("env_key") == key and "cached_from" not in t.user_attrs:
            return t
    return None


def trials_frame(study: optuna.Study, *, env: str | None = None) -> pd.DataFrame:
    """One row per trial with ``kernel.trial_schema.TRIAL_COLUMNS``: params, latency, error,
    resources, status, why it failed, wall time and environment. Missing measurements are
    NaN/None. ``env``: only the trials measured in that environment (``trial_env_key``)."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        if env is not None and trial_env_key(t) != env:
            continue
        attrs = t.user_attrs
        measured_in = attrs.get("environment") or {}
        params = trial_params(t)
        row: dict[str, Any] = {
            "number": t.number,
            "state": t.state.name,
            # A FAIL with no status: Optuna failed it for a stale heartbeat (tuner.liveness.fail_stale).
            "status": attrs.get("status")
            or {"RUNNING": "running", "WAITING": "queued", "FAIL": "interrupted"}.get(t.state.name),
            "reason": attrs.get("reason")
            or ("no heartbeat within the grace period: its worker died" if t.state.name == "FAIL" else None),
            **{
                k: v
                for k, v in (params if is_decode(params) else formats.trial_knobs(params)).items()
                if k in PARAMS
            },
            **{k: attrs.get(k) for k in (*MEASURES, *RESOURCES, *PREDICTED, *FLOOR)},
            "feasible": is_feasible(t),
            "baseline": bool(attrs.get("baseline", False)),
            "gpu_evaluated": attrs.get("mode") == "gpu"
            and attrs.get("status") in GPU_OUTCOMES
            and attrs.get("cached_from") is None,
            "cached_from": attrs.get("cached_from"),
            "mode": attrs.get("mode"),
            "wall_s": attrs.get("wall_s"),
            "started": t.datetime_start,
            **{f"env_{k}": measured_in.get(k) for k in ENVIRONMENT_KEYS},
            "constraints": json.dumps(t.constraints, sort_keys=True),
        }
        rows.append(row)
    return pd.DataFrame(rows, columns=list(TRIAL_COLUMNS))


def listing(frame: pd.DataFrame, columns=LISTING_COLUMNS, width: int = WIDTH) -> str:
    """The trial log as text: the config as its label, whole numbers without a decimal
    point, empty cells blank, each reason's first line. A reason that would take a line past
    ``width`` characters is cut (to no fewer than 12) and ends in "... [n]": the listing is
    followed by a blank line and its notes, ``[n]`` and the whole first line of each cut
    reason, wrapped at ``width`` (the log's files keep every reason whole). Where no trial
    has a predicted time in ms (the latency model is not calibrated for the study's
    architecture), the predicted ratio to the floor stands in."""
    if (
        "predicted_ms" in columns
        and frame.predicted_ms.isna().all()
        and frame.predicted_x_floor.notna().any()
    ):
        columns = [c if c != "predicted_ms" else "predicted_x_floor" for c in columns]
    shown = frame.assign(
        config=[config_label(row) for _, row in frame.iterrows()],
        reason=frame.reason.map(
            lambda r: r.strip().splitlines()[0] if isinstance(r, str) and r.strip() else None
        ),
    )[list(columns)]
    for column in shown.columns:
        values = shown[column]
        numeric = pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values)
        if numeric and values.dropna().map(lambda x: float(x).is_integer()).all():  # ints and floats
            shown[column] = values.astype("Int64")
    shown = shown.astype(object).where(shown.notna(), "")
    text = shown.to_string(index=False)
    over = max(map(len, text.splitlines()), default=0) - width
    if over <= 0 or "reason" not in shown:
        return text
    room = max(shown.reason.map(len).max() - over, 12)  # the reason's column is as wide as its longest cell
    notes: dict[str, int] = {}

    def cut(reason: str) -> str:
        if len(reason) <= room:
            return reason
        mark = f"... [{notes.setdefault(reason, len(notes) + 1)}]"
        return reason[: max(room - len(mark), 0)].rstrip() + mark

    shown["reason"] = shown.reason.map(cut)
    wrap = textwrap.TextWrapper(width, subsequent_indent="    ", break_on_hyphens=False)
    return "\n".join([shown.to_string(index=False), "", *(wrap.fill(f"[{n}] {r}") for r, n in notes.items())])


def problem_trials(study: optuna.Study) -> pd.DataFrame:
    """The trial logs of every study in ``study``'s storage that tuned its problem, ``study``
    among them, all environments: one problem's configs on every architecture it was
    compiled or measured for (the report sets them side by side)."""
    storage, problem = study._storage, study.user_attrs.get("problem")
    if problem is None:  # a study of no recorded problem: itself alone
        return trials_frame(study)
    names = [s.study_name for s in storage.get_all_studies() if s.user_attrs.get("problem") == problem]
    frames = [trials_frame(optuna.load_study(study_name=name, storage=storage)) for name in names]
    return pd.concat(frames, ignore_index=True)


def save_frame(frame: pd.DataFrame, stem: Path) -> list[Path]:
    """Write ``stem``.csv, and ``stem``.parquet where pyarrow is installed, each atomically
    (workers of one study rewrite them at once); return the paths."""
    paths = [stem.with_suffix(".csv")]
    with replacing(paths[0]) as tmp:
        frame.to_csv(tmp, index=False)
    try:
        with replacing(stem.with_suffix(".parquet")) as tmp:
            frame.to_parquet(tmp, index=False)
        paths.append(stem.with_suffix(".parquet"))
    except ImportError:
        pass  # the CSV holds the same rows
    return paths


def compare(frame: pd.DataFrame, yardstick: pd.DataFrame, *, within: float = 0.05) -> dict[str, Any]:
    """How a study did against a yardstick study (the exhaustive grid) of the same problem.

    Both frames come from ``trials_frame`` of GPU studies. Returns each side's best median
    latency and GPU evaluations, the ratio of the bests, and after how many of its GPU
    evaluations the study first came within ``within`` of the yardstick's best.
    """

    def best(f: pd.DataFrame) -> pd.Series:
        ok = f[f.feasible & f.median_ms.notna()]
        if ok.empty:
            raise LookupError("a study has no feasible, timed trial")
        return ok.loc[ok.median_ms.idxmin()]

    mine, theirs = best(frame), best(yardstick)
    evaluated = frame[frame.gpu_evaluated].sort_values("number")
    close = evaluated.median_ms.le(theirs.median_ms * (1 + within)) & evaluated.feasible
    return {
        "best_ms": float(mine.median_ms),
        "best_config": {k: _plain(mine[k]) for k in PARAMS},
        "gpu_evaluations": int(frame.gpu_evaluated.sum()),
        "yardstick_best_ms": float(theirs.median_ms),
        "yardstick_best_config": {k: _plain(theirs[k]) for k in PARAMS},
        "yardstick_gpu_evaluations": int(yardstick.gpu_evaluated.sum()),
        "best_over_yardstick": float(mine.median_ms / theirs.median_ms),
        f"gpu_evaluations_to_within_{within:g}": int(close.to_numpy().argmax()) + 1 if close.any() else None,
    }


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def enqueue(study: optuna.Study, configs: list[KernelConfig], env_key: str) -> None:
    """Queue ``configs`` unless a trial in this environment, or one still queued, has them
    already (an interrupted one does not count: a config only ever interrupted is queued
    again). A worker on another GPU or architecture joining a study queues them for itself."""
    trials = [
        t
        for t in study.get_trials(deepcopy=False)
        if t.state == TrialState.WAITING or t.user_attrs.get("env_key", env_key) == env_key
    ]
    seen = [trial_params(t) for t in trials if not interrupted(t)]
    for t in trials:  # interrupted configs with no other trial (e.g. a study from before requeuing)
        if interrupted(t) and t.params and t.params not in seen:
            study.enqueue_trial(t.params, user_attrs={"requeued_from": t.number})
            seen.append(t.params)
    for config in configs:
        if config.to_dict() not in seen:
            study.enqueue_trial(config.to_dict(), user_attrs={"baseline": config == SEED_CONFIG})
            seen.append(config.to_dict())
