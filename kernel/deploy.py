"""The best-config JSON: written by the tuner, loaded back here into a ready kernel.

Format ``decay-tuner/best-configs`` version 1::

    {"format": "decay-tuner/best-configs", "version": 1,
     "problem": {batch, heads, seqlen, dk, dv, alpha, dtype},
     "environment": {gpu, capability, tilelang, torch, cuda},
     "mode": "gpu" | "compile-only",
     "configs": [{"config": {...}, "median_ms": .., "p20_ms": .., "p80_ms": .., "rel_l2": ..,
                  "trial": n}, ...]}   # best first

A file measured elsewhere (another GPU, another TileLang, torch or CUDA) or for another
problem is refused unless the caller overrides: its ranking may not hold here.
"""

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from kernel.config import KernelConfig, Problem

FORMAT = "decay-tuner/best-configs"
VERSION = 1
ENVIRONMENT_KEYS = ("gpu", "capability", "tilelang", "torch", "cuda")


class ExportError(ValueError):
    """A best-config file that cannot be used as asked: unreadable, or for elsewhere."""


def environment() -> dict[str, Any]:
    """What a measurement depends on besides the kernel: GPU and library versions."""
    import tilelang
    import torch

    gpu = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name() if gpu else None,
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if gpu else None,
        "tilelang": tilelang.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON atomically: a killed writer never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def read_export(path: str | Path) -> dict[str, Any]:
    """Read and check a best-config file; ``ExportError`` says what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"cannot read best-config file {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ExportError(f"{path} is not a {FORMAT} file")
    if data.get("version") != VERSION:
        raise ExportError(f"{path} has version {data.get('version')!r}; this tool reads version {VERSION}")
    if not data.get("configs"):
        raise ExportError(f"{path} holds no configs")
    return data


def load_config(
    path: str | Path, *, problem: Problem | None = None, allow_mismatch: bool = False
) -> tuple[Problem, KernelConfig]:
    """The best config of a file, checked against this machine and ``problem``.

    ``problem`` defaults to the file's own. Raises ``ExportError`` on a mismatch of
    environment or problem unless ``allow_mismatch``.
    """
    data = read_export(path)
    try:
        saved = Problem.from_dict(data["problem"])
        config = KernelConfig.from_dict(data["configs"][0]["config"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ExportError(f"{path}: malformed entry: {exc}") from None
    problem = problem or saved
    if not allow_mismatch:
        here = environment()
        diff = [
            f"{k}: file {data['environment'].get(k)!r}, here {here[k]!r}"
            for k in ENVIRONMENT_KEYS
            if data["environment"].get(k) != here[k]
        ]
        if diff:
            raise ExportError(
                f"{path} was measured in another environment ({'; '.join(diff)}); "
                "pass allow_mismatch=True to use it anyway"
            )
        if problem != saved:
            raise ExportError(
                f"{path} was tuned for {saved}, not {problem}; pass allow_mismatch=True to use it anyway"
            )
    try:
        config.check_fits(problem)
    except ValueError as exc:
        raise ExportError(f"{path}: the config cannot run this problem: {exc}") from None
    return problem, config


def load_kernel(path: str | Path, *, problem: Problem | None = None, allow_mismatch: bool = False):
    """Load a best-config file into a kernel ready to call (``kernel.build``)."""
    from kernel.build import build

    return build(*load_config(path, problem=problem, allow_mismatch=allow_mismatch))
