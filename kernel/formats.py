"""The versions of what decay-tuner writes to last: the best-config file
(``kernel.ops.deploy``), the dispatch table (``kernel.ops.dispatch``) and a study's record
in its storage (its user attrs, ``tuner.studies``). One reader: ``read_file`` and
``study_record`` check the version and bring an older form up to the current one here,
the only place that knows the older forms; the modules that use the data see one form.

Version 1 is every file and study written before versions were counted. Version 2 (the
current) differs in four fields, which the upgrade fills in:

- a problem names no ``alpha`` (the decay became a run-time input: a file's config serves
  every decay); a study's problem that named one moves it to ``decays`` (its trials
  checked that one decay, with the plain call);
- a config names every knob (before the sequence split: no ``segments``, one pass);
- a study names its ``sweep`` (before the backward's fused pass was tunable: the
  forward); a file or a table's entry that names none, of any version, is the forward's;
- an environment names its ``arch`` (before: only the GPU's ``capability``).

A version newer than this tool's is refused with one line: it may mean anything.
"""

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kernel.arch import arch_of_capability
from kernel.config import KernelConfig

BEST_CONFIGS = "decay-tuner/best-configs"
DISPATCH = "decay-tuner/dispatch"
STUDY = "decay-tuner/study"
VERSIONS = {BEST_CONFIGS: 2, DISPATCH: 2, STUDY: 2}  # what this tool writes, and the newest it reads
STUDY_VERSION_ATTR = "format_version"  # a study's user attr; absent: version 1
FORWARD = "forward"  # the sweep a version-1 file, entry or study names by naming none
KNOB_DEFAULTS = KernelConfig().to_dict()  # what a knob a version-1 config omits ran at


class FormatError(ValueError):
    """A file or study record that cannot be read: unreadable, of another format, or of a
    version this tool does not know."""


def read_file(path: str | Path, *, fmt: str, what: str, items: str) -> dict[str, Any]:
    """The JSON file at ``path``, of format ``fmt`` and holding a non-empty list ``items``,
    in ``fmt``'s current version; ``FormatError`` says what is wrong with it."""
    if not isinstance(path, (str, os.PathLike)):
        raise FormatError(f"a {what} is named by a path (str or Path), got {path!r}")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise FormatError(f"cannot read {what} {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise FormatError(f"{path} is not a {fmt} file")
    version = _version(data.get("version"), fmt, str(path))
    if not data.get(items):
        raise FormatError(f"{path} holds no {items}")
    if not isinstance(data[items], list):
        raise FormatError(f"{path}: {items} is not a list, got {data[items]!r}"[:200])
    data = _upgrade_file(data) if version == 1 else dict(data)
    if fmt == BEST_CONFIGS:
        data.setdefault("sweep", FORWARD)
    else:
        data[items] = [{"sweep": FORWARD, **e} if isinstance(e, dict) else e for e in data[items]]
    return data


def study_record(
    attrs: dict[str, Any], *, name: str, has_trials: Callable[[], bool] = lambda: False
) -> dict[str, Any]:
    """A study's user attrs in the current version (a copy): ``problem`` without an alpha
    (``decays``: the one decay a version-1 study checked its trials with, else absent),
    ``sweep`` (None: no run recorded it yet). ``has_trials``: whether the study holds
    trials (a version-1 study with trials and no sweep tuned the forward), asked only then."""
    version = _version(attrs.get(STUDY_VERSION_ATTR, 1), STUDY, f"study {name!r}")
    record = dict(attrs)
    if version == 1:
        if isinstance(record.get("problem"), dict) and "alpha" in record["problem"]:
            problem = dict(record["problem"])
            record["decays"] = [problem.pop("alpha")]
            record["problem"] = problem
        if "sweep" not in record:
            record["sweep"] = FORWARD if has_trials() else None
    record.setdefault("sweep", None)
    return record


def trial_knobs(params: dict[str, Any]) -> dict[str, Any]:
    """A trial's config as knob -> value: its params, and the knobs its study's version had
    not yet (a version-1 study's trials name no ``segments``) at their defaults."""
    return KNOB_DEFAULTS | params


def _version(value: Any, fmt: str, where: str) -> int:
    current = VERSIONS[fmt]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= current:
        raise FormatError(
            f"{where} has {fmt} version {value!r}; this decay-tuner reads versions 1 to {current}"
            + (": a newer decay-tuner wrote it" if isinstance(value, int) and value > current else "")
        )
    return value


def _upgrade_file(data: dict[str, Any]) -> dict[str, Any]:
    """A version-1 best-config file or dispatch table in version 2 (a copy); what it cannot
    read is left for the caller's checks to name."""
    data = dict(data, version=VERSIONS[data["format"]])
    if isinstance(data.get("environment"), dict):
        data["environment"] = _environment(data["environment"])
    if data["format"] == BEST_CONFIGS:
        data["problem"] = _problem(data.get("problem"))
        data["configs"] = [
            dict(c, config=_config(c.get("config"))) if isinstance(c, dict) else c for c in data["configs"]
        ]
    else:
        data["entries"] = [
            e | {"problem": _problem(e.get("problem")), "config": _config(e.get("config"))}
            if isinstance(e, dict)
            else e
            for e in data["entries"]
        ]
    return data


def _problem(value: Any) -> Any:
    return {k: v for k, v in value.items() if k != "alpha"} if isinstance(value, dict) else value


def _config(value: Any) -> Any:
    return {"segments": KNOB_DEFAULTS["segments"], **value} if isinstance(value, dict) else value


def _environment(env: dict[str, Any]) -> dict[str, Any]:
    """The architecture of a GPU's ``capability`` ("9.0") where ``arch`` is not recorded."""
    capability = env.get("capability")
    if "arch" in env or not isinstance(capability, str):
        return env
    parts = capability.split(".")
    try:
        return env | {"arch": arch_of_capability(*map(int, parts)).name} if len(parts) == 2 else env
    except ValueError:
        return env
