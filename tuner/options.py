"""What a user asks a tuning run for: the options type, whose fields carry their defaults
and help text (the CLI builds its flags from them), and the error for a mistake in it."""

import dataclasses
import itertools
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from kernel.arch import ARCHS, DEFAULT_ARCH
from kernel.config import HEADLINE, SWEEPS, KernelConfig
from kernel.constraints import MAX_EXTENT, rows_error
from refs import TOLERANCE

SAMPLERS = ("tpe", "nsga2", "gp", "grid")
# Study storage and exports: the checkout's studies/, or the working directory's for an
# installed package (never its site-packages); DECAY_TUNER_STUDIES moves them (the tests
# use a temporary one).
STUDIES_VARIABLE = "DECAY_TUNER_STUDIES"
_CHECKOUT = Path(__file__).resolve().parent.parent
STUDIES_DIR = Path(
    os.environ.get(STUDIES_VARIABLE)
    or (_CHECKOUT if (_CHECKOUT / "pyproject.toml").is_file() else Path.cwd()) / "studies"
)


def default_storage() -> str:
    return f"sqlite:///{STUDIES_DIR / 'decay-tuner.db'}"


class UsageError(ValueError):
    """A mistake in what the user asked for: one line on stderr, exit code 2."""


def check_writable(path: Path, what: str, hint: str = "") -> None:
    """``UsageError`` where ``path``, a file or a folder, could not be written, checked
    before any work: it, or for a file the nearest of its folders that exists (where a new
    file, an atomic write's temporary or SQLite's journal goes), is read-only
    (``os.access``: a read-only mount too)."""
    into = [path] if path.is_dir() else [path, next(p for p in path.parents if p.exists())]
    for p in into:
        if p.exists() and not os.access(p, os.W_OK):
            raise UsageError(f"cannot write {what} {str(path)!r}: {str(p)!r} is read-only{hint}")


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    **kwargs: Any,
):
    """A field of ``Options`` with its command-line flag (``--name`` by default), help text
    and smallest and largest allowed values; ``flag=""`` keeps it off the command line."""
    bounds = {"minimum": minimum, "maximum": maximum}
    return field(default=default, metadata={"help": help, "flag": flag, **bounds, **kwargs})


@dataclass(frozen=True)
class Options:
    n_trials: int = option(40, "trials this run adds to the study", minimum=1)
    timeout_s: float | None = option(
        None,
        "stop asking for trials after this many seconds (default: no limit)",
        flag="--timeout",
        minimum=1e-3,
    )
    sampler: str = option("tpe", "Optuna sampler", choices=SAMPLERS)
    multi_objective: bool = option(
        False,
        "minimise latency and relative L2 error together (Pareto front); compile-only, "
        "the predicted time and shared memory",
    )
    tolerance: float = option(
        TOLERANCE, "relative L2 bound against reference C", minimum=1e-12, maximum=1.0
    )  # 1: the error of an output of zeros
    max_spill_bytes: int = option(0, "register spill budget per thread, bytes (loads plus stores)", minimum=0)
    max_registers: int = option(255, "register budget per thread", minimum=1, maximum=255)  # the ISA's
    trial_timeout_s: float = option(
        180.0, "seconds before a GPU trial counts as hung", flag="--trial-timeout", minimum=1e-3
    )
    workers: int | None = option(
        None, "parallel compile processes (default: every core, less two beside a GPU)", minimum=1
    )
    heartbeat_s: int = option(
        10, "seconds between a worker's heartbeats for its live trials", flag="--heartbeat", minimum=1
    )
    grace_s: int = option(
        60,
        "seconds without a heartbeat before a trial's worker counts as dead (its config is measured again)",
        flag="--grace",
        minimum=1,
    )
    arch: str | None = option(
        None,
        "the GPU architecture to compile for; compile-only unless it is this GPU's (default: this GPU's, "
        f"else {DEFAULT_ARCH} compile-only; dispatch, whose table is measured, refuses without a GPU)",
        choices=tuple(ARCHS),
    )
    for_gpu: str | None = option(
        None,
        "the GPU a compile-only run ranks for, named as torch names it (model show lists those cached): "
        "its own latency model, refit from its trials at the end of GPU runs on it, else the shipped one "
        "(default: a GPU run's GPU; compile-only, the shipped model)",
    )
    sweep: str = option(
        "forward",
        "the kernel to tune: the forward, dkdv, the backward's fused dk and dv pass "
        "(kernel.dkdv; Hopper, DK x DV <= 128 x 128), or decode, the decode step on a pool of states "
        "(kernel.decode; --batch is the number of sequences)",
        choices=(*SWEEPS, "decode"),
    )
    seed: int = option(0, "seed of the sampler and of the random inputs", minimum=0, maximum=2**32 - 1)
    enqueue: tuple[KernelConfig, ...] = option((), "configs measured first", flag="")
    wave_seeds: bool = option(
        True,
        "skip the configs measured first: those whose grid is about one wave (tuner.space.wave_seeds) "
        "and those the latency model predicts fastest (tuner.space.predicted_first)",
        flag="--no-wave-seeds",
    )
    progress: bool = option(True, "hide the progress bar", flag="--no-progress")


