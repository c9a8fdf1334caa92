"""The dispatch table: one tuned config per shape bucket, served by shape."""

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kernel import formats
from kernel.builder import ScalarDecayKernel, build
from kernel.config import SWEEPS, KernelConfig, Problem
from kernel.constraints import config_error, runs
from kernel.decode import DecodeCase, DecodeConfig, DecodeProblem
from kernel.environment import DECODE_KERNEL, DECODE_MODULES, GATED_KERNEL, GATED_MODULES
from kernel.ops.deploy import (
    ExportError,
    check_code,
    check_environment,
    file_arch,
    file_config,
    file_problem,
    json_object,
    read_versioned,
    saved_environment,
)
from kernel.ops.inputs import check_qkv, decay_parts, decay_tensor
from kernel.rule import nearest_grid, shorter_pipeline
from kernel.trial_schema import measured_ms

DISPATCH_FORMAT = formats.DISPATCH
DISPATCH_VERSION = formats.VERSIONS[DISPATCH_FORMAT]


@dataclass(frozen=True)
class DispatchEntry:
    """The best config measured at one tuned shape (``problem``); a per-token gate's with
    the gated kernel's code key it was measured under (``kernel.environment.GATED_MODULES``)."""

    problem: Problem
    config: KernelConfig
    median_ms: float | None = None
    sweep: str = "forward"  # or "dkdv": the backward's fused dk and dv pass (kernel.dkdv)
    kernel: str | None = None

    def distance(self, problem: Problem) -> float:
        """How far ``problem``'s shape is from this entry's, in log2(B*H) plus log2(S)."""
        bh = lambda p: p.batch * p.heads  # noqa: E731
        return abs(math.log2(bh(problem) / bh(self.problem))) + abs(
            math.log2(problem.seqlen / self.problem.seqlen)
        )


@dataclass(frozen=True)
class DecodeEntry:
    """The best decode config measured at one number of sequences (``case.batch``), with
    the decode kernel's code key it was measured under (``kernel.environment.DECODE_MODULES``)."""

    case: DecodeCase
    config: DecodeConfig
    median_ms: float | None = None
    kernel: str | None = None


@dataclass
class Dispatch:
    """Picks a config by shape, and builds (once per problem) the kernel to run it.

    Format ``decay-tuner/dispatch`` version 2 (``kernel.formats`` reads version 1 too)::

        {"format": "decay-tuner/dispatch", "version": 2, "environment": {...},
         "entries": [{"problem": {...}, "config": {...}, "sweep": "forward", "median_ms": ..,
                      "study": ..}, ...]}

    An entry marked ``"sweep": "dkdv"`` holds the config of the backward's fused dk and dv
    sweep (``kernel.dkdv``, tuned by ``dispatch --backward``), picked among those entries
    the same way (``fused``). An entry whose problem names ``"gate": "token"`` holds a
    per-token gate's forward config (``kernel.gated``, tuned by ``dispatch --gate token``),
    served to the gated calls of ``decay_attention(..., g=)`` alone, with the gated kernel's
    code key (``"gated_kernel"``); a decode entry (``"sweep": "decode"``) carries the decode
    kernel's (``"decode_kernel"``). A table whose entries of either were measured with other
    code is refused as stale.

    Each entry owns a shape bucket: the shapes nearer to its tuned (B*H, S) than to any
    other entry's, in log2 of each. ``pick`` takes the nearest entry of the same DK, DV,
    dtype and gate (``Problem.kind``; a tie goes to the earlier entry) and keeps its
    config, with one change: the segment count is set so that the grid launches about as
    many blocks on the new shape as it did on the tuned one (``same_wave``; a per-token
    gate's kernel runs one segment). The grid is what the segment count tunes:
    the best count gives about one block per SM, the worse counts fall off on both sides
    (measured: experiments/notebook/README.md, "oos"). The kernels
    read the decay at run time, so an entry serves every decay. When no segment count can
    run the problem with the nearest config (a sequence too short for its pipeline), it
    runs as the single-pass kernel with a pipeline no deeper than the sequence's chunks.
    """

    entries: list[DispatchEntry]
    environment: dict[str, Any]
    _kernels: dict[Problem, Any] = field(default_factory=dict, repr=False)
    decode: list[DecodeEntry] = field(default_factory=list)  # entries marked "sweep": "decode"

    def decode_config(self, problem: DecodeProblem, batch: int) -> DecodeConfig | None:
        """The decode step's config for ``batch`` sequences of ``problem``: that of the entry
        of its heads, head sizes, dtype and pool dtype whose number of sequences is nearest
        in log2 (a tie goes to the earlier entry); None where the table holds none."""
        p = problem
        same = [
            e
            for e in self.decode
            if (e.case.problem.heads, e.case.problem.dk, e.case.problem.dv, e.case.problem.dtype)
            == (p.heads, p.dk, p.dv, p.dtype)
            and e.case.problem.pool_dtype == p.pool_dtype
        ]
        if not same:
            return None
        return min(same, key=lambda e: abs(math.log2(batch / e.case.batch))).config

    def pick(self, problem: Problem, sweep: str = "forward") -> DispatchEntry:
        """The entry (tuned shape and the config to run) that serves ``problem``;
        ``ExportError`` if the table has no entry of its DK, DV, dtype and gate
        (``Problem.kind``)."""
        kind = [e for e in self.entries if e.sweep == sweep]
        same = [e for e in kind if e.problem.kind == problem.kind]
        if not same:
            tuned = sorted({e.problem.kind for e in kind})
            raise ExportError(
                f"no dispatch entry for dk={problem.dk}, dv={problem.dv}, {problem.dtype}, gate "
                f"{problem.gate}; the table was tuned for (dk, dv, dtype, gate) in {tuned}"
            )
        nearest = min(same, key=lambda e: e.distance(problem))
        config = same_wave(nearest, problem)
        if config is None:  # a sequence too short for the pipeline: the single-pass kernel
            single = dataclasses.replace(nearest.config, segments=1)
            return DispatchEntry(nearest.problem, shorter_pipeline(single, problem), None, sweep)
        return nearest if config == nearest.config else DispatchEntry(nearest.problem, config, None, sweep)

    def fused(self, problem: Problem) -> KernelConfig | None:
        """The fused dk and dv pass's config for ``problem``, picked as ``pick`` picks; None
        where the table holds no such entry of its DK, DV and dtype."""
        try:
            return self.pick(problem, "dkdv").config
        except ExportError:
            return None

    def kernel(self, problem: Problem) -> ScalarDecayKernel:
        """The built kernel for ``problem`` (its config compiled on first use, ``kernel.builder.build``)."""
        if problem not in self._kernels:
            self._kernels[problem] = build(problem, self.pick(problem).config)
        return self._kernels[problem]

    def __call__(self, q, k, v, *, decay=None, out=None):
        """``o = kernel(q, k, v)`` with the problem read off the tensors ``[B, S, H, D]``.

        ``decay``: a float for every head, or a tensor ``[H]`` of one per head, on q's
        device, each in (0, 1] (default: RetNet's, ``kernel.config.retnet_decay``)."""
        if decay is None:  # RetNet's
            return self.kernel(check_qkv(q, k, v))(q, k, v, out=out)
        per_head, alpha = decay_parts(decay)  # decay_attention's checks
        problem = check_qkv(q, k, v)
        decay = decay_tensor(per_head, alpha, problem.heads, q.device)
        return self.kernel(problem)(q, k, v, decay=decay, out=out)


