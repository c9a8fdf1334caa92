"""Atomic claims: no two workers compile or measure one config in one environment.

A worker claims a config before it compiles it by creating a tiny study named
``<study>/claim/<env_key>/<config label>/<attempt>`` with ``create_new_study``, which is
atomic on every Optuna storage (an RDB's unique constraint on study names; the journal
replays one ordered log, so the first CREATE_STUDY wins). ``DuplicatedStudyError`` means
another trial owns the config; the claim study's user attribute ``trial`` names that owner
(the trial's number in the study). An owner that was interrupted (its worker died: see
``tuner.liveness.fail_stale``; or it was stopped) gives the config up: the next claimer
takes attempt + 1. An owner that finished, or is still running, keeps it: the other trials
of that config copy its outcome (``cached_from``) instead of compiling it again.

The same primitive numbers the workers of a study (``worker_index``): the n-th worker to
open it creates ``<study>/claim/workers/<n>``, and offsets its sampler's seed by n, so
workers started with one ``--seed`` do not propose the same configs.

The one gap: a worker that dies between creating the claim and naming its owner (two
storage calls) leaves a claim with no owner; a waiter treats such a claim as dead once it
has stayed ownerless for the grace period.
"""

import time
from dataclasses import dataclass

import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from kernel.config import KernelConfig
from tuner.studies import CLAIM_MARK


def claim_name(study: str, env_key: str, config: KernelConfig, attempt: int) -> str:
    return f"{study}{CLAIM_MARK}{env_key}/{config.label}/{attempt}"


def worker_index(study: optuna.Study) -> int:
    """This worker's number on ``study``: 0 for the first worker ever to open it, then 1, 2..."""
    index = 0
    while True:
        try:
            study._storage.create_new_study(
                [StudyDirection.MINIMIZE], f"{study.study_name}{CLAIM_MARK}workers/{index}"
            )
            return index
        except optuna.exceptions.DuplicatedStudyError:
            index += 1


@dataclass(frozen=True)
class Claimed:
    """The config is this trial's to compile and measure."""

    attempt: int


@dataclass(frozen=True)
class Owned:
    """Another trial owns the config: ``owner`` (None while its owner is not yet named)."""

    attempt: int
    owner: FrozenTrial | None

    @property
    def finished(self) -> bool:
        return self.owner is not None and self.owner.state.is_finished()


def interrupted(trial: FrozenTrial) -> bool:
    """Failed because its worker died or stopped, not because of the config."""
    return trial.state == TrialState.FAIL and trial.user_attrs.get("status", "interrupted") == "interrupted"


class Claims:
    """The claims of one worker on ``study`` for environment ``env_key``."""

    def __init__(self, study: optuna.Study, env_key: str, grace_s: float) -> None:
        self.study, self.env_key, self.grace_s = study, env_key, grace_s
        self._ownerless_since: dict[str, float] = {}

    def claim(self, config: KernelConfig, trial_number: int) -> Claimed | Owned:
        """Claim ``config`` for trial ``trial_number``, or say who owns it."""
        storage = self.study._storage
        attempt = 0
        while True:
            name = claim_name(self.study.study_name, self.env_key, config, attempt)
            try:
                claim_id = storage.create_new_study([StudyDirection.MINIMIZE], name)
            except optuna.exceptions.DuplicatedStudyError:
                owner = self._owner(name)
                if owner is None and not self._ownerless_too_long(name):
                    return Owned(attempt, None)
                if owner is None or (interrupted(owner) and owner.number != trial_number):
                    attempt += 1  # a dead claim: take the next attempt
                    continue
                if owner.number == trial_number:
                    return Claimed(attempt)
                return Owned(attempt, owner)
            storage.set_study_user_attr(claim_id, "trial", trial_number)
            return Claimed(attempt)

    def _owner(self, name: str) -> FrozenTrial | None:
        storage = self.study._storage
        number = storage.get_study_user_attrs(storage.get_study_id_from_name(name)).get("trial")
        if number is None:
            return None
        trial_id = storage.get_trial_id_from_study_id_trial_number(self.study._study_id, number)
        return storage.get_trial(trial_id)

    def _ownerless_too_long(self, name: str) -> bool:
        first = self._ownerless_since.setdefault(name, time.monotonic())
        return time.monotonic() - first > self.grace_s
