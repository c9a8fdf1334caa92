"""Many workers, one study: three compile-only ``run`` processes share a study on a real
PostgreSQL server and on a journal file. No config is compiled twice, none is lost, and a
worker killed with -9 mid-trial has its trial failed by the survivors' heartbeat check and
its config measured again by a survivor."""

import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import optuna
import pandas
import pytest
from helpers import as_at_a_terminal, child_env
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

from tuner.storage import get_storage
from tuner.trials import trial_config

TINY = ["--batch", "1", "--heads", "2", "--seqlen", "256", "--dk", "64", "--dv", "64"]
MEASURED = ("ok", "infeasible", "compile_failed")  # outcomes that took a compile


def _worker(storage: str, tmp: Path, n_trials: int, cache: Path | None = None) -> subprocess.Popen:
    env = child_env()
    if cache is not None:
        env["TILELANG_CACHE_DIR"] = str(cache)
    # --worker: as `run --gpus` starts them, leaving the export to a parent (a worker may end
    # before the study has a feasible config, which is no failure of the worker).
    argv = ["run", "--worker", *TINY, "--storage", storage, "--study", "w", "--workers", "1", "--no-progress"]
    argv += ["--n-trials", str(n_trials), "--heartbeat", "1", "--grace", "4"]
    return subprocess.Popen(
        [sys.executable, "-m", "tuner", *argv],
        cwd=tmp,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=as_at_a_terminal,
    )


def _study(backend: BaseStorage) -> optuna.Study | None:
    """The study, read through one storage object per test: opening one per poll would leave a
    connection pool per poll on the PostgreSQL server (100 clients at most)."""
    try:
        return optuna.load_study(study_name="w", storage=backend)
    except KeyError:
        return None


def _measured(trials: list[FrozenTrial], like: FrozenTrial | None = None) -> list[FrozenTrial]:
    """The trials that compiled their config (not copies of another's), of ``like``'s config if given."""
    return [
        t
        for t in trials
        if t.user_attrs.get("status") in MEASURED
        and "cached_from" not in t.user_attrs
        and (like is None or trial_config(t) == trial_config(like))
    ]


@pytest.mark.parametrize("kind", ["journal", "postgres"])
def test_three_workers_share_a_study_and_survive_a_kill_9(kind, tmp_path, request):
    storage = request.getfixturevalue("postgres") if kind == "postgres" else f"journal:{tmp_path / 'j.log'}"
    backend = get_storage(storage)
    if kind == "postgres":  # one study name per test on the shared server
        for name in optuna.get_all_study_names(backend):
            optuna.delete_study(study_name=name, storage=backend)
    # The victim compiles with a cold cache, so its trials stay in flight for seconds.
    victim = _worker(storage, tmp_path, 10, cache=tmp_path / "cold-cache")
    # The survivors run until the test has seen the killed config measured again, then are
    # stopped with Ctrl-C: a fixed trial count raced the grace period (warm caches measure
    # eight trials in less than the 4 s a heartbeat takes to go stale).
    survivors = [_worker(storage, tmp_path, 1000) for _ in range(2)]
    killed = None
    deadline = time.monotonic() + 300
    while killed is None and time.monotonic() < deadline and victim.poll() is None:
        study = _study(backend)
        trials = study.get_trials() if study else []
        # Kill once the survivors run trials (past their start-up check of dead pids), so only
        # their heartbeat check can find the dead trial.
        if {p.pid for p in survivors} <= {t.user_attrs.get("pid") for t in trials}:
            for t in trials:
                running = t.state == TrialState.RUNNING and "claim_attempt" in t.user_attrs
                if running and t.user_attrs.get("pid") == victim.pid:
                    killed = t
        time.sleep(0.1)
    assert killed is not None, "the victim ended before it claimed a config"
    os.killpg(victim.pid, signal.SIGKILL)  # the worker and its compile process, mid-trial
    victim.wait()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and all(p.poll() is None for p in survivors):
        if _measured(_study(backend).get_trials(), killed):
            break
        time.sleep(0.2)
    for proc in survivors:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 130 and "interrupted: finished trials are kept" in err, err[-2000:]

    study = _study(backend)
    trials = study.get_trials()
    assert not [t for t in trials if t.state == TrialState.RUNNING]  # none left in flight
    # The killed trial was failed by a survivor's heartbeat check (no pid check ran after the kill).
    dead = study._storage.get_trial(killed._trial_id)
    assert dead.state == TrialState.FAIL and "died mid-trial" not in dead.user_attrs.get("reason", "")
    # No config compiled twice in this environment; every other trial of it copied the owner.
    measured = _measured(trials)
    twice = [c for c, n in Counter(trial_config(t) for t in measured).items() if n > 1]
    assert not twice, twice
    # The killed config was measured again, by a survivor.
    again = _measured(trials, killed)
    assert again and again[0].user_attrs["pid"] in {p.pid for p in survivors}
    assert again[0].user_attrs["claim_attempt"] >= 1
    # None lost: every interrupted config was measured or refused untried (a Ctrl-C may fall
    # between a trial's ask and its refusal), or waits in the queue for the next run.
    told = [*measured, *(t for t in trials if t.user_attrs.get("status") == "restricted")]
    for t in trials:
        if t.state == TrialState.FAIL and t.user_attrs.get("status", "interrupted") == "interrupted":
            assert any(
                trial_config(u) == trial_config(t) and (u in told or u.state == TrialState.WAITING)
                for u in trials
            ), t.number


