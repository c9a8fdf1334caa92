"""Local workers: ``python -m tuner`` child processes, one per GPU at a time, fed from a
queue of jobs; a study's trials split between them (``run --gpus``), or several studies
handed out whole (``dispatch --gpus``).

Each child sees one GPU (``CUDA_VISIBLE_DEVICES``) and runs in a process group of its own.
Its output is relayed whole line by whole line, prefixed with its GPU and job, so children
never interleave inside a line (a progress bar's redraw is a line: the progress of every
worker shows as it goes); a traceback goes to the child's log file only, and a
child that fails is reported in one line while the others go on. Ctrl-C (or SIGTERM) is
passed on to every child, as a terminal passes it to a lone ``run``, so each fails its
trials in flight and queues their configs again; a second one kills them.
"""

import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kernel.config import Problem
from kernel.processes import Stop, sigterm_stops
from tuner import options
from tuner.options import Options, UsageError

# Seconds the children get to stop after Ctrl-C before they are killed.
STOP_S = 60.0
_GPUS = re.compile(r"all|\d+(,\d+)*")
# The lines that open a Python traceback, or a chained one.
_TRACEBACK = ("Traceback (most recent call last)", "During handling of the above", "The above exception")


def parse_gpus(text: str) -> list[int] | None:
    """'0,1' -> [0, 1]; 'all' -> None (every GPU); ``UsageError`` if malformed."""
    if not _GPUS.fullmatch(text):
        raise UsageError(f"--gpus wants GPU indices such as 0,1 or 'all', got {text!r}")
    if text == "all":
        return None
    gpus = [int(n) for n in text.split(",")]
    if len(set(gpus)) != len(gpus):
        raise UsageError(f"--gpus lists a GPU twice: {text!r}")
    return gpus


def local_gpus(wanted: list[int] | None) -> list[int]:
    """The GPUs to start workers on (``None``: all); ``UsageError`` without CUDA or for a
    GPU this machine does not have."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise UsageError("--gpus starts one worker per GPU, and torch sees no CUDA device here")
    missing = [g for g in wanted or [] if g >= count]
    if missing:
        raise UsageError(f"--gpus {missing[0]}: this machine has {count} GPU(s), 0 to {count - 1}")
    return list(range(count)) if wanted is None else wanted


def gpus_for(text: str, storage: str, jobs: int) -> list[int]:
    """The GPUs of ``--gpus TEXT`` for ``jobs`` jobs; ``UsageError`` for a malformed list, a
    storage that cannot serve that many processes at once, or a machine without CUDA."""
    from tuner.storage import check_shared  # loads Optuna

    wanted = parse_gpus(text)
    if wanted is not None:  # before loading torch: a mistake answers at once
        check_shared(storage, min(len(wanted), jobs))
    gpus = local_gpus(wanted)
    check_shared(storage, min(len(gpus), jobs))
    return gpus


@dataclass(frozen=True)
class Job:
    """One child: ``python -m tuner *argv``, shown as ``label``."""

    label: str
    argv: tuple[str, ...]


@dataclass(frozen=True)
class Outcome:
    job: Job
    gpu: int
    returncode: int
    wall_s: float


class _Child:
    """A running job: its process, its relay threads and its log file."""

    def __init__(self, job: Job, gpu: int, log: Path, lock: threading.Lock) -> None:
        self.job, self.gpu, self.log = job, gpu, log
        self.prefix = f"[gpu{gpu} {job.label}]"
        self.start = time.monotonic()
        self.last_error = ""
        env = os.environ | {"CUDA_VISIBLE_DEVICES": str(gpu), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tuner", *job.argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,  # Ctrl-C reaches it only through ``run_jobs``, once
        )
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = log.open("w")
        self._log.write(f"$ CUDA_VISIBLE_DEVICES={gpu} python -m tuner {' '.join(job.argv)}\n")
        self.threads = [
            threading.Thread(target=self._relay, args=(self.proc.stdout, sys.stdout, lock), daemon=True),
            threading.Thread(target=self._relay, args=(self.proc.stderr, sys.stderr, lock), daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _relay(self, source: IO[str], sink: IO[str], lock: threading.Lock) -> None:
        """Copy whole lines to ``sink`` with the prefix, and all of them to the log file;
        a traceback's lines go to the log only, its last line is kept as the error."""
        in_traceback, previous = False, None
        for line in source:  # universal newlines: each redraw of a progress bar is a line
            line = line.rstrip("\n")
            if line == previous:
                continue
            previous = line
            with lock:
                self._log.write(line + "\n")
                if line.startswith(_TRACEBACK):
                    in_traceback = True
                elif in_traceback and line and not line.startswith((" ", "\t")):
                    in_traceback = False
                    self.last_error = line
                elif not in_traceback and line.strip():
                    if sink is sys.stderr:
                        self.last_error = line
                    print(f"{self.prefix} {line}", file=sink, flush=True)

    def finish(self) -> int:
        returncode = self.proc.wait()
        for t in self.threads:
            t.join()
        self._log.close()
        return returncode

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


