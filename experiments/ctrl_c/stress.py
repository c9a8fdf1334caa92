"""Ctrl-C a compile-only `run` worker at random moments, as a terminal does (SIGINT to its
process group; a second one 0 to 0.5 s later in 30 % of the runs), and count the runs that
did not stop cleanly: an exit code other than 130, a trial left RUNNING, a traceback on
stderr (raised or "Exception ignored"), or no exit within 60 s (then its threads' stacks
are printed).

    python3 experiments/ctrl_c/stress.py REPO {postgres,journal} N [SEED]

REPO is the checkout whose `python -m tuner` runs (a worktree of another commit compares
them); the storage is a PostgreSQL server of its own (Debian's binaries) or a journal file.
"""

import glob
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
from optuna.trial import TrialState

TINY = ["--batch", "1", "--heads", "2", "--seqlen", "256", "--dk", "64", "--dv", "64"]


def main(repo: Path, kind: str, n: int, seed: int) -> None:
    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp())
    stop_server = lambda: None  # noqa: E731
    if kind == "postgres":
        data = Path(tempfile.mkdtemp(prefix="pg-")) / "data"
        shutil.chown(data.parent, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        bindir = Path(sorted(glob.glob("/usr/lib/postgresql/*/bin"))[-1])
        port = 55432
        run = lambda *cmd: subprocess.run([*as_user, *map(str, cmd)], check=True, capture_output=True)  # noqa: E731
        run(bindir / "initdb", "-D", data, "-A", "trust", "-U", "postgres")
        opts = f"-p {port} -k {data.parent} -c listen_addresses=127.0.0.1"
        run(bindir / "pg_ctl", "-D", data, "-o", opts, "-l", data.parent / "log", "-w", "start")
        stop_server = lambda: run(bindir / "pg_ctl", "-D", data, "-m", "immediate", "stop")  # noqa: E731
        storage = f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres"
        backend = optuna.storages.RDBStorage(storage)
    else:
        storage = str(tmp / "j.log")
        backend = None
    env = os.environ | {"PYTHONPATH": str(repo), "PYTHONFAULTHANDLER": "1"}
    bad = 0
    for i in range(n):
        argv = ["run", "--worker", *TINY, "--storage", storage, "--study", f"s{i % 3}", "--workers", "1"]
        argv += ["--no-progress", "--n-trials", "1000", "--heartbeat", "1", "--grace", "4"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "tuner", *argv],
            cwd=tmp,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's job
        )
        time.sleep(rng.uniform(4, 9))
        os.killpg(proc.pid, signal.SIGINT)
        twice = rng.random() < 0.3
        if twice:
            time.sleep(rng.uniform(0, 0.5))
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate()
            print(f"run {i}: no exit in 60 s\n{err[-5000:]}", flush=True)
            bad += 1
            continue
        where = backend or optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(storage))
        trials = optuna.load_study(study_name=f"s{i % 3}", storage=where).get_trials()
        running = [t.number for t in trials if t.state == TrialState.RUNNING]
        lines = err.strip().splitlines()
        traceback = "Traceback (most recent call last)" in err
        clean = proc.returncode == 130 and not running and not traceback
        bad += not clean
        print(
            f"run {i}: Ctrl-C x{1 + twice}, exit {proc.returncode}, {len(lines)} lines, running {running}",
            "" if clean else "\n  " + "\n  ".join(lines[-30:]),
            flush=True,
        )
    print(f"{bad} of {n} runs did not stop cleanly")
    stop_server()


if __name__ == "__main__":
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    main(Path(sys.argv[1]).resolve(), sys.argv[2], int(sys.argv[3]), seed)