def fields() -> list[dataclasses.Field]:
    """The fields of ``Options`` that have a command-line flag."""
    return [f for f in dataclasses.fields(Options) if f.metadata["flag"] != ""]


def flag(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


# The shapes ``bench`` times and ``dispatch`` tunes by default, (batch, heads, seqlen): the
# headline, then fewer and longer sequences.
BENCH_SHAPES = ((8, 16, 4096), (16, 16, 2048), (4, 16, 8192), (2, 16, 16384), (1, 8, 32768))


class Packed(NamedTuple):
    """A packed batch of ``sequences`` of mixed lengths, as a serving engine hands them over
    (``cu_seqlens``): lengths spread evenly in log from ``shortest`` to ``longest`` tokens,
    in a seeded random order, each with ``heads`` heads."""

    sequences: int = 64
    shortest: int = 100
    longest: int = 8000
    heads: int = HEADLINE.heads
    seed: int = 0

    def lengths(self) -> list[int]:
        n, ratio = self.sequences, self.longest / self.shortest
        spread = [round(self.shortest * ratio ** (i / max(n - 1, 1))) for i in range(n)]
        random.Random(self.seed).shuffle(spread)
        return spread

    def cu_seqlens(self) -> list[int]:
        """The N + 1 offsets ``0, L_0, L_0 + L_1, ..., T``."""
        return [0, *itertools.accumulate(self.lengths())]


# The packed batch ``bench`` times after its shapes.
BENCH_PACKED = Packed()
# The help text of each problem flag.
PROBLEM_FLAGS = {
    "batch": "sequences per call (B)",
    "heads": "attention heads (H)",
    "seqlen": "tokens per sequence (S)",
    "dk": "query/key head dimension (DK), a multiple of 16 up to 256; on Hopper (sm_90a) of 64",
    "dv": "value head dimension (DV), a multiple of 16 up to 256; on Hopper (sm_90a) of 32",
    "dtype": "element type of Q, K, V and O: float16 or bfloat16",
    "gate": "the decay: head, a constant per head, or token, a per-token log-gate g [B, S, H] (fla's "
    "chunk_simple_gla(g=...), Mamba2's dt*A: kernel.gated)",
    "groups": "with --gate token: the heads G of q and k (Mamba2's ngroups), dividing the heads "
    "(default: as many as the heads)",
}


def parse_config(text: str, flag: str = "--enqueue") -> KernelConfig:
    """'64/128/2/256/smem/8' -> KernelConfig (scores optional, default smem; segments
    optional, default 1)."""
    parts = text.split("/")
    if len(parts) not in (4, 5, 6):
        raise UsageError(f"{flag} wants C/bDV/stages/threads[/scores[/segments]], got {text!r}")
    try:
        numbers = [int(n) for n in (*parts[:4], *parts[5:])]
    except ValueError:
        raise UsageError(
            f"{flag} wants C/bDV/stages/threads[/scores[/segments]], numbers but the scores, got {text!r}"
        ) from None
    try:
        return KernelConfig(*numbers[:4], *parts[4:5], *numbers[4:])
    except ValueError as exc:
        raise UsageError(f"{flag} {text}: {exc}") from None


def parse_shapes(text: str, flag: str = "--shapes") -> list[tuple[int, int, int]]:
    """'8x16x4096,2x16x16384' -> [(8, 16, 4096), (2, 16, 16384)], each shape once;
    ``UsageError`` naming ``flag`` if malformed, or for more (batch, head) pairs than a
    kernel takes (``kernel.constraints.rows_error``)."""
    try:
        shapes = [tuple(int(n) for n in item.split("x")) for item in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(
        len(shape) != 3 or not 1 <= min(shape) <= max(shape) <= MAX_EXTENT for shape in shapes
    ):
        raise UsageError(
            f"{flag} wants BxHxS[,BxHxS...] of positive integers up to {MAX_EXTENT}, got {text!r}"[:300]
        )
    for b, h, _ in shapes:  # type: ignore[misc]
        if reason := rows_error(b, h):
            raise UsageError(f"{flag}: {reason}")
    return list(dict.fromkeys(shapes))  # type: ignore[arg-type]


def parse_archs(text: str) -> list[str]:
    """'sm_80,sm_90a' (or 'all') -> the architectures of ``kernel.arch.ARCHS`` it names;
    ``UsageError`` for any other name."""
    names = list(ARCHS) if text == "all" else list(dict.fromkeys(name.strip() for name in text.split(",")))
    unknown = [name for name in names if name not in ARCHS]
    if unknown or not names:
        raise UsageError(f"--arch wants architectures of {', '.join(ARCHS)} (or all), got {text!r}")
    return names
