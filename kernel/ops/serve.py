"""Which kernel serves a call: the rule that picks its config (the table's pick for its
shape, else ``kernel.rule``), and the kernels built for it, kept for the process."""

import dataclasses
import functools
import itertools
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernel.arch import get_arch
from kernel.builder import ScalarDecayKernel, build, cuda_arch, memory_bandwidth, precompile, sm_count
from kernel.config import Call, KernelConfig, Problem, gate_flags
from kernel.environment import environment
from kernel.gated_build import pass_jobs
from kernel.ops import autotune
from kernel.ops.backward import pass_calls
from kernel.ops.deploy import ExportError
from kernel.ops.dispatch import Dispatch
from kernel.ops.tables import TABLE_VARIABLE, default_table, user_table
from kernel.probe import ProbeResult
from kernel.rule import MEMORY_CLASSES, default_config, dkdv_config
from kernel.variants import packed_config, shape_generic

Job = tuple[Problem, KernelConfig, Call]  # what ``build`` compiles


DEFAULT = "default"  # ``use_table(DEFAULT)``: what a process starts with (``kernel.ops.tables``)


@dataclass
class _Server:
    """The table served (None: the rule alone; ``DEFAULT``: not yet looked up), the file
    tuning on first use writes into (``kernel.ops.autotune``; None: off), and the kernel
    that served each (problem, call, sequences) under this table: picking a config takes
    tens of us of Python, so a repeated call skips it. The compiled kernels behind them are
    ``kernel.builder``'s, one per config for every batch size and sequence length."""

    table: Dispatch | str | None = DEFAULT
    autotune: Path | None = None
    served: dict[tuple[Problem, Call, int], ScalarDecayKernel] = field(default_factory=dict)


_SERVER = _Server()
_SERVED_MAX = 4096  # packed batches differ in T; past this many, start over
# An eager call's signature -> its plan (``kernel.ops.attention``), whose kernels are
# ``served``'s: emptied with it.
PLANS: dict[tuple, object] = {}
PLANS_MAX = _SERVED_MAX


def use_table(table: Dispatch | str | Path | None, *, autotune: bool = False) -> None:
    """Serve every later call with the config ``table`` picks for its shape: a ``Dispatch``,
    or the path of a dispatch table file (``kernel.ops.tables.user_table``); ``None`` serves
    the rule of ``kernel.rule`` alone, ``DEFAULT`` what a process starts with
    (``kernel.ops.tables.default_table``: the file ``DECAY_TUNER_TABLE`` names, else the
    table shipped for this GPU). With ``autotune``, a call the table at that path lacks
    tunes its shape into it first (``kernel.ops.autotune``; the file need not exist yet)."""
    if not isinstance(table, (Dispatch, str, Path, type(None))):
        raise ValueError(
            f"use_table wants a Dispatch, a table file's path, None or {DEFAULT!r}, got {table!r}"
        )
    if not isinstance(autotune, bool):
        raise ValueError(f"use_table's autotune must be True or False, got {autotune!r}")
    path = None
    if isinstance(table, (str, Path)) and table != DEFAULT:
        path = Path(table)
        table = user_table(path, environment()) if path.exists() or not autotune else None
    elif autotune:
        raise ValueError("use_table(..., autotune=True) takes the path of the table file to tune into")
    _SERVER.table, _SERVER.autotune = table, path if autotune else None
    _SERVER.served.clear()
    PLANS.clear()


def served_table(arch: str | None = None) -> Dispatch | None:
    """The table calls are served from (``use_table``), looked up on first use: on this
    GPU, or for ``arch`` when compiling ahead without one. Where ``DECAY_TUNER_AUTOTUNE``
    is on, the file ``DECAY_TUNER_TABLE`` names (else ``autotune.default_path``) is the
    one tuning on first use writes into."""
    if isinstance(_SERVER.table, str):
        if arch is not None:  # compiling ahead: looked up for it, kept for no call of this process
            named = os.environ.get(TABLE_VARIABLE)
            if autotune.enabled() and named and not Path(named).exists():
                return None  # the table tuning on first use will write: nothing in it yet
            return default_table(arch)
        if autotune.enabled():
            here = environment()
            path = Path(os.environ.get(TABLE_VARIABLE) or autotune.default_path(here["gpu"]))
            _SERVER.table = user_table(path, here) if path.exists() else None
            _SERVER.autotune = path
        else:
            _SERVER.table = default_table()
    return _SERVER.table


def kernel_for(problem: Problem, call: Call, sequences: int) -> ScalarDecayKernel:
    """The built kernel serving ``call`` on ``problem`` (``kernel_job``), compiled on the
    first use of its config."""
    served = _SERVER.served.get((problem, call, sequences))
    if served is None:
        if len(_SERVER.served) >= _SERVED_MAX:
            _SERVER.served.clear()
        served = _SERVER.served[problem, call, sequences] = build(*kernel_job(problem, call, sequences))
    return served