def test_ctrl_c_then_resume_measures_the_interrupted_configs(tmp_path):
    """Ctrl-C at a terminal (SIGINT to the run and its compile processes) mid-compile: the
    run fails its trial in flight and queues its config; the next run measures it."""
    storage = f"journal:{tmp_path / 'j.log'}"
    backend = get_storage(storage)
    run = _worker(storage, tmp_path, 8, cache=tmp_path / "cold-cache")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and run.poll() is None:
        study = _study(backend)
        # A trial compiling for over a second (a cold compile takes several; a refusal, less).
        if study and any(
            t.state == TrialState.RUNNING
            and "claim_attempt" in t.user_attrs
            and (datetime.datetime.now() - t.datetime_start).total_seconds() > 1
            for t in study.get_trials()
        ):
            break
        time.sleep(0.1)
    os.killpg(run.pid, signal.SIGINT)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 130 and "interrupted: finished trials are kept" in err, err[-2000:]

    trials = _study(backend).get_trials()
    stopped = [t for t in trials if t.user_attrs.get("status") == "interrupted"]
    queued = [t for t in trials if t.state == TrialState.WAITING]
    assert stopped and not [t for t in trials if t.state == TrialState.RUNNING]
    resume = _worker(storage, tmp_path, len(queued))
    _, err = resume.communicate(timeout=600)
    assert resume.returncode == 0, err[-2000:]

    trials = _study(backend).get_trials()
    for t in stopped:
        again = [u for u in trials if u.params == t.params and u.number > t.number]
        assert any(u.user_attrs.get("status") in MEASURED for u in again), t.params


def test_a_sigterm_stops_as_a_ctrl_c_does_and_says_so(tmp_path, studies_dir):
    """``kill`` (a scheduler's, ``timeout``'s) to the run alone, mid-compile: it stops where
    a Ctrl-C would, in one line, exit 143, no trial left running, its trial log written."""
    storage = f"journal:{tmp_path / 'j.log'}"
    backend = get_storage(storage)
    run = _worker(storage, tmp_path, 8, cache=tmp_path / "cold-cache")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and run.poll() is None and not _compiling(backend):
        time.sleep(0.1)
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 143 and "Traceback" not in err, err[-2000:]
    assert (
        err.splitlines()[-1]
        == "terminated: finished trials are kept in the study; run the same command to go on"
    )
    assert not [t for t in _study(backend).get_trials() if t.state == TrialState.RUNNING]
    (log,) = studies_dir.glob("**/w/trials.csv")  # the folder of the study of that storage
    assert len(pandas.read_csv(log)) == len(_study(backend).get_trials())


def _compiling(backend: BaseStorage) -> bool:
    """Whether a trial has been compiling for over a second (a cold compile takes several)."""
    study = _study(backend)
    return bool(study) and any(
        t.state == TrialState.RUNNING
        and "claim_attempt" in t.user_attrs
        and (datetime.datetime.now() - t.datetime_start).total_seconds() > 1
        for t in study.get_trials()
    )


def test_ctrl_c_says_what_it_waits_for_and_twice_stops_in_one_line(tmp_path):
    """The first Ctrl-C says at once which compiles it waits for; the second stops them
    with one more line and no traceback, leaving the trials in flight failed and queued again."""
    storage = f"journal:{tmp_path / 'j.log'}"
    backend = get_storage(storage)
    run = _worker(storage, tmp_path, 8, cache=tmp_path / "cold-cache")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(run.stderr.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and run.poll() is None and not _compiling(backend):
        time.sleep(0.1)
    os.killpg(run.pid, signal.SIGINT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any("waiting for" in line for line in lines):
        time.sleep(0.05)
    (waiting,) = [i for i, line in enumerate(lines) if "waiting for" in line]
    assert lines[waiting].startswith("interrupted: waiting for 1 compile in flight to finish (Ctrl-C again")
    os.killpg(run.pid, signal.SIGINT)
    assert run.wait(timeout=30) == 130
    reader.join(10)
    assert "Traceback" not in "".join(lines)
    assert len(lines) == waiting + 2 and "interrupted: finished trials are kept" in lines[-1], lines

    trials = _study(backend).get_trials()
    stopped = [t for t in trials if t.user_attrs.get("status") == "interrupted"]
    assert stopped and not [t for t in trials if t.state == TrialState.RUNNING]
    assert all(t.state == TrialState.FAIL for t in stopped)
    queued = [t.user_attrs.get("requeued_from") for t in trials if t.state == TrialState.WAITING]
    assert all(t.number in queued for t in stopped)
