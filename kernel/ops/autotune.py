"""Tuning on first use, off by default (``DECAY_TUNER_AUTOTUNE=1``, or
``kernel.ops.serve.use_table(path, autotune=True)``): a call whose DK, DV, dtype and shape
bucket the user's table lacks runs one short study at its shape, writes the entry into
the table on disk, and is served from it.

- The study is ``python -m tuner dispatch`` for that one shape in a child process: at most
  ``TRIALS`` configs and ``SECONDS`` of asking (then the trials in flight finish), each
  checked against reference C as ``run`` checks it, its studies beside the table
  (``my-table.json``: ``my-table.studies/``). The child is this interpreter in a
  temporary folder beside the table; it imports the tuner installed with this package
  (a checkout that is not installed: from the checkout, put on its ``PYTHONPATH``).
- A bucket: an entry of the same DK, DV, dtype and gate (``Problem.kind``) serves a call
  within ``COVERS`` of its tuned shape (log2 of B*H plus log2 of S,
  ``DispatchEntry.distance``): a table grows by about one entry for each doubling of B*H
  or S a model meets.
- One process tunes a bucket: the table's lock (``<table>.lock``, ``fcntl.flock``) is held
  from the look-up to the write, so a second process waits, then finds the entry. The
  table is replaced atomically (a temporary file, then ``os.replace``).
- A study that finds no correct config, fails or runs past ``CHILD_LIMIT_S`` leaves the
  table as it was: the call falls back to the rule (``kernel.rule``) with a warning,
  and no process tries that bucket again (no shape within ``COVERS`` of it): the failure
  is kept beside the table (``<table>.failed.json``; delete it to try again), so the ranks
  of a job do not each wait out the same failing study.
"""

import contextlib
import fcntl
import json
import os
import site
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kernel.config import SEED_CONFIG, Problem, gate_flags
from kernel.files import write_json
from kernel.ops.deploy import ExportError
from kernel.ops.dispatch import Dispatch, DispatchEntry, load_dispatch

AUTOTUNE_VARIABLE = "DECAY_TUNER_AUTOTUNE"  # "1": tune on first use into DECAY_TUNER_TABLE's file
TRIALS, SECONDS = 24, 60
COVERS = 1.0
CHILD_LIMIT_S = 900  # the study's process: imports, compiles and measures beyond its asking time
_ROOT = Path(__file__).resolve().parents[2]  # the folder holding this package and the tuner

_failed: set[tuple[Path, Problem]] = set()  # studies that failed in this process: their buckets run the rule