def run_jobs(jobs: list[Job], gpus: list[int], *, log_dir: Path) -> list[Outcome]:
    """Run ``jobs`` over ``gpus``, at most one child per GPU at a time, in order; return
    each job's outcome as it ended. Each child's whole output is kept in
    ``log_dir/<label>.gpu<N>.log``. Ctrl-C stops every child, then raises
    ``KeyboardInterrupt``."""
    queue, free = deque(jobs), deque(gpus)
    live: list[_Child] = []
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    previous = signal.signal(signal.SIGTERM, sigterm_stops)  # SIGTERM stops them too
    try:
        while queue or live:
            while queue and free:
                job, gpu = queue.popleft(), free.popleft()
                log = log_dir / f"{re.sub(r'[^A-Za-z0-9._-]', '_', job.label)}.gpu{gpu}.log"
                live.append(_Child(job, gpu, log, lock))
            for child in [c for c in live if c.proc.poll() is not None]:
                live.remove(child)
                free.append(child.gpu)
                outcomes.append(_ended(child, child.finish(), lock, others=len(live) + len(queue)))
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(live, lock)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    return outcomes


def _ended(child: _Child, returncode: int, lock: threading.Lock, *, others: int) -> Outcome:
    wall = time.monotonic() - child.start
    if returncode != 0:
        why = (
            f"killed by {signal.Signals(-returncode).name}"
            if returncode < 0
            else f"exit {returncode}: {child.last_error or 'no message'}"
        )
        with lock:
            print(
                f"{child.prefix} failed ({why}); log {child.log}"
                + (f"; {others} other job(s) go on" if others else ""),
                file=sys.stderr,
                flush=True,
            )
    return Outcome(child.job, child.gpu, returncode, wall)


def _stop(live: list[_Child], lock: threading.Lock) -> None:
    """Pass the signal that stopped this process (Ctrl-C or SIGTERM) to every child (its
    whole process group, as a terminal would), wait for them; kill them on a second one or
    after ``STOP_S``. A child that inherited SIGINT ignored (``nohup``) still stops: this
    process got a SIGTERM then, and passes that on."""
    with lock:
        print(f"stopping {len(live)} worker(s): their trials in flight are queued again", file=sys.stderr)
    for child in live:
        child.signal(Stop.signal)
    deadline = time.monotonic() + STOP_S
    try:
        while any(c.proc.poll() is None for c in live) and time.monotonic() < deadline:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    for child in live:
        if child.proc.poll() is None:
            child.signal(signal.SIGKILL)
        child.finish()


def run_argv(problem: Problem, opts: Options, name: str, storage: str) -> tuple[str, ...]:
    """The ``run`` command line of a worker of ``--gpus``: ``problem`` and ``opts`` as flags."""
    argv = ["run", "--worker", "--study", name, "--storage", storage]
    argv += [a for key, value in problem.to_dict().items() for a in (f"--{key}", str(value))]
    for f in options.fields():
        value = getattr(opts, f.name)
        if isinstance(f.default, bool):
            argv += [options.flag(f)] * (value != f.default)
        elif value is not None:
            argv += [options.flag(f), str(value)]
    return (*argv, *(a for c in opts.enqueue for a in ("--enqueue", c.label)))


def worker_options(opts: Options, workers: int) -> Options:
    """Each of ``workers`` concurrent workers: its share of the cores. Its progress bar
    reaches the terminal as a line per update."""
    cores = os.cpu_count() or 1
    return dataclasses.replace(opts, workers=opts.workers or max(1, cores // workers - 2))


def shares(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` nearly equal positive shares."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def run_study(
    problem: Problem, opts: Options, name: str, storage: str, gpus: list[int], folder: Path
) -> list[Outcome]:
    """``run --gpus``: one worker per GPU (at most one per trial) on study ``name``, its
    ``opts.n_trials`` trials split between them; their logs in ``folder/workers``."""
    gpus = gpus[: opts.n_trials]
    base = worker_options(opts, len(gpus))
    jobs = [
        Job(f"worker{i}", run_argv(problem, dataclasses.replace(base, n_trials=share), name, storage))
        for i, share in enumerate(shares(opts.n_trials, len(gpus)))
    ]
    print(
        f"{len(jobs)} workers on study {name!r} in {storage} (logs in {folder / 'workers'})", file=sys.stderr
    )
    return run_jobs(jobs, gpus, log_dir=folder / "workers")


def run_studies(
    tasks: list[tuple[Problem, Options, str]], storage: str, gpus: list[int], log_dir: Path
) -> list[Outcome]:
    """``dispatch --gpus``: the studies of ``tasks`` (problem, options, study name) handed out
    whole, one at a time per GPU, the next to the first GPU that comes free; each one's
    outcome in a line."""
    share = min(len(gpus), len(tasks))
    jobs = [
        Job(
            f"{p.batch}x{p.heads}x{p.seqlen}" + ("/dkdv" if o.sweep == "dkdv" else ""),
            run_argv(p, worker_options(o, share), name, storage),
        )
        for p, o, name in tasks
    ]
    outcomes = run_jobs(jobs, gpus, log_dir=log_dir)
    for o in outcomes:
        print(f"{o.job.label}: GPU {o.gpu}, {o.wall_s:.0f} s, exit {o.returncode}", file=sys.stderr)
    return outcomes
