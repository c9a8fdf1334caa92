"""The config a kernel runs where no table holds one: the one home of the rule.

``default_config`` serves the forward (and each backward sweep, which is a forward call),
``dkdv_config`` the backward's fused dk and dv sweep (``kernel.dkdv``). The tuner's first
trials (``tuner.space.wave_seeds``) and the ops' fallback (``kernel.ops``) both derive
from them. The evidence behind the rule is in ``experiments/h200/README.md``.
"""

import dataclasses
import math

from kernel import dkdv
from kernel.arch import get_arch
from kernel.config import SEGMENT_COUNTS, KernelConfig, Problem

# The family that won at every shape tuned on the H200: 64-token chunks, 2 stages, 256
# threads, scores in shared memory; block_dv as wide as the state allows (``default_config``).
CHUNK, STAGES, THREADS, SCORES = 64, 2, 256, "smem"
MAX_BLOCK_STATE = 128 * 128  # DK * block_dv: past it the block's fp32 state spills


def default_config(problem: Problem, arch: str, sms: int | None = None) -> KernelConfig:
    """The forward's config for ``problem`` on ``arch`` (a name of ``kernel.arch.ARCHS``):
    the winning family with the widest block_dv that divides DV and keeps DK x block_dv
    within ``MAX_BLOCK_STATE``, split into the segment count whose grid comes nearest one
    block per SM (``sms``; default: ``arch``'s reference GPU), with a pipeline no deeper
    than a segment's chunks."""
    widest = max(16, min(problem.dv, MAX_BLOCK_STATE // problem.dk))
    block_dv = max(d for d in range(16, widest + 1, 16) if problem.dv % d == 0)
    base = KernelConfig(CHUNK, block_dv, STAGES, THREADS, SCORES, 1)
    return nearest_grid(base, problem, sms or get_arch(arch).sms) or shorter_pipeline(base, problem)


def dkdv_config(problem: Problem, arch: str, sms: int | None = None) -> KernelConfig | None:
    """The fused dk and dv sweep's config for ``problem`` on ``arch``, or None where the
    sweep does not serve it (the backward then runs two sweeps): it serves Hopper (wgmma),
    a state of at most ``kernel.dkdv.MAX_STATE`` elements, with two stages where they fit
    the shared memory, else one. ``sms``: the GPU's SM count, to split the sequence into
    the segment count whose grid comes nearest one block per SM; None, one pass (what
    packed sequences run)."""
    if problem.dk * problem.dv > dkdv.MAX_STATE or not get_arch(arch).wgmma:
        return None
    limit = get_arch(arch).smem_per_block
    for stages in (2, 1):
        config = KernelConfig(dkdv.CHUNK, problem.dv, stages, dkdv.THREADS, "smem")
        if dkdv.smem_bytes(problem, config) <= limit:
            split = None if sms is None else nearest_grid(config, problem, sms)
            return config if split is None else split
    return None


def nearest_grid(config: KernelConfig, problem: Problem, blocks: int) -> KernelConfig | None:
    """``config`` with the segment count whose grid on ``problem`` comes nearest, in log2,
    to ``blocks``; ``None`` when no count runs ``problem``. A tie goes to fewer segments,
    which read K and V less often."""
    runnable = [
        c for c in (dataclasses.replace(config, segments=n) for n in SEGMENT_COUNTS) if runs(c, problem)
    ]
    if not runnable:
        return None
    return min(runnable, key=lambda c: (abs(math.log2(c.blocks(problem) / blocks)), c.segments))


def runs(config: KernelConfig, problem: Problem) -> bool:
    """Whether ``config`` tiles ``problem`` with a pipeline no deeper than a segment."""
    try:
        config.check_fits(problem)
    except ValueError:
        return False
    return config.pipeline_fits(problem)


def shorter_pipeline(config: KernelConfig, problem: Problem) -> KernelConfig:
    """``config`` with no more stages than a segment of ``problem`` has chunks."""
    chunks = max(1, config.segment_length(problem.seqlen) // config.chunk)
    return dataclasses.replace(config, num_stages=min(config.num_stages, chunks))