def enabled() -> bool:
    """Whether ``AUTOTUNE_VARIABLE`` turns tuning on first use on: ``1``, ``true``, ``yes``
    or ``on``; unset, empty, ``0``, ``false``, ``no`` or ``off`` leave it off (any case).
    ``ValueError`` for any other value, rather than a guess."""
    value = os.environ.get(AUTOTUNE_VARIABLE, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(
        f"{AUTOTUNE_VARIABLE} wants 1, true, yes or on (on), or 0, false, no or off (off), "
        f"got {os.environ[AUTOTUNE_VARIABLE]!r}"
    )


def default_path(gpu: str | None) -> Path:
    """The table tuning on first use writes where ``DECAY_TUNER_TABLE`` names none: one per
    GPU model in the user's cache folder."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "decay-tuner" / f"table-{(gpu or 'cpu').replace(' ', '_')}.json"


def covered(table: Dispatch | None, problem: Problem) -> bool:
    """Whether ``table`` holds an entry whose bucket serves ``problem``."""
    return table is not None and any(
        e.sweep == "forward" and _near(e.problem, problem) for e in table.entries
    )


def _near(tuned: Problem, problem: Problem) -> bool:
    """Whether ``problem`` lies in the bucket of a study at ``tuned``."""
    return tuned.kind == problem.kind and DispatchEntry(tuned, SEED_CONFIG).distance(problem) <= COVERS


def tuned(path: Path, problem: Problem, table: Dispatch | None) -> Dispatch | None:
    """The table at ``path`` holding a bucket that serves ``problem``: ``table`` itself
    where it does; else after one study of ``problem``'s shape (or another process's).
    Where the study yields nothing, the table as it is, with a warning."""
    if covered(table, problem) or any(where == path and _near(p, problem) for where, p in _failed):
        return table
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            table = load_dispatch(path, allow_mismatch=True) if path.exists() else None
            if covered(table, problem):  # another process tuned it while this one waited
                return table
            failed = _failures(path)
            if any(_near(p, problem) for p in failed):
                why = f"a study of its bucket failed before (delete {_failures_file(path)})"
            else:
                fresh, why = _study(path, problem)
                if fresh is not None:
                    merged = merge(json.loads(path.read_text()) if path.exists() else None, fresh)
                    write_json(path, merged)
                    return load_dispatch(path, allow_mismatch=True)
                write_json(_failures_file(path), [p.to_dict() for p in {*failed, problem}])
    except (OSError, ValueError) as exc:  # ExportError is a ValueError: a table of another GPU
        why = f"{type(exc).__name__}: {exc}".splitlines()[0]
    _failed.add((path, problem))
    warnings.warn(f"tuning on first use at {problem} gave no config ({why}): serving the rule", stacklevel=4)
    return table


def _failures_file(path: Path) -> Path:
    return path.with_name(path.name + ".failed.json")


def _failures(path: Path) -> list[Problem]:
    """The shapes whose studies failed for the table at ``path`` (none where the file is
    missing or cannot be read)."""
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        return [Problem.from_dict(d) for d in json.loads(_failures_file(path).read_text())]
    return []


def merge(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """Table ``old`` with ``new``'s entries added (an entry of the same problem and sweep
    replaced); ``ExportError`` where they were tuned on different GPUs or architectures."""
    if old is None:
        return new
    here, there = old.get("environment", {}), new.get("environment", {})
    for key in ("gpu", "arch"):
        if here.get(key) != there.get(key):
            raise ExportError(
                f"the table was tuned on {key} {here.get(key)!r}, this study on {there.get(key)!r}"
            )
    ident = lambda e: (json.dumps(e["problem"], sort_keys=True), e.get("sweep", "forward"))  # noqa: E731
    added = {ident(e) for e in new["entries"]}
    return old | {"entries": [e for e in old["entries"] if ident(e) not in added] + new["entries"]}


def _study(path: Path, problem: Problem) -> tuple[dict[str, Any] | None, str]:
    """One short ``dispatch`` study of ``problem``'s shape: its table, or None and why not."""
    studies = path.with_suffix(".studies")
    studies.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
        out = Path(tmp) / "table.json"
        cmd, env = child_command(problem, out, studies)
        try:  # in an empty folder: a tuner/ in the caller's working directory is not the tuner
            done = subprocess.run(
                cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=CHILD_LIMIT_S
            )
        except subprocess.TimeoutExpired:
            return None, f"the study ran past {CHILD_LIMIT_S} s"
        if done.returncode != 0 or not out.exists():
            if "No module named tuner" in done.stderr:
                return None, f"{sys.executable} cannot import the tuner: install decay-tuner for it"
            last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            return None, last[:300]
        load_dispatch(out, allow_mismatch=True)  # what is merged into the table is a table
        return json.loads(out.read_text()), ""


def child_command(problem: Problem, out: Path, studies: Path) -> tuple[list[str], dict[str, str]]:
    """The command and environment of the study's child: ``python -m tuner dispatch`` of
    this interpreter, writing the table ``out`` and its studies into ``studies``. Its
    ``PYTHONPATH`` names this package's folder only where that is no site-packages folder
    (a checkout run without an install); an installed package is found where it is."""
    p = problem
    cmd = [
        *(sys.executable, "-m", "tuner", "dispatch", "--shapes", f"{p.batch}x{p.heads}x{p.seqlen}"),
        *("--dk", str(p.dk), "--dv", str(p.dv), "--dtype", p.dtype, *gate_flags(p)),
        *("--n-trials", str(TRIALS), "--timeout", str(SECONDS), "--out", str(out), "--no-progress"),
    ]
    installed = {Path(d).resolve() for d in (*site.getsitepackages(), site.getusersitepackages())}
    path = [] if _ROOT in installed else [str(_ROOT)]
    env = (
        os.environ
        | _this_gpu()
        | {AUTOTUNE_VARIABLE: "0", "DECAY_TUNER_STUDIES": str(studies)}
        | {"PYTHONPATH": os.pathsep.join(filter(None, [*path, os.environ.get("PYTHONPATH")]))}
    )
    return cmd, env


def _this_gpu() -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` naming the caller's current GPU alone, so that the study
    times the GPU the call runs on (a rank that set its device), not the first one."""
    import torch

    if not torch.cuda.is_available():
        return {}
    index, visible = torch.cuda.current_device(), os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",")] if visible else None
    return {"CUDA_VISIBLE_DEVICES": ids[index] if ids else str(index)}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold ``path``'s lock file exclusively (other processes wait)."""
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
