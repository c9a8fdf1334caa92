"""The trials a dead or stopped worker left running, found and queued again.

Several ``run`` processes (workers) share one study through its storage. A dead worker's
trials are found through heartbeats: each worker records one per live trial every
``heartbeat_s`` seconds (``record_heartbeat`` on an RDB, a trial system attribute on the
other storages), and any worker fails a trial whose heartbeat is older than ``grace_s``,
then queues its config again (``fail_stale``).
"""

import os
import socket
import time
import warnings

import optuna
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

# The trial system attribute holding a worker's last heartbeat (seconds since the epoch) on
# storages without Optuna's heartbeat table (the journal, the gRPC proxy).
HEARTBEAT_ATTR = "decay_tuner:heartbeat"


def record_heartbeat(storage: BaseStorage, trial_id: int) -> None:
    """One heartbeat of a live trial (Optuna's where the storage has it, else an attribute)."""
    if optuna.storages._heartbeat.is_heartbeat_enabled(storage):
        storage.record_heartbeat(trial_id)  # type: ignore[attr-defined]
    else:
        storage.set_trial_system_attr(trial_id, HEARTBEAT_ATTR, time.time())


def requeue(study: optuna.Study, trial: FrozenTrial) -> None:
    """Queue the config of an interrupted trial again, so a live worker measures it."""
    if trial.params:
        study.enqueue_trial(
            trial.params,
            user_attrs={"requeued_from": trial.number, "baseline": trial.user_attrs.get("baseline", False)},
        )


def interrupt(study: optuna.Study, trial: FrozenTrial, reason: str) -> bool:
    """Fail a trial whose worker died or stopped and queue its config again; False when
    another worker got there first (then that one queues it)."""
    storage = study._storage
    try:
        storage.set_trial_user_attr(trial._trial_id, "status", "interrupted")
        storage.set_trial_user_attr(trial._trial_id, "reason", reason)
        if not storage.set_trial_state_values(trial._trial_id, TrialState.FAIL):
            return False
    except optuna.exceptions.UpdateFinishedTrialError:
        return False
    requeue(study, trial)
    return True


def fail_stale(study: optuna.Study, grace_s: float) -> int:
    """Fail the RUNNING trials of workers that stopped sending heartbeats (on any host) and
    queue their configs again; return how many this call failed."""
    storage = study._storage
    if optuna.storages._heartbeat.is_heartbeat_enabled(storage):
        before = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))}
        with warnings.catch_warnings():  # experimental in Optuna 5.0
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)  # Optuna's: atomic, the callback requeues
        count = len(
            [t for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)) if t.number not in before]
        )
    else:
        now, count, stale = time.time(), 0, _stale_ids(study, grace_s)
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if t._trial_id in stale:
                beat = t.system_attrs[HEARTBEAT_ATTR]
                count += interrupt(study, t, f"no heartbeat for {now - beat:.0f} s: its worker died")
    return count + _fail_unowned(study, grace_s)


def _unowned(study: optuna.Study, grace_s: float) -> list[FrozenTrial]:
    """The RUNNING trials no worker recorded itself on (``pid``) within ``grace_s`` of their
    start: a worker killed between Optuna's ask and its first write, so no heartbeat of
    theirs can go stale. A live worker records itself within milliseconds, unless the
    storage stalls past the grace (a stale journal lock): it then asks anew (``tuner.tuner``)."""
    now = time.time()
    return [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if "pid" not in t.user_attrs and t.datetime_start and now - t.datetime_start.timestamp() > grace_s
    ]


def _fail_unowned(study: optuna.Study, grace_s: float) -> int:
    return sum(
        interrupt(study, t, f"no worker recorded itself on it in {grace_s} s: its worker died as it asked")
        for t in _unowned(study, grace_s)
    )


def _stale_ids(study: optuna.Study, grace_s: float) -> set[int]:
    """Ids of the RUNNING trials whose heartbeat is older than ``grace_s`` (the storage's own
    grace period where it keeps Optuna's heartbeats)."""
    storage = study._storage
    if optuna.storages._heartbeat.is_heartbeat_enabled(storage):
        return set(storage._get_stale_trial_ids(study._study_id))  # type: ignore[attr-defined]
    now = time.time()
    return {
        t._trial_id
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if now - t.system_attrs.get(HEARTBEAT_ATTR, now) > grace_s
    }


def unfinished_summary(study: optuna.Study, grace_s: float) -> str:
    """The study's unfinished trials counted apart, e.g. "2 queued for the next run, 1
    running in another worker, 1 left by a dead worker" (dead: its process is gone from
    this host, or its heartbeat is older than ``grace_s``); empty when every trial is finished."""
    host = socket.gethostname()
    stale = _stale_ids(study, grace_s) | {t._trial_id for t in _unowned(study, grace_s)}
    queued = running = dead = 0
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.WAITING:
            queued += 1
        elif t.state == TrialState.RUNNING:
            if t._trial_id in stale or _died_here(t, host):
                dead += 1
            else:
                running += 1
    counts = (
        (queued, "queued for the next run"),
        (running, "running in another worker"),
        (dead, "left by a dead worker"),
    )
    return ", ".join(f"{n} {what}" for n, what in counts if n)


def fail_interrupted(study: optuna.Study) -> int:
    """Fail this host's trials left RUNNING by a dead process (found at once by pid, before
    any heartbeat goes stale) and queue their configs again; return how many."""
    host = socket.gethostname()
    count = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if _died_here(t, host):
            count += interrupt(study, t, f"process {t.user_attrs['pid']} died mid-trial")
    return count


def _died_here(trial: FrozenTrial, host: str) -> bool:
    """Whether ``trial`` ran in a process of ``host`` that is gone."""
    pid = trial.user_attrs.get("pid")
    return trial.user_attrs.get("host") == host and pid is not None and not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
