"""The best-config JSON: written by the tuner, loaded back here into a ready kernel.

Format ``decay-tuner/best-configs`` version 1::

    {"format": "decay-tuner/best-configs", "version": 1,
     "problem": {batch, heads, seqlen, dk, dv, alpha, dtype},
     "environment": {gpu, capability, tilelang, torch, cuda, kernel},
     "mode": "gpu" | "compile-only",
     "configs": [{"config": {...}, "median_ms": .., "p20_ms": .., "p80_ms": .., "rel_l2": ..,
                  "trial": n}, ...]}   # best first

A file measured elsewhere (another GPU, TileLang, torch or CUDA, or another version of the
kernels' source: ``kernel`` is a hash of it) or for another problem is refused unless the
caller overrides: its ranking may not hold here.
"""

import dataclasses
import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernel.config import SEGMENT_COUNTS, KernelConfig, Problem

FORMAT = "decay-tuner/best-configs"
VERSION = 1
ENVIRONMENT_KEYS = ("gpu", "capability", "tilelang", "torch", "cuda", "kernel")
KERNEL_SOURCES = ("scalar_decay.py", "seq_split.py")


class ExportError(ValueError):
    """A best-config file that cannot be used as asked: unreadable, or for elsewhere."""


def environment() -> dict[str, Any]:
    """What a measurement depends on besides the config: GPU, library versions and the
    kernels' source (a changed kernel must not inherit the old one's timings)."""
    import tilelang
    import torch

    gpu = torch.cuda.is_available()
    here = Path(__file__).parent
    source = b"".join((here / name).read_bytes() for name in KERNEL_SOURCES)
    return {
        "gpu": torch.cuda.get_device_name() if gpu else None,
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if gpu else None,
        "tilelang": tilelang.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "kernel": hashlib.sha256(source).hexdigest()[:12],
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON atomically: a killed writer never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)  # mkstemp's 0600 would hide a table from its deployment's user
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _read_versioned(path: str | Path, what: str, fmt: str, version: int, items: str) -> dict[str, Any]:
    """Read a JSON file of format ``fmt`` and ``version`` holding a non-empty ``items``
    list; ``ExportError`` says what is wrong with it."""
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


def read_export(path: str | Path) -> dict[str, Any]:
    """Read and check a best-config file; ``ExportError`` says what is wrong with it."""
    return _read_versioned(path, "best-config file", FORMAT, VERSION, "configs")


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
        _check_environment(path, data["environment"])
        if problem != saved:
            raise ExportError(
                f"{path} was tuned for {saved}, not {problem}; pass allow_mismatch=True to use it anyway"
            )
    try:
        config.check_fits(problem)
    except ValueError as exc:
        raise ExportError(f"{path}: the config cannot run this problem: {exc}") from None
    return problem, config


def _check_environment(path: str | Path, saved: dict[str, Any]) -> None:
    here = environment()
    diff = [
        f"{k}: file {saved.get(k)!r}, here {here[k]!r}" for k in ENVIRONMENT_KEYS if saved.get(k) != here[k]
    ]
    if diff:
        raise ExportError(
            f"{path} was measured in another environment ({'; '.join(diff)}); "
            "pass allow_mismatch=True (bench: --allow-mismatch) to use it anyway"
        )


def load_kernel(path: str | Path, *, problem: Problem | None = None, allow_mismatch: bool = False):
    """Load a best-config file into a kernel ready to call (``kernel.build``)."""
    from kernel.build import build

    return build(*load_config(path, problem=problem, allow_mismatch=allow_mismatch))


# --- Dispatch table: one tuned config per shape bucket -------------------------------

DISPATCH_FORMAT = "decay-tuner/dispatch"
DISPATCH_VERSION = 1


@dataclass(frozen=True)
class DispatchEntry:
    """The best config measured at one tuned shape (``problem``)."""

    problem: Problem
    config: KernelConfig
    median_ms: float | None = None

    def distance(self, problem: Problem) -> float:
        """How far ``problem``'s shape is from this entry's, in log2(B*H) plus log2(S)."""
        bh = lambda p: p.batch * p.heads  # noqa: E731
        return abs(math.log2(bh(problem) / bh(self.problem))) + abs(
            math.log2(problem.seqlen / self.problem.seqlen)
        )


