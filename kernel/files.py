"""The atomic writer that every file the product keeps goes through: a killed writer or a
power cut leaves the old file or the new one, never half a file."""

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary file beside ``path`` for the block to write; it replaces ``path`` when
    the block ends, or is removed when the block raises. The file reaches the disk before
    it replaces ``path`` (``os.fsync``), and the replacement after (the folder's fsync,
    where the platform allows one): a killed writer or a power cut leaves the old file or
    the new one, never half a file or an empty one. Every file the product keeps is
    written through here."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would hide a table from its deployment's user
    os.close(fd)
    try:
        yield Path(tmp)
        _fsync(tmp, os.O_RDONLY)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:
        _fsync(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # a folder cannot be opened or synced here (Windows, some network filesystems)
        pass


def _fsync(path: str | Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON atomically (``replacing``)."""
    with replacing(path) as tmp, tmp.open("w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
