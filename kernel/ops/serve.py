"""Which kernel serves a call: the rule that picks its config (the table's pick for its
shape, else ``kernel.defaults``), and the kernels built for it, kept for the process."""

import dataclasses
import functools
import warnings
from dataclasses import dataclass, field

from kernel.builder import ScalarDecayKernel, build, cuda_arch, sm_count
from kernel.config import Call, KernelConfig, Problem
from kernel.defaults import default_config, dkdv_config
from kernel.ops.backward import sweep_calls
from kernel.ops.deploy import ExportError
from kernel.ops.dispatch import Dispatch
from kernel.variants import packed_config

Job = tuple[Problem, KernelConfig, Call]  # what ``build`` compiles


@dataclass
class _Server:
    """The table served (None: the rule alone), the kernels built, and which served each
    (problem, call, sequences) under this table: picking a config takes tens of us of
    Python, so a repeated call skips it."""

    table: Dispatch | None = None
    built: dict[Job, ScalarDecayKernel] = field(default_factory=dict)
    served: dict[tuple[Problem, Call, int], ScalarDecayKernel] = field(default_factory=dict)


_SERVER = _Server()
_SERVED_MAX = 4096  # packed batches differ in T; past this many, start over


def use_table(table: Dispatch | None) -> None:
    """Serve every later call with the config ``table`` picks for its shape (``None``: the
    rule of ``kernel.defaults``)."""
    _SERVER.table = table
    _SERVER.served.clear()


def kernel_for(problem: Problem, call: Call, sequences: int) -> ScalarDecayKernel:
    """The built kernel serving ``call`` on ``problem`` (``kernel_job``), built on first use."""
    served = _SERVER.served.get((problem, call, sequences))
    if served is None:
        job = kernel_job(problem, call, sequences)
        if job not in _SERVER.built:
            _SERVER.built[job] = build(*job)
        if len(_SERVER.served) >= _SERVED_MAX:
            _SERVER.served.clear()
        served = _SERVER.served[problem, call, sequences] = _SERVER.built[job]
    return served


def kernel_job(problem: Problem, call: Call, sequences: int) -> Job:
    """What a call compiles: the table's config for its shape. Packed sequences run the
    single-pass kernel with the config picked for ``sequences`` sequences of the mean
    length (``kernel.variants.packed_config``); a compiled kernel serves every T and N, so
    packed calls compile at most once per config the table holds."""
    p, table = problem, _SERVER.table
    if call.dkdv:  # the table's dk+dv entry, else the rule's; packed sequences run one pass
        config = dkdv_config(p, cuda_arch(), None if call.packed else sm_count())
        if config is None:
            raise ValueError(f"the fused dk and dv sweep does not serve {p} on {cuda_arch()}")
        tuned = None if table is None else table.fused(p)
        if tuned is not None:
            config = dataclasses.replace(tuned, segments=1) if call.packed else tuned
    elif call.packed:
        mean = Problem(sequences, p.heads, max(1, p.seqlen // sequences), p.dk, p.dv, p.dtype)
        config = config_for(mean, table, arch=cuda_arch(), sms=sm_count())
    else:
        config = config_for(p, table, arch=cuda_arch(), sms=sm_count())
    if call.packed:
        return dataclasses.replace(p, seqlen=1), packed_config(config, cuda_arch()), call
    return p, config, call


def config_for(problem: Problem, table: Dispatch | None, *, arch: str, sms: int) -> KernelConfig:
    """The table's pick for ``problem``; where there is no table, or it holds no entry of
    the problem's DK, DV and dtype, the rule's for ``arch`` and ``sms`` SMs
    (``kernel.defaults.default_config``), with a warning naming the command that tunes it."""
    if table is not None:
        try:
            return table.pick(problem).config
        except ExportError as exc:
            p = problem
            warnings.warn(
                f"{exc}; serving the default config. Tune it: python -m tuner dispatch "
                f"--dk {p.dk} --dv {p.dv} --dtype {p.dtype}",
                stacklevel=3,
            )
    return default_config(problem, arch, sms)


def fuses(problem: Problem, arch: str) -> bool:
    """Whether the backward of ``problem`` runs dk and dv in one sweep (``kernel.dkdv``) on
    a GPU of ``arch``: wherever that sweep serves the problem (``kernel.defaults.dkdv_config``)."""
    return dkdv_config(problem, arch) is not None


@functools.lru_cache(maxsize=256)
def fuses_here(problem: Problem) -> bool:
    """``fuses`` on this GPU."""
    return fuses(problem, cuda_arch())


def backward_jobs(problem: Problem, call: Call, sequences: int) -> list[Job]:
    """The ``kernel_job`` of each sweep the backward of ``call`` runs, in order."""
    sweeps = sweep_calls(problem, call, fused=fuses_here(problem))
    return [kernel_job(p, c, sequences) for p, c in sweeps]


def backward_configs(problem: Problem, call: Call, sequences: int) -> dict[str, KernelConfig]:
    """The configs the backward of ``call`` on ``problem`` runs, by sweep: ``dq``, then
    ``dk+dv`` where it fuses, else ``dk`` and ``dv``."""
    names = ("dq", "dk+dv") if fuses_here(problem) else ("dq", "dk", "dv")
    return {name: job[1] for name, job in zip(names, backward_jobs(problem, call, sequences))}


def training_jobs(problem: Problem, call: Call, sequences: int) -> set[Job]:
    """What a differentiable call compiles: its forward's ``kernel_job`` and its backward's
    sweeps', to compile ahead in parallel (``kernel.builder.precompile``)."""
    return {kernel_job(problem, call, sequences), *backward_jobs(problem, call, sequences)}