@dataclass
class Dispatch:
    """Picks a config by shape, and builds (once per problem) the kernel to run it.

    Format ``decay-tuner/dispatch`` version 1::

        {"format": "decay-tuner/dispatch", "version": 1, "environment": {...},
         "entries": [{"problem": {...}, "config": {...}, "median_ms": .., "study": ..}, ...]}

    Each entry owns a shape bucket: the shapes nearer to its tuned (B*H, S) than to any
    other entry's, in log2 of each. ``pick`` takes the nearest entry of the same DK, DV and
    dtype (a tie goes to the earlier entry) and keeps its config, with one change: the
    segment count is set so that the grid launches about as many blocks on the new shape
    as it did on the tuned one (``same_wave``). The grid is what the segment count tunes:
    at every shape measured on the H200 the best count gave about one block per SM, and
    the worse counts fell off on both sides (reports/h200/README.md, "oos"). Alpha is a
    compile-time constant of the kernel but does not change its speed, so an entry serves
    every alpha. When no segment count can run the problem with the nearest config (a
    sequence too short for its pipeline), it runs as the single-pass kernel with a
    pipeline no deeper than the sequence's chunks.
    """

    entries: list[DispatchEntry]
    environment: dict[str, Any]
    _kernels: dict[Problem, Any] = field(default_factory=dict, repr=False)

    def pick(self, problem: Problem) -> DispatchEntry:
        """The entry (tuned shape and the config to run) that serves ``problem``;
        ``ExportError`` if the table has no entry of its DK, DV and dtype."""
        same = [
            e
            for e in self.entries
            if (e.problem.dk, e.problem.dv, e.problem.dtype) == (problem.dk, problem.dv, problem.dtype)
        ]
        if not same:
            tuned = sorted({(e.problem.dk, e.problem.dv, e.problem.dtype) for e in self.entries})
            raise ExportError(
                f"no dispatch entry for dk={problem.dk}, dv={problem.dv}, {problem.dtype}; "
                f"the table was tuned for (dk, dv, dtype) in {tuned}"
            )
        nearest = min(same, key=lambda e: e.distance(problem))
        config = same_wave(nearest, problem)
        if config is None:  # a sequence too short for the pipeline: the single-pass kernel
            single = dataclasses.replace(nearest.config, segments=1)
            return DispatchEntry(nearest.problem, _shorter_pipeline(single, problem), None)
        return nearest if config == nearest.config else DispatchEntry(nearest.problem, config, None)

    def kernel(self, problem: Problem):
        """The built kernel for ``problem`` (compiled on first use, then cached)."""
        if problem not in self._kernels:
            from kernel.build import build

            self._kernels[problem] = build(problem, self.pick(problem).config)
        return self._kernels[problem]

    def __call__(self, q, k, v, *, alpha: float, out=None):
        """``o = kernel(q, k, v)`` with the problem read off the tensors ``[B, S, H, D]``."""
        from kernel.build import TORCH_DTYPES

        dtypes = {torch_dtype: name for name, torch_dtype in TORCH_DTYPES.items()}
        if q.dim() != 4 or v.dim() != 4:
            raise ValueError(f"q and v must be [B, S, H, D], got {list(q.shape)} and {list(v.shape)}")
        if q.dtype not in dtypes:
            raise ValueError(f"q must be float16 or bfloat16, got {q.dtype}")
        b, s, h, dk = q.shape
        return self.kernel(Problem(b, h, s, dk, v.shape[-1], alpha, dtypes[q.dtype]))(q, k, v, out=out)


def same_wave(entry: DispatchEntry, problem: Problem) -> KernelConfig | None:
    """``entry``'s config with the segment count (of ``SEGMENT_COUNTS``) whose grid on
    ``problem`` comes nearest, in log2, to the grid the entry was tuned with; the config
    itself when it runs ``problem`` with that many blocks already; ``None`` when no count
    runs ``problem``. A tie goes to fewer segments, which read K and V less often."""
    tuned = entry.config.blocks(entry.problem)
    if _runs(entry.config, problem) and entry.config.blocks(problem) == tuned:
        return entry.config
    runnable = [
        c
        for c in (dataclasses.replace(entry.config, segments=n) for n in SEGMENT_COUNTS)
        if _runs(c, problem)
    ]
    if not runnable:
        return None
    return min(runnable, key=lambda c: (abs(math.log2(c.blocks(problem) / tuned)), c.segments))


def _runs(config: KernelConfig, problem: Problem) -> bool:
    """Whether ``config`` tiles ``problem`` with a pipeline no deeper than a segment."""
    try:
        config.check_fits(problem)
    except ValueError:
        return False
    return config.pipeline_fits(problem)


def _shorter_pipeline(config: KernelConfig, problem: Problem) -> KernelConfig:
    chunks = max(1, config.segment_length(problem.seqlen) // config.chunk)
    return dataclasses.replace(config, num_stages=min(config.num_stages, chunks))


def load_dispatch(path: str | Path, *, allow_mismatch: bool = False) -> Dispatch:
    """Read a dispatch table; ``ExportError`` if it is malformed or, unless
    ``allow_mismatch``, measured in another environment."""
    data = _read_versioned(path, "dispatch table", DISPATCH_FORMAT, DISPATCH_VERSION, "entries")
    try:
        entries = [
            DispatchEntry(
                Problem.from_dict(e["problem"]), KernelConfig.from_dict(e["config"]), e.get("median_ms")
            )
            for e in data["entries"]
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise ExportError(f"{path}: malformed entry: {exc}") from None
    if not allow_mismatch:
        _check_environment(path, data.get("environment") or {})
    return Dispatch(entries, data.get("environment") or {})
