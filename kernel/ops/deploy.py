"""The best-config JSON: written by the tuner, loaded back here into a ready kernel.

Format ``decay-tuner/best-configs`` version 1::

    {"format": "decay-tuner/best-configs", "version": 1,
     "problem": {batch, heads, seqlen, dk, dv, dtype},   # earlier files: an alpha too, ignored
     "environment": {gpu, capability, arch, tilelang, torch, cuda, nvcc, kernel},
     "mode": "gpu" | "compile-only",
     "configs": [{"config": {...}, "median_ms": .., "p20_ms": .., "p80_ms": .., "rel_l2": ..,
                  "trial": n}, ...]}   # best first

A file measured elsewhere (another GPU, library, compiler or kernel code: see
``kernel.environment``) or for another problem is refused unless the caller overrides: its
ranking may not hold here.
"""

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from kernel.builder import ScalarDecayKernel, build
from kernel.config import KernelConfig, Problem
from kernel.environment import environment, mismatches

FORMAT = "decay-tuner/best-configs"
VERSION = 1


class ExportError(ValueError):
    """A best-config file that cannot be used as asked: unreadable, or for elsewhere."""


def read_versioned(path: str | Path, what: str, fmt: str, version: int, items: str) -> dict[str, Any]:
    """Read a JSON file of format ``fmt`` and ``version`` holding a non-empty ``items``
    list; ``ExportError`` says what is wrong with it."""
    if not isinstance(path, (str, os.PathLike)):
        raise ExportError(f"a {what} is named by a path (str or Path), got {path!r}")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"cannot read {what} {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != fmt:
        raise ExportError(f"{path} is not a {fmt} file")
    if data.get("version") != version:
        raise ExportError(f"{path} has version {data.get('version')!r}; this tool reads version {version}")
    if not data.get(items):
        raise ExportError(f"{path} holds no {items}")
    return data


def saved_environment(path: str | Path, data: dict[str, Any]) -> dict[str, Any]:
    """The environment a file records (empty where it records none); ``ExportError`` where
    it is not an object."""
    environment = data.get("environment") or {}
    if not isinstance(environment, dict):
        raise ExportError(f"{path}: malformed environment: {environment!r}")
    return environment


def json_object(value: Any, where: str) -> dict[str, Any]:
    """``value``, a file's entry at ``where``, if it is a JSON object; else ``ValueError``."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} is not a JSON object: {value!r}"[:200])
    return value


def fields(cls: type, value: Any, where: str) -> dict[str, Any]:
    """``value``, a file's JSON object at ``where``, holding every field the dataclass
    ``cls`` has no default for; else ``ValueError`` naming what it lacks."""
    found = json_object(value, where)
    missing = [
        f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in found
    ]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}")
    return found


def read_export(path: str | Path) -> dict[str, Any]:
    """Read and check a best-config file; ``ExportError`` says what is wrong with it."""
    return read_versioned(path, "best-config file", FORMAT, VERSION, "configs")


def load_config(
    path: str | Path, *, problem: Problem | None = None, allow_mismatch: bool = False
) -> tuple[Problem, KernelConfig]:
    """The best config of a file, checked against this machine and ``problem``.

    ``problem`` defaults to the file's own. Raises ``ExportError`` for a compile-only
    file (its ranking is predicted), and on a mismatch of environment or problem unless
    ``allow_mismatch``.
    """
    data = read_export(path)
    if data.get("sweep", "forward") != "forward":
        raise ExportError(
            f"{path} holds configs of the backward's fused dk and dv sweep, not of a forward kernel: "
            "serve them through a dispatch table (python -m tuner dispatch --backward)"
        )
    if data.get("mode") == "compile-only":
        raise ExportError(
            f"{path} holds configs ranked by predicted time (a compile-only study), never measured: "
            "tune on the GPU (python -m tuner run) for a file to load"
        )
    environment = saved_environment(path, data)
    try:
        saved = Problem.from_dict(fields(Problem, data.get("problem"), "problem"))
        first = json_object(data["configs"][0], "configs[0]")
        config = KernelConfig.from_dict(fields(KernelConfig, first.get("config"), "configs[0].config"))
    except (TypeError, ValueError) as exc:
        raise ExportError(f"{path}: malformed entry: {exc}") from None
    problem = problem or saved
    if not allow_mismatch:
        check_environment(path, environment)
        if problem != saved:
            raise ExportError(
                f"{path} was tuned for {saved}, not {problem}; pass allow_mismatch=True to use it anyway"
            )
    try:
        config.check_fits(problem)
    except ValueError as exc:
        raise ExportError(f"{path}: the config cannot run this problem: {exc}") from None
    return problem, config


def check_environment(path: str | Path, saved: dict[str, Any]) -> None:
    """``ExportError`` unless ``saved`` is this machine's environment; a file tuned for
    another architecture says only that."""
    here = environment()
    if saved.get("arch") and saved["arch"] != here["arch"]:
        raise ExportError(
            f"{path} was tuned for {saved['arch']}, this machine is {here['arch']}: "
            "tune here (python -m tuner run, or dispatch)"
        )
    diff = mismatches(saved, here)
    if diff:
        raise ExportError(
            f"{path} was measured in another environment ({'; '.join(diff)}); "
            "pass allow_mismatch=True (bench: --allow-mismatch) to use it anyway"
        )


def load_kernel(
    path: str | Path, *, problem: Problem | None = None, allow_mismatch: bool = False
) -> ScalarDecayKernel:
    """Load a best-config file into a kernel ready to call (``kernel.build``)."""
    return build(*load_config(path, problem=problem, allow_mismatch=allow_mismatch))
