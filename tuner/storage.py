"""Optuna storages, each named by one string; the studies in them: ``tuner.studies``.

A storage is named by one string (``--storage``):

- an SQLAlchemy URL (``sqlite:///PATH``, ``postgresql://user@host/db``, ...): an RDB;
- ``journal:PATH``, or a plain file path as optuna-dashboard reads one: Optuna's journal
  file (a plain path to an existing SQLite file opens that database);
- ``grpc://HOST:PORT``: Optuna's gRPC storage proxy (``optuna.storages.run_grpc_proxy_server``).
"""

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.trial import FrozenTrial

from kernel.processes import ctrl_c_at_checkpoints
from tuner.liveness import requeue
from tuner.options import STUDIES_DIR, UsageError, check_writable


def _kind(url: str) -> tuple[str, str]:
    """(kind, target) of a storage string: ("rdb", URL), ("journal", PATH) or ("grpc", "HOST:PORT")."""
    if url.startswith("journal:"):
        return "journal", url.removeprefix("journal:")
    if url.startswith("grpc://"):
        return "grpc", url.removeprefix("grpc://").rstrip("/")
    if "://" in url:
        return "rdb", url
    path = Path(url)
    if path.is_file():
        with path.open("rb") as f:
            if f.read(16) == b"SQLite format 3\0":
                return "rdb", f"sqlite:///{path}"
    return "journal", url


def check_shared(url: str, workers: int) -> None:
    """A ``UsageError`` when ``workers`` processes at once would share ``url`` and it is an
    SQLite database, which serves one process at a time (Optuna recommends the journal
    file for many processes on one host)."""
    kind, target = _kind(url)
    if workers > 1 and kind == "rdb" and target.startswith("sqlite:"):
        raise UsageError(
            f"{workers} workers would share {url!r}, and SQLite serves one process at a time: "
            f"pass --storage journal:{STUDIES_DIR / 'decay-tuner.journal'} (one host) "
            "or a PostgreSQL/MySQL URL (many hosts)"
        )


def _sqlite_path(url: str) -> Path | None:
    """The database file of an ``sqlite:///`` URL; None for other URLs and ``:memory:``."""
    if not url.startswith("sqlite:///"):
        return None
    rest = url.removeprefix("sqlite:///").split("?")[0]
    return None if rest in ("", ":memory:") else Path(rest)


def storage_key(url: str) -> str:
    """A stable identity of the storage ``url`` names (a file storage by its absolute path)."""
    kind, target = _kind(url)
    if kind == "journal":
        return f"journal:{Path(target).resolve()}"
    if kind == "rdb" and (path := _sqlite_path(target)) is not None:
        return f"sqlite:{path.resolve()}"
    return target if kind == "rdb" else url


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on ``folder`` (flock on the directory itself: no file is left behind)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def get_storage(
    url: str, *, create: bool = True, heartbeat_s: int | None = None, grace_s: int | None = None
) -> BaseStorage:
    """Optuna storage for ``url`` (module docstring).

    ``create=False`` (the read-only commands) never creates anything: a storage that does
    not exist yet is a ``UsageError``. Several processes may create the same new storage at
    once. ``heartbeat_s``/``grace_s`` turn on Optuna's heartbeat on an RDB. A URL that
    cannot be opened is a ``UsageError``.
    """
    kind, target = _kind(url)
    try:
        if kind == "journal":
            return _journal(target, create)
        if kind == "grpc":
            return _grpc(target)
        return _rdb(target, create, heartbeat_s, grace_s)
    except UsageError:
        raise
    except Exception as exc:  # SQLAlchemy, gRPC and Optuna raise many types for a bad URL
        raise UsageError(
            f"cannot open storage {url!r}: {type(exc).__name__}: {exc}".splitlines()[0]
        ) from None


def _missing(url: str) -> UsageError:
    return UsageError(f"no storage at {url!r} (read-only commands create none; `run` makes one)")


def _folder_of(file: Path, url: str) -> None:
    """The folder of a storage's ``file`` exists, or is made where it is the studies
    folder; any other missing folder is a ``UsageError`` (a typo would hide a new storage
    where nobody looks), whatever the kind of storage."""
    if file.parent.resolve() == STUDIES_DIR.resolve():
        file.parent.mkdir(parents=True, exist_ok=True)
    elif not file.parent.is_dir():
        raise UsageError(f"no folder {str(file.parent)!r} for the storage {url!r}: make it first")


