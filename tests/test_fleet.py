"""tuner.fleet and ``--gpus``: local workers as real child processes on one journal study
(compile-only here: a child told ``CUDA_VISIBLE_DEVICES=N`` on this machine sees no GPU).
Their output arrives as whole prefixed lines, a killed child is reported in one line while
the other goes on, and Ctrl-C stops every child with its trials in flight queued again."""

import os
import signal
import subprocess
import sys
import threading
import time

import optuna
import pytest
from helpers import as_at_a_terminal, child_env
from optuna.trial import TrialState

from kernel import KernelConfig, Problem
from tuner.cli import build_parser, main
from tuner.commands.args import options_of, problem_of
from tuner.fleet import Job, run_argv, run_jobs
from tuner.options import Options
from tuner.storage import get_storage

TINY = Problem(1, 2, 256, 64, 64)


def _job(label: str, storage: str, n_trials: int) -> Job:
    """A worker as ``--gpus`` starts it (``tuner.fleet.run_argv``), on a problem that compiles fast."""
    opts = Options(n_trials=n_trials, workers=1, progress=False, heartbeat_s=1, grace_s=4)
    return Job(label, run_argv(TINY, opts, "w", storage))


def _trials(storage: str) -> list[optuna.trial.FrozenTrial]:
    try:
        return optuna.load_study(study_name="w", storage=get_storage(storage)).get_trials()
    except KeyError:
        return []


def _running_pids(storage: str) -> set[int]:
    """The pids of the workers with a claimed trial in flight."""
    return {
        t.user_attrs["pid"]
        for t in _trials(storage)
        if t.state == TrialState.RUNNING and "claim_attempt" in t.user_attrs
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def cold(tmp_path, monkeypatch):
    """Studies and a cold TileLang cache of this test's own (the children inherit them), so
    trials stay in flight for seconds."""
    monkeypatch.setenv("DECAY_TUNER_STUDIES", str(tmp_path / "studies"))
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", child_env()["PYTHONPATH"])
    monkeypatch.chdir(tmp_path)
    return f"journal:{tmp_path / 'j.log'}"


def test_a_killed_worker_is_one_line_and_the_other_goes_on(cold, tmp_path, capsys):
    killed: list[int] = []

    def kill_one() -> None:  # the first worker seen with a trial in flight, its compiles too
        deadline = time.monotonic() + 300
        while not killed and time.monotonic() < deadline:
            for pid in _running_pids(cold):
                os.killpg(pid, signal.SIGKILL)
                killed.append(pid)
                break
            time.sleep(0.1)

    killer = threading.Thread(target=kill_one)
    killer.start()
    outcomes = run_jobs([_job("a", cold, 4), _job("b", cold, 4)], [0, 1], log_dir=tmp_path / "logs")
    killer.join()
    out, err = capsys.readouterr()

    assert killed, "no worker ever had a trial in flight"
    assert sorted(o.returncode for o in outcomes) == [-signal.SIGKILL, 0]
    (dead,) = [o for o in outcomes if o.returncode != 0]
    failed = [line for line in err.splitlines() if "] failed (" in line]
    assert len(failed) == 1 and failed[0].startswith(
        f"[gpu{dead.gpu} {dead.job.label}] failed (killed by SIGKILL)"
    )
    # Whole lines only, each with its worker's prefix; the survivor finished its run.
    lines = out.splitlines() + [line for line in err.splitlines() if line not in failed]
    assert lines and all(line.startswith(("[gpu0 a] ", "[gpu1 b] ")) for line in lines), lines
    assert any("study 'w':" in line for line in out.splitlines())
    assert "Traceback" not in out + err
    for o in outcomes:
        log = tmp_path / "logs" / f"{o.job.label}.gpu{o.gpu}.log"
        assert log.read_text().startswith(f"$ CUDA_VISIBLE_DEVICES={o.gpu} python -m tuner run")


def test_ctrl_c_stops_every_worker_and_queues_their_trials_again(cold, tmp_path):
    script = (
        "import sys\nfrom pathlib import Path\nfrom tuner.fleet import Job, run_jobs\n"
        "jobs = [Job(label, tuple(sys.argv[2:])) for label in ('a', 'b')]\n"
        "try:\n    run_jobs(jobs, [0, 1], log_dir=Path(sys.argv[1]))\n"
        "except KeyboardInterrupt:\n    sys.exit(130)\n"
    )
    argv = _job("x", cold, 20).argv
    parent = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "logs"), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=as_at_a_terminal,
    )
    deadline = time.monotonic() + 300
    while len(_running_pids(cold)) < 2 and time.monotonic() < deadline and parent.poll() is None:
        time.sleep(0.1)
    children = {t.user_attrs["pid"] for t in _trials(cold) if "pid" in t.user_attrs}  # not queued ones
    assert len(children) == 2, "the two workers never both had a trial in flight"
    parent.send_signal(signal.SIGINT)  # as Ctrl-C would: to the parent, which passes it on
    _, err = parent.communicate(timeout=120)

    assert parent.returncode == 130, err[-2000:]
    assert "stopping 2 worker(s)" in err
    assert not any(_alive(pid) for pid in children)
    trials = _trials(cold)
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    stopped = [t for t in trials if t.user_attrs.get("status") == "interrupted"]
    assert {t.user_attrs["pid"] for t in stopped} == children  # each worker failed its own
    queued = [t.system_attrs.get("fixed_params") for t in trials if t.state == TrialState.WAITING]
    assert all(t.params in queued for t in stopped)  # ... and queued its configs again


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "--gpus", "x"], "--gpus wants GPU indices"),
        (["run", "--gpus", "0,", "--storage", "journal:{}/j.log"], "--gpus wants GPU indices"),
        (["run", "--gpus", "1,1", "--storage", "journal:{}/j.log"], "--gpus lists a GPU twice"),
        (["run", "--gpus", "0,1"], "SQLite serves one process at a time"),
        (["run", "--gpus", "0,1", "--storage", "sqlite:///{}/db.sqlite"], "SQLite serves one process"),
        (["dispatch", "--gpus", "0,1", "--shapes", "1x2x256,2x2x256"], "SQLite serves one process"),
        (["run", "--gpus", "0", "--storage", "journal:{}/j.log"], "torch sees no CUDA device"),
        (["run", "--gpus", "all", "--storage", "journal:{}/j.log"], "torch sees no CUDA device"),
        (["dispatch", "--gpus", "0,1", "--storage", "journal:{}/j.log"], "torch sees no CUDA device"),
    ],
)
def test_gpus_mistakes_exit_2_with_one_line_and_write_nothing(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("tuner.cli.STUDIES_DIR", tmp_path / "studies")
    monkeypatch.setattr("tuner.options.STUDIES_DIR", tmp_path / "studies")
    assert main([a.replace("{}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_one_gpu_may_use_sqlite(tmp_path, capsys):
    """One worker needs no shared storage: only the CUDA check refuses it here."""
    assert main(["run", "--gpus", "0", "--storage", f"sqlite:///{tmp_path / 'db'}"]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err


def test_workers_run_the_options_they_were_given():
    """A worker's command line carries the problem and every option that is not the default."""
    problem = Problem(2, 4, 512, 64, 128, "bfloat16")
    opts = Options(
        n_trials=3, sampler="nsga2", wave_seeds=False, seed=7, enqueue=(KernelConfig(64, 64, 1, 128),)
    )
    args = build_parser().parse_args(list(run_argv(problem, opts, "s", "journal:j.log")))
    assert problem_of(args) == problem and options_of(args) == opts and args.study == "s"
