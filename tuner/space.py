"""The search space: one table of choices derived from the problem, plus named restrictions.

Restrictions are cheap predicates on a config, checked before any compile. Everything the
compiler decides (layout failures, spills, shared memory) is left to the probe, which
records it as a value.
"""

import math

from optuna.distributions import CategoricalDistribution

from kernel.arch import DEFAULT_ARCH, get_arch
from kernel.config import KernelConfig, Problem, config_grid, knob_choices


def choices(problem: Problem) -> dict[str, tuple]:
    """Knob name -> choices: the knob table of ``kernel.config`` for this problem's DV."""
    return knob_choices(problem.dv)


def distributions(problem: Problem) -> dict[str, CategoricalDistribution]:
    return {name: CategoricalDistribution(values) for name, values in choices(problem).items()}


def violated(problem: Problem, config: KernelConfig, arch: str = DEFAULT_ARCH) -> list[str]:
    """Why ``config`` may not run ``problem`` on ``arch``, one reason per broken
    restriction: it must tile the problem (``KernelConfig.check_fits``), its pipeline may
    be no deeper than the chunks of one segment it overlaps, and the shared memory it
    needs at the least (``KernelConfig.smem_floor``) must fit one block of ``arch``."""
    reasons = []
    floor, limit = config.smem_floor(problem), get_arch(arch).smem_per_block
    if floor > limit:
        reasons.append(f"shared memory: at least {floor} B, over {arch}'s {limit} B per block")
    try:
        config.check_fits(problem)
    except ValueError as exc:
        reasons.append(str(exc))
    if not config.pipeline_fits(problem):
        chunks = config.segment_length(problem.seqlen) // config.chunk
        reasons.append(f"num_stages={config.num_stages} is deeper than the {chunks} chunk(s) of a segment")
    return reasons


def grid(problem: Problem) -> list[KernelConfig]:
    """Every config of the table, restricted or not, in a fixed order."""
    return config_grid(problem.dv)


def wave_seeds(problem: Problem, *, arch: str = DEFAULT_ARCH, sms: int | None = None) -> list[KernelConfig]:
    """Configs worth measuring first: the family that won at every shape tuned on the H200
    (64-token chunks, the widest block_dv up to 128, 256 threads, scores in shared memory,
    2 or 3 stages), with the segment count whose grid is nearest one wave of blocks (one
    per SM, as these configs' ~190 KB of shared memory allows), and its two neighbours.
    ``sms``: the GPU's SM count; by default that of ``arch``'s reference GPU
    (``kernel.arch.Arch.sms``), as a compile-only run assumes.

    At the four shapes tuned on the H200 (8x16x4096, 2x16x16384, 1x8x32768, 4x16x8192) the
    best config launched 128 blocks (experiments/h200/README.md, "retable"); at four shapes
    outside that sample (1x16x16384, 4x8x8192, 1x4x65536, and 2x16x16384 at DK = DV = 64)
    these seeds held the best of 23 trials ("oos"). Configs restricted on ``arch`` are left out; the
    sampler explores everything else as before.
    """
    blocks_per_wave = sms or get_arch(arch).sms
    block_dv = max(d for d in choices(problem)["block_dv"] if d <= 128)
    lanes = problem.batch * problem.heads * (problem.dv // block_dv)
    segments = choices(problem)["segments"]
    one_wave = min(segments, key=lambda n: abs(math.log2(n * lanes / blocks_per_wave)))
    i = segments.index(one_wave)
    configs = [
        KernelConfig(64, block_dv, stages, 256, "smem", n)
        for n in segments[max(0, i - 1) : i + 2]
        for stages in (2, 3)
    ]
    return [c for c in configs if not violated(problem, c, arch)]