def kernel_job(
    problem: Problem,
    call: Call,
    sequences: int,
    *,
    arch: str | None = None,
    sms: int | None = None,
    bandwidth: float | None = None,
) -> Job:
    """What a call compiles: the table's config for its shape on ``arch`` with ``sms`` SMs and
    ``bandwidth`` (``kernel.rule.default_config``; on this GPU, default: its own;
    compiling ahead for ``arch``, default: its reference GPU's). Packed sequences run the single-pass
    kernel with the config picked for ``sequences`` sequences of the mean length
    (``kernel.variants.packed_config``); a compiled kernel serves every T and N, so packed
    calls compile at most once per config the table holds, as dense calls do
    (``kernel.variants.shape_generic``)."""
    p, table, ahead = problem, served_table(arch), arch is not None
    arch = arch or cuda_arch()
    sms = sms or (get_arch(arch).sms if ahead else sm_count())
    if not ahead:
        bandwidth = bandwidth or memory_bandwidth()
    if call.dkdv:  # the table's dk+dv entry, else the rule's; packed sequences run one pass
        config = dkdv_config(p, arch, None if call.packed else sms)
        if config is None:
            raise ValueError(f"the fused dk and dv pass does not serve {p} on {arch}")
        tuned = None if table is None else table.fused(p)
        if tuned is not None:
            config = dataclasses.replace(tuned, segments=1) if call.packed else tuned
    else:
        shape = p
        if call.packed:  # sequences of the mean length
            shape = dataclasses.replace(p, batch=sequences, seqlen=max(1, p.seqlen // sequences))
        if _SERVER.autotune is not None and not ahead:  # a call on this GPU, not compiling ahead
            if not torch.cuda.is_current_stream_capturing():  # a study inside a capture would run in it
                table = _SERVER.table = autotune.tuned(_SERVER.autotune, shape, table)
            if not autotune.covered(table, shape):  # no study, or it gave nothing: the rule, as warned
                table = None
        config = config_for(shape, table, arch=arch, sms=sms, bandwidth=bandwidth)
    if call.packed:
        return dataclasses.replace(p, seqlen=1), packed_config(config, arch), call
    return p, config, call


def config_for(
    problem: Problem, table: Dispatch | None, *, arch: str, sms: int, bandwidth: float | None = None
) -> KernelConfig:
    """The table's pick for ``problem``; where there is no table, or it holds no entry of
    the problem's DK, DV and dtype, the rule's for ``arch``, ``sms`` SMs and ``bandwidth``
    (``kernel.rule.default_config``), with a warning naming the command that tunes it."""
    if table is not None:
        try:
            return table.pick(problem).config
        except ExportError as exc:
            p = problem
            warnings.warn(
                f"{exc}; serving the default config. Tune it: python -m tuner dispatch "
                f"--dk {p.dk} --dv {p.dv} --dtype {p.dtype} {' '.join(gate_flags(p))}".rstrip(),
                stacklevel=3,
            )
    return default_config(problem, arch, sms, bandwidth)


def fuses(problem: Problem, arch: str) -> bool:
    """Whether the backward of ``problem`` runs dk and dv in one pass (``kernel.dkdv``) on
    a GPU of ``arch``: wherever that pass serves the problem (``kernel.rule.dkdv_config``)."""
    return dkdv_config(problem, arch) is not None


@functools.lru_cache(maxsize=256)
def fuses_here(problem: Problem) -> bool:
    """``fuses`` on this GPU."""
    return fuses(problem, cuda_arch())


def backward_jobs(
    problem: Problem,
    call: Call,
    sequences: int,
    *,
    arch: str | None = None,
    sms: int | None = None,
    bandwidth: float | None = None,
) -> list[Job]:
    """The ``kernel_job`` of each pass the backward of ``call`` runs, in order."""
    fused = fuses_here(problem) if arch is None else fuses(problem, arch)
    return [
        kernel_job(p, c, sequences, arch=arch, sms=sms, bandwidth=bandwidth)
        for p, c in pass_calls(problem, call, fused)
    ]


def backward_configs(problem: Problem, call: Call, sequences: int) -> dict[str, KernelConfig]:
    """The configs the backward of ``call`` on ``problem`` runs, by pass: ``dq``, then
    ``dk+dv`` where it fuses, else ``dk`` and ``dv``."""
    names = ("dq", "dk+dv") if fuses_here(problem) else ("dq", "dk", "dv")
    return {name: job[1] for name, job in zip(names, backward_jobs(problem, call, sequences))}


def training_jobs(problem: Problem, call: Call, sequences: int) -> set[Job]:
    """What a differentiable call compiles: its forward's ``kernel_job`` and its backward's
    passes', to compile ahead in parallel (``kernel.builder.precompile``)."""
    return {kernel_job(problem, call, sequences), *backward_jobs(problem, call, sequences)}


# The shapes ``warmup_jobs`` serves: B in steps of a quarter octave (every B up to 5, then
# 6, 7, 8, 10, 11, 13, 16, ...: the rule's choices change at factors of 4/3 of B*H or more)
# with B*H up to this many, every S of the form 2^k or 3 * 2^k up to ``WARMUP_MAX_SEQLEN``
# and one more (a ragged last chunk), dense, and packed as B sequences of S tokens on average.
WARMUP_MAX_ROWS, WARMUP_MAX_SEQLEN = 512, 65536


def warmup_jobs(
    heads: int,
    dk: int,
    dv: int,
    dtype: str,
    *,
    backward: bool,
    arch: str,
    sms: int | None = None,
    bandwidth: float | None = None,
    gate: str = "head",
    groups: int | None = None,
) -> list[Job]:
    """Every job a model of ``heads`` heads of ``dk`` x ``dv`` calls under the table served
    (``served_table``; else the rule) on ``arch`` with ``sms`` SMs (default: its reference
    GPU's) and ``bandwidth`` (default: each of ``kernel.rule.MEMORY_CLASSES``, so that
    a GPU of either finds its own): the forward of fla's defaults (scale
    ``DK^-1/2``, no state in; the final state returned, or not) dense over the shapes above
    and packed, and with ``backward`` each pass of their backward. One per compiled kernel
    (``kernel.variants.shape_generic``): a few configs for every shape. ``gate`` and
    ``groups``: a per-token gate's model (``Problem.gate``; fla's ``chunk_simple_gla(g=)``
    and Mamba2's calls, no per-head decay beside the gate: a call with one compiles its own
    kernel on first use), and with ``backward`` its backward's passes
    (``kernel.gated_build.pass_jobs``). ``ValueError`` for a head count, head sizes, dtype,
    gate or groups ``Problem`` refuses, an SM
    count that is no positive integer, and an architecture whose kernels are compiled per
    shape (``kernel.arch.Arch.symbolic_shapes``: there is no set of kernels to warm ahead)."""
    Problem(1, heads, 64, dk, dv, dtype, gate, groups)  # checks them, before any arithmetic on them
    if not get_arch(arch).symbolic_shapes:
        raise ValueError(
            f"on {arch} the kernels are compiled per shape (kernel.arch: Arch.symbolic_shapes): "
            "there is no set of kernels to warm ahead"
        )
    if sms is not None and (isinstance(sms, bool) or not isinstance(sms, int) or sms < 1):
        raise ValueError(f"sms wants a positive number of SMs, got {sms!r}")
    sms = sms or get_arch(arch).sms
    most = max(1, WARMUP_MAX_ROWS // heads)
    batches = sorted(
        {round(2 ** (i / 4)) for i in range(4 * most.bit_length()) if 2 ** (i / 4) <= most} | {most}
    )
    lengths = sorted(
        {n + odd for k in range(WARMUP_MAX_SEQLEN.bit_length()) for n in (2**k, 3 * 2**k) for odd in (0, 1)}
    )
    shapes = [
        Problem(b, heads, s, dk, dv, dtype, gate, groups)
        for b in batches
        for s in lengths
        if s <= WARMUP_MAX_SEQLEN
    ]
    calls = [
        (q, Call(dk**-0.5, False, final, packed), p.batch)
        for p in shapes
        for packed, q in ((False, p), (True, dataclasses.replace(p, batch=1, seqlen=p.batch * p.seqlen)))
        for final in (False, True)
    ]
    jobs: dict[tuple, Job] = {}
    for (p, call, n), rate in itertools.product(calls, (bandwidth,) if bandwidth else MEMORY_CLASSES):
        found = [kernel_job(p, call, n, arch=arch, sms=sms, bandwidth=rate)]
        if backward and gate == "token":
            found += pass_jobs(p, call)
        elif backward:
            found += backward_jobs(p, call, n, arch=arch, sms=sms, bandwidth=rate)
        for job in found:
            jobs.setdefault((shape_generic(job[0], job[1], arch), *job[1:]), job)
    return list(jobs.values())


def warmup(
    heads: int,
    dk: int,
    dv: int,
    dtype: str,
    *,
    backward: bool,
    arch: str,
    sms: int | None = None,
    bandwidth: float | None = None,
    workers: int | None = None,
    gate: str = "head",
    groups: int | None = None,
) -> list[ProbeResult]:
    """Compile every kernel of ``warmup_jobs`` into TileLang's disk cache, in ``workers``
    parallel processes (default: one per CPU core), with no GPU needed: a later process
    that serves those calls on an ``arch`` GPU loads them instead of compiling. Returns each
    job's probe, a failure as a value; ``ValueError`` for what ``warmup_jobs`` refuses and
    a ``workers`` that is no positive integer."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers wants a positive number of processes, got {workers!r}")
    rate = {"sms": sms, "bandwidth": bandwidth}
    jobs = warmup_jobs(heads, dk, dv, dtype, backward=backward, arch=arch, **rate, gate=gate, groups=groups)
    return precompile(jobs, arch=arch, workers=workers)
