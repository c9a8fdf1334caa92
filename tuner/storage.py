"""Where studies live: the studies folder, study names, Optuna storages, and the trials a
dead process left running."""

import os
import socket
from pathlib import Path

import optuna
from optuna.trial import TrialState

from kernel.config import Problem
from tuner.options import UsageError


def default_study_name(problem: Problem) -> str:
    p = problem
    return f"b{p.batch}-h{p.heads}-s{p.seqlen}-dk{p.dk}-dv{p.dv}-a{p.alpha:g}-{p.dtype}"


def get_storage(url: str) -> optuna.storages.BaseStorage:
    """Optuna storage for ``url``; a URL that cannot be opened is a ``UsageError``."""
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    try:
        return optuna.storages.get_storage(url)
    except Exception as exc:  # SQLAlchemy and Optuna raise many types for a bad URL
        raise UsageError(
            f"cannot open storage {url!r}: {type(exc).__name__}: {exc}".splitlines()[0]
        ) from None


def open_study(
    problem: Problem,
    *,
    name: str,
    storage: str,
    sampler: optuna.samplers.BaseSampler | None = None,
    directions: list[str] | None = None,
) -> optuna.Study:
    """Create the study, or load it when it exists (resuming a killed run)."""
    try:
        study = optuna.create_study(
            study_name=name,
            storage=get_storage(storage),
            sampler=sampler,
            directions=directions or ["minimize"],
            load_if_exists=True,
        )
    except ValueError as exc:  # e.g. the study exists with other directions
        raise UsageError(f"cannot open study {name!r}: {exc}") from None
    saved = study.user_attrs.get("problem")
    if saved is None:
        study.set_user_attr("problem", problem.to_dict())
    elif saved != problem.to_dict():
        raise UsageError(f"study {name!r} was made for {Problem.from_dict(saved)}, not {problem}")
    return study


def load_study(name: str, storage: str) -> optuna.Study:
    """An existing study; ``UsageError`` naming the study and storage when there is none."""
    try:
        return optuna.load_study(study_name=name, storage=get_storage(storage))
    except KeyError:
        raise UsageError(f"no study {name!r} in {storage}") from None


def fail_interrupted(study: optuna.Study) -> int:
    """Mark this host's trials left RUNNING by a dead process as failed; return how many."""
    host = socket.gethostname()
    count = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        pid, owner = t.user_attrs.get("pid"), t.user_attrs.get("host")
        if owner == host and pid is not None and not _alive(pid):
            study._storage.set_trial_user_attr(t._trial_id, "status", "interrupted")
            study._storage.set_trial_user_attr(t._trial_id, "reason", f"process {pid} died mid-trial")
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            count += 1
    return count


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