def _journal(path: str, create: bool) -> BaseStorage:
    """The journal file ``path``; a ``UsageError`` for a file that is no journal, or a folder
    that does not exist (``_folder_of``)."""
    file = Path(path)
    if file.is_dir():
        raise UsageError(
            f"{path!r} is a folder, not a storage: name a file in it, e.g. {str(file / 'studies.journal')!r}"
        )
    if not create and not file.is_file():
        raise _missing(path)
    if file.is_file() and not _journal_like(file):
        raise UsageError(f"{path!r} is neither an Optuna journal file nor an SQLite database")
    _folder_of(file, path)
    if create:
        check_writable(file, "the storage")
    # Optuna's default lock (a symlink), the one optuna-dashboard and Optuna scripts take too.
    return JournalStorage(_JournalFile(str(file)))


class _JournalFile(JournalFileBackend):
    """Optuna's journal file, each append finished before a Ctrl-C takes effect: cut between
    taking and dropping its lock, Optuna's append leaves the lock to other processes until it
    goes stale (30 s), or ends in a ``FileNotFoundError`` in place of the ``KeyboardInterrupt``."""

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        with ctrl_c_at_checkpoints():  # no checkpoint inside: the Ctrl-C raises as the append ends
            super().append_logs(logs)


def _journal_like(file: Path) -> bool:
    """Whether ``file`` is empty or starts as an Optuna journal does: a line of JSON."""
    with file.open("rb") as f:
        first = f.readline()
    try:
        return not first or isinstance(json.loads(first), dict)
    except ValueError:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return False


GRPC_WAIT_S = 10  # how long a run waits for a gRPC storage proxy to answer


def _grpc(target: str) -> BaseStorage:
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--storage grpc://HOST:PORT wants a host and a port, got 'grpc://{target}'")
    with warnings.catch_warnings():  # experimental in Optuna 5.0
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        proxy = optuna.storages.GrpcStorageProxy(host=host, port=int(port))
    try:
        socket.create_connection((host, int(port)), timeout=GRPC_WAIT_S).close()
    except OSError:  # a proxy may be starting beside this process: wait for it, saying so
        print(f"waiting up to {GRPC_WAIT_S} s for a gRPC storage proxy at grpc://{target}", file=sys.stderr)
    try:
        proxy.wait_server_ready(timeout=GRPC_WAIT_S)
    except ConnectionError:
        raise UsageError(f"no gRPC storage proxy answered at grpc://{target} in {GRPC_WAIT_S} s") from None
    return proxy


def _rdb(url: str, create: bool, heartbeat_s: int | None, grace_s: int | None) -> BaseStorage:
    with warnings.catch_warnings():  # the heartbeat's arguments are experimental in Optuna 5.0
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return _open_rdb(url, create, heartbeat_s, grace_s)


def _open_rdb(url: str, create: bool, heartbeat_s: int | None, grace_s: int | None) -> BaseStorage:
    kwargs: dict = {}
    if heartbeat_s:
        kwargs = {
            "heartbeat_interval": heartbeat_s,
            "grace_period": grace_s,
            "heartbeat_stale_trial_callback": _stale_callback,
        }
    path = _sqlite_path(url)
    if url.startswith("sqlite:") and path is None:
        if not create:
            raise _missing(url)
        raise UsageError(
            f"{url!r} is an SQLite database in memory: it keeps nothing; name a file (sqlite:///PATH)"
        )
    if not create:
        if path is not None and not path.is_file():
            raise _missing(url)
        import sqlalchemy

        engine = sqlalchemy.create_engine(url)
        try:
            if not sqlalchemy.inspect(engine).has_table("studies"):
                raise _missing(url)
        finally:
            engine.dispose()
        return optuna.storages.RDBStorage(url, skip_table_creation=True, **kwargs)
    if path is not None:  # one creator at a time: SQLite's schema set-up is not atomic
        _folder_of(path, url)
        check_writable(path, "the storage")
        with _folder_lock(path.parent):
            return optuna.storages.RDBStorage(url, **kwargs)
    for attempt in range(5):  # a server's schema set-up can race with another creator's
        try:
            return optuna.storages.RDBStorage(url, **kwargs)
        except Exception as exc:
            if not _lost_creation_race(exc) or attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def _lost_creation_race(exc: Exception) -> bool:
    """Whether another process created the schema while this one did: a duplicate key
    (IntegrityError) or, on PostgreSQL, a table that already exists (DuplicateTable, a
    ProgrammingError), seen in CI-like runs of four creators at once."""
    text = type(exc).__name__ + repr(exc)
    return "IntegrityError" in text or "DuplicateTable" in text or "already exists" in text


def _stale_callback(study: optuna.Study, trial: FrozenTrial) -> None:
    """Optuna's callback for a trial it failed for a stale heartbeat: queue its config again."""
    requeue(study, trial)
