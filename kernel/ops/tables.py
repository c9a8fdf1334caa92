"""The table a process serves when its model names none: a user's own, named by
``DECAY_TUNER_TABLE``, else the table shipped for this GPU (package data in ``tables/``,
made by ``experiments/shipped``), else none (the rule of ``kernel.rule``).

A shipped table is trusted where its GPU model, architecture and kernel code key
(``kernel.environment.kernel_key``) are this machine's. A change to the kernels' code
re-tunes the shipped tables in the same change (``tests/test_tables.py`` fails until it
does); a copy whose key differs anyway (kernels edited in place) is not used, with one
warning. A different torch, TileLang, CUDA or driver is noted once in the log, not refused.
"""

import functools
import logging
import os
import warnings
from pathlib import Path
from typing import Any

from kernel.environment import ENVIRONMENT_KEYS, environment
from kernel.ops.deploy import ExportError, file_arch
from kernel.ops.dispatch import Dispatch, load_dispatch

TABLE_VARIABLE = "DECAY_TUNER_TABLE"  # a user's dispatch table, served before the shipped one
SHIPPED = Path(__file__).parent / "tables"

log = logging.getLogger(__name__)


def shipped_table(here: dict[str, Any], directory: Path = SHIPPED) -> Dispatch | None:
    """The shipped table of ``here``'s GPU model, architecture and kernels; where ``here``
    has no GPU (compiling ahead for a named architecture), the first of its architecture.
    None where no table matches."""
    for path in sorted(directory.glob("*.json")):
        table = load_dispatch(path, allow_mismatch=True)
        saved = table.environment
        if file_arch(path, saved) != here["arch"] or here["gpu"] not in (None, saved.get("gpu")):
            continue
        if saved.get("kernel") != here["kernel"]:
            _once(
                warnings.warn,
                f"{path}: tuned for the kernels {saved.get('kernel')!r}, these are {here['kernel']!r}: "
                "not served (python -m tuner dispatch tunes a table for them)",
            )
            continue
        _note_versions(path, saved, here)
        return table
    return None


def user_table(path: str | Path, here: dict[str, Any]) -> Dispatch:
    """The dispatch table at ``path``, which ``ExportError`` refuses where it is unreadable
    or tuned for another architecture."""
    table = load_dispatch(path, allow_mismatch=True)
    arch = file_arch(path, table.environment)
    if arch != here["arch"]:
        raise ExportError(
            f"{path} was tuned for {arch}, not for {here['arch']}, which is to be served: tune it there"
        )
    _note_versions(path, table.environment, here)
    return table


def default_table(arch: str | None = None) -> Dispatch | None:
    """What a process serves before any ``use_table``: the table ``DECAY_TUNER_TABLE``
    names, else the shipped table of this GPU (or of ``arch``, compiling ahead without
    one), else None."""
    named = os.environ.get(TABLE_VARIABLE)
    if not named and not any(SHIPPED.glob("*.json")):
        return None  # nothing to match: no environment to read (it imports TileLang)
    here = environment(arch)
    if not named:
        return shipped_table(here)
    try:
        return user_table(named, here)
    except ExportError as exc:
        raise ExportError(f"{TABLE_VARIABLE}: {exc}") from None


def _note_versions(path: Path | str, saved: dict[str, Any], here: dict[str, Any]) -> None:
    """Log once how the environment ``path`` was measured in differs from ``here``."""
    others = [f"{k} {saved.get(k)!r} (here {here[k]!r})" for k in ENVIRONMENT_KEYS if saved.get(k) != here[k]]
    if others:
        _once(log.info, f"{path} was measured under {', '.join(others)}; served all the same")


@functools.cache
def _once(say, message: str) -> None:
    say(message)