def same_wave(entry: DispatchEntry, problem: Problem) -> KernelConfig | None:
    """``entry``'s config with the segment count (of ``SEGMENT_COUNTS``) whose grid on
    ``problem`` comes nearest, in log2, to the grid the entry was tuned with, without a
    split past it (``kernel.rule.nearest_grid``); the config itself when it runs
    ``problem`` with that many blocks already; ``None`` when no count runs ``problem``."""
    tuned = entry.config.blocks(entry.problem)
    if runs(entry.config, problem) and entry.config.blocks(problem) == tuned:
        return entry.config
    return nearest_grid(entry.config, problem, tuned)


def load_dispatch(path: str | Path, *, allow_mismatch: bool = False) -> Dispatch:
    """Read a dispatch table; ``ExportError`` if it is malformed (no architecture recorded,
    ``deploy.file_arch``, or an entry whose config that architecture's kernels cannot run
    on its problem, ``kernel.constraints.config_error``, included) or, unless
    ``allow_mismatch``, measured in another environment."""
    data = read_versioned(path, "dispatch table", DISPATCH_FORMAT, "entries")
    environment = saved_environment(path, data)
    arch = file_arch(path, environment)
    entries, decode = [], []
    try:
        for i, e in enumerate(data["entries"]):
            e = json_object(e, f"entries[{i}]")
            if e.get("sweep") == "decode":
                decode.append(_decode_entry(e, f"entries[{i}]"))
                continue
            entry = DispatchEntry(
                file_problem(e.get("problem"), f"entries[{i}].problem"),
                file_config(e.get("config"), f"entries[{i}].config"),
                e.get("median_ms"),
                e.get("sweep"),
                e.get(GATED_KERNEL),
            )
            if entry.sweep not in SWEEPS:
                raise ValueError(f"sweep {entry.sweep!r}, expected one of {list(SWEEPS)}")
            if entry.median_ms is not None:
                measured_ms(entry.median_ms)
            if reason := config_error(entry.problem, entry.config, arch, entry.sweep):
                raise ValueError(f"entries[{i}]: {reason}")
            entries.append(entry)
    except (TypeError, ValueError) as exc:
        raise ExportError(f"{path}: malformed entry: {exc}") from None
    if not allow_mismatch:
        check_environment(path, environment)
        keys = [e.kernel for e in decode]
        check_code(path, "decode", DECODE_MODULES, keys, "python -m tuner dispatch --decode")
        keys = [e.kernel for e in entries if e.problem.gate == "token"]
        check_code(path, "gated", GATED_MODULES, keys, "python -m tuner dispatch --gate token")
    return Dispatch(entries, environment, decode=decode)


def _decode_entry(e: dict[str, Any], where: str) -> DecodeEntry:
    """A table's decode entry: its problem a ``DecodeCase``'s, its config a ``DecodeConfig``
    that runs it; ``ValueError`` (or ``TypeError``) naming ``where`` otherwise."""
    problem = json_object(e.get("problem"), f"{where}.problem")
    if "batch" not in problem:
        raise ValueError(f"{where}.problem names no batch (its number of sequences)")
    case = DecodeCase.from_dict(problem)
    config = DecodeConfig.from_dict(json_object(e.get("config"), f"{where}.config"))
    if reason := config.fits_error(case.problem):
        raise ValueError(f"{where}: {reason}")
    if e.get("median_ms") is not None:
        measured_ms(e["median_ms"])
    return DecodeEntry(case, config, e.get("median_ms"), e.get(DECODE_KERNEL))
