"""The best-config JSON: written by the tuner, loaded back here into a ready kernel.

Format ``decay-tuner/best-configs`` version 2 (``kernel.formats`` reads version 1 too)::

    {"format": "decay-tuner/best-configs", "version": 2,
     "problem": {batch, heads, seqlen, dk, dv, dtype},
     "sweep": "forward" | "dkdv",
     "environment": {gpu, capability, arch, tilelang, torch, cuda, nvcc, kernel},  # gated: gated_kernel too
     "mode": "gpu" | "compile-only",
     "configs": [{"config": {...}, "median_ms": .., "p20_ms": .., "p80_ms": .., "rel_l2": ..,
                  "trial": n}, ...]}   # best first

A file measured elsewhere (another GPU, library, compiler or kernel code: see
``kernel.environment``) or for another problem is refused unless the caller overrides: its
ranking may not hold here.
"""

import dataclasses
from pathlib import Path
from typing import Any

from kernel import formats
from kernel.arch import ARCHS
from kernel.builder import ScalarDecayKernel, build
from kernel.config import KernelConfig, Problem
from kernel.constraints import config_error, size_error
from kernel.environment import GATED_KERNEL, GATED_MODULES, environment, kernel_key, mismatches

FORMAT = formats.BEST_CONFIGS
VERSION = formats.VERSIONS[FORMAT]


class ExportError(ValueError):
    """A best-config file that cannot be used as asked: unreadable, or for elsewhere."""


def read_versioned(path: str | Path, what: str, fmt: str, items: str) -> dict[str, Any]:
    """A JSON file of format ``fmt`` holding a non-empty list ``items``, in the format's
    current version (``kernel.formats.read_file``); ``ExportError`` says what is wrong with it."""
    try:
        return formats.read_file(path, fmt=fmt, what=what, items=items)
    except formats.FormatError as exc:
        raise ExportError(str(exc)) from None


def saved_environment(path: str | Path, data: dict[str, Any]) -> dict[str, Any]:
    """The environment a file records (empty where it records none); ``ExportError`` where
    it is not an object."""
    environment = data.get("environment") or {}
    if not isinstance(environment, dict):
        raise ExportError(f"{path}: malformed environment: {environment!r}")
    return environment


def file_arch(path: str | Path, environment: dict[str, Any]) -> str:
    """The architecture a file's configs were tuned for, its environment's ``arch``;
    ``ExportError`` where it records none this tool knows."""
    arch = environment.get("arch")
    if not isinstance(arch, str) or arch not in ARCHS:
        raise ExportError(
            f"{path} does not say which architecture it was tuned for (environment.arch {arch!r}, "
            f"capability {environment.get('capability')!r}; architectures: {', '.join(ARCHS)})"
        )
    return arch


def file_problem(value: Any, where: str) -> Problem:
    """The problem a file records at ``where``: every field given, sizes the kernels take
    (``kernel.constraints.size_error``); else ``ValueError`` naming what is wrong."""
    problem = Problem.from_dict(fields(Problem, value, where))
    if reason := size_error(problem):
        raise ValueError(f"{where}: {reason}")
    return problem


def file_config(value: Any, where: str) -> KernelConfig:
    """The config a file records at ``where``, every knob given; else ``ValueError``
    naming what it lacks."""
    knobs = [f.name for f in dataclasses.fields(KernelConfig)]
    return KernelConfig.from_dict(fields(KernelConfig, value, where, knobs))


def json_object(value: Any, where: str) -> dict[str, Any]:
    """``value``, a file's entry at ``where``, if it is a JSON object; else ``ValueError``."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} is not a JSON object: {value!r}"[:200])
    return value


def fields(cls: type, value: Any, where: str, required: list[str] | None = None) -> dict[str, Any]:
    """``value``, a file's JSON object at ``where``, holding the ``required`` fields
    (default: those the dataclass ``cls`` has no default for); else ``ValueError`` naming
    what it lacks."""
    found = json_object(value, where)
    if required is None:
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
    missing = [name for name in required if name not in found]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}")
    return found


def read_export(path: str | Path) -> dict[str, Any]:
    """Read and check a best-config file; ``ExportError`` says what is wrong with it."""
    return read_versioned(path, "best-config file", FORMAT, "configs")


def load_config(
    path: str | Path, *, problem: Problem | None = None, allow_mismatch: bool = False
) -> tuple[Problem, KernelConfig]:
    """The best config of a file, checked against this machine and ``problem``.

    ``problem`` defaults to the file's own. Raises ``ExportError`` for a compile-only
    file (its ranking is predicted), for a config this machine's architecture cannot run
    on ``problem`` (``kernel.constraints.config_error``), and on a mismatch of environment or
    problem unless ``allow_mismatch``.
    """
    data = read_export(path)
    if data.get("sweep") != "forward":
        raise ExportError(
            f"{path} holds configs of the backward's fused dk and dv pass, not of a forward kernel: "
            "serve them through a dispatch table (python -m tuner dispatch --backward)"
        )
    if data.get("mode") == "compile-only":
        raise ExportError(
            f"{path} holds configs ranked by predicted time (a compile-only study), never measured: "
            "tune on the GPU (python -m tuner run) for a file to load"
        )
    saved_env = saved_environment(path, data)
    try:
        saved = file_problem(data.get("problem"), "problem")
        config = file_config(json_object(data["configs"][0], "configs[0]").get("config"), "configs[0].config")
    except (TypeError, ValueError) as exc:
        raise ExportError(f"{path}: malformed entry: {exc}") from None
    problem = problem or saved
    if not allow_mismatch:
        check_environment(path, saved_env)
        if saved.gate == "token":
            check_code(
                path,
                "gated",
                GATED_MODULES,
                [saved_env.get(GATED_KERNEL)],
                "python -m tuner run --gate token",
            )
        if problem != saved:
            raise ExportError(
                f"{path} was tuned for {saved}, not {problem}; pass allow_mismatch=True to use it anyway"
            )
    if reason := config_error(problem, config, environment()["arch"]):
        raise ExportError(f"{path}: the config cannot run {problem} here: {reason}")
    return problem, config


def check_code(path: str | Path, family: str, modules: tuple[str, ...], keys: list, command: str) -> None:
    """``ExportError`` unless every one of ``keys`` (the code keys a file's ``family`` results
    were measured under) is this code's, ``kernel_key(modules=modules)``; it names ``command``
    that measures them again."""
    here = kernel_key(modules=modules)
    if stale := [key for key in keys if key != here]:
        raise ExportError(
            f"{path}: its {family} entries were measured with the {family} kernels {stale[0]!r}, "
            f"these are {here!r}: tune them again ({command})"
        )


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
