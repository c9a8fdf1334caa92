"""A study's results as the files a deployment loads: the best-config file
(``kernel.ops.deploy``) and the dispatch table (``kernel.ops.dispatch``)."""

from pathlib import Path
from typing import Any

import optuna

from kernel import formats
from kernel.environment import DECODE_KERNEL, GATED_KERNEL
from kernel.files import write_json
from kernel.ops.deploy import FORMAT, VERSION
from kernel.ops.dispatch import DISPATCH_FORMAT, DISPATCH_VERSION
from kernel.trial_schema import FLOOR, PREDICTED, TIMES
from tuner.trials import best_trials, trial_config


def export_best(study: optuna.Study, path: Path, *, env: str | None = None, top: int = 5) -> dict[str, Any]:
    """Write the versioned best-config JSON (``kernel.ops.deploy``) for ``study``, of the trials
    measured in environment ``env`` (``tuner.trials.choose_env``; None: all); return it."""
    best = best_trials(study, env)
    if not best:
        raise LookupError(f"study {study.study_name!r} has no feasible, correct trial{_in(env)} to export")
    first, record = best[0].user_attrs, _record(study)
    data = {
        "format": FORMAT,
        "version": VERSION,
        "study": study.study_name,
        "problem": record["problem"],
        "sweep": record["sweep"],
        "mode": study.user_attrs.get("mode"),
        "objectives": study.user_attrs.get("objectives"),
        "environment": first.get("environment"),
        "configs": [
            {
                "config": trial_config(t).to_dict(),
                "trial": t.number,
                **{
                    k: t.user_attrs.get(k)
                    for k in (*TIMES, "rel_l2", "spill_bytes", "smem_bytes", "registers", *PREDICTED)
                },
                **{k: t.user_attrs[k] for k in FLOOR if k in t.user_attrs},  # a decode trial's
            }
            for t in best[:top]
        ],
    }
    write_json(path, data)
    return data


def export_dispatch(
    studies: list[optuna.Study],
    path: Path,
    *,
    env: str | None = None,
    decode_env: str | None = None,
    gated_env: str | None = None,
) -> dict[str, Any]:
    """Write the dispatch table (``kernel.ops.dispatch.Dispatch``): the best config of each
    study measured in environment ``env`` (None: any), one entry per tuned shape (its
    ``sweep``: "forward", or "dkdv" for a study of the backward's fused pass); of each
    per-token gate's study (``run --gate token``) measured in ``gated_env``, with the gated
    kernel's code key (``kernel.environment.GATED_KERNEL``); and of each decode study
    (``run --sweep decode``) measured in ``decode_env``, one entry per number of sequences,
    with the decode kernel's code key (``kernel.environment.DECODE_KERNEL``). All studies
    must be GPU studies measured in one environment (those code keys aside); a study with
    no feasible trial is a ``LookupError``."""
    entries, environments = [], []
    for study in studies:
        record = _record(study)
        decode = record["sweep"] == "decode"
        gated = not decode and record["problem"].get("gate") == "token"
        wanted = decode_env if decode else gated_env if gated else env
        best = best_trials(study, wanted)
        if not best:
            raise LookupError(
                f"study {study.study_name!r} has no feasible, correct trial{_in(wanted)} to export"
            )
        if study.user_attrs.get("mode") != "gpu":
            raise LookupError(
                f"study {study.study_name!r} timed nothing (compile-only): no latency to rank by"
            )
        t = best[0]
        measured_in = dict(t.user_attrs.get("environment") or {})
        key = DECODE_KERNEL if decode else GATED_KERNEL if gated else None
        code = {key: measured_in.pop(key, None)} if key else {}
        environments.append(measured_in)
        entries.append(
            {
                "problem": record["problem"],
                "config": trial_config(t).to_dict(),
                "sweep": record["sweep"],
                "study": study.study_name,
                "trial": t.number,
                **{k: t.user_attrs.get(k) for k in (*TIMES, "rel_l2")},
                **{k: t.user_attrs[k] for k in FLOOR if decode and k in t.user_attrs},
                **code,
            }
        )
    if any(env != environments[0] for env in environments):
        raise LookupError("the studies were measured in different environments; tune them on one machine")
    data = {
        "format": DISPATCH_FORMAT,
        "version": DISPATCH_VERSION,
        "environment": environments[0],
        "entries": entries,
    }
    write_json(path, data)
    return data


def _in(env: str | None) -> str:
    return "" if env is None else f" in environment {env}"


def _record(study: optuna.Study) -> dict[str, Any]:
    """The study's record in the current version (``kernel.formats.study_record``): a study
    with a trial to export has trials."""
    return formats.study_record(study.user_attrs, name=study.study_name, has_trials=lambda: True)
