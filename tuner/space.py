"""The search space: one table of choices derived from the problem, plus named restrictions.

Restrictions are cheap predicates on a config, checked before any compile. Everything the
compiler decides (layout failures, spills, shared memory) is left to the probe, which
records it as a value.
"""

import itertools
import math
from collections.abc import Callable, Iterator

from optuna.distributions import CategoricalDistribution

from kernel import KernelConfig, Problem
from kernel.config import HEAD_DIM_MULTIPLE, SCORES, SEGMENT_COUNTS

CHUNKS = (32, 64, 128)
STAGES = (1, 2, 3, 4)
THREADS = (128, 256)
SEGMENTS = SEGMENT_COUNTS


def choices(problem: Problem) -> dict[str, tuple]:
    """Knob name -> choices. block_dv runs over the divisors of DV that tile for wgmma."""
    block_dvs = tuple(
        d for d in range(HEAD_DIM_MULTIPLE, problem.dv + 1, HEAD_DIM_MULTIPLE) if problem.dv % d == 0
    )
    return {
        "chunk": CHUNKS,
        "block_dv": block_dvs,
        "num_stages": STAGES,
        "threads": THREADS,
        "scores": SCORES,
        "segments": SEGMENTS,
    }


def distributions(problem: Problem) -> dict[str, CategoricalDistribution]:
    return {name: CategoricalDistribution(values) for name, values in choices(problem).items()}


# Named restrictions: name -> predicate(problem, config) that is True when the config is allowed.
RESTRICTIONS: dict[str, Callable[[Problem, KernelConfig], bool]] = {
    "block_dv divides dv": lambda p, c: p.dv % c.block_dv == 0,
    # The pipeline cannot be deeper than the number of chunks it overlaps.
    "stages <= chunks per segment": lambda p, c: c.pipeline_fits(p),
    "seq-split makes at least two segments": lambda p, c: (
        c.segments == 1 or c.segment_length(p.seqlen) < p.seqlen
    ),
}


def violated(problem: Problem, config: KernelConfig) -> list[str]:
    """Names of the restrictions ``config`` breaks for ``problem``."""
    return [name for name, allowed in RESTRICTIONS.items() if not allowed(problem, config)]


def grid(problem: Problem) -> Iterator[KernelConfig]:
    """Every config of the table, restricted or not, in a fixed order."""
    table = choices(problem)
    for values in itertools.product(*table.values()):
        yield KernelConfig(**dict(zip(table, values)))


H200_SMS = 132  # the SM count assumed where no GPU is visible (compile-only runs target sm_90a)


def wave_seeds(problem: Problem, sms: int = H200_SMS) -> list[KernelConfig]:
    """Configs worth measuring first: the family that won at every shape tuned on the H200
    (64-token chunks, the widest block_dv up to 128, 256 threads, scores in shared memory,
    2 or 3 stages), with the segment count whose grid is nearest one wave of blocks (one
    per SM, as these configs' ~190 KB of shared memory allows), and its two neighbours.

    At the four shapes tuned on the H200 (8x16x4096, 2x16x16384, 1x8x32768, 4x16x8192) the
    best config launched 128 blocks (reports/h200/README.md, "retable"); at four shapes
    outside that sample (1x16x16384, 4x8x8192, 1x4x65536, and 2x16x16384 at DK = DV = 64)
    these seeds held the best of 23 trials ("oos"). Restricted configs are left out; the
    sampler explores everything else as before.
    """
    block_dv = max(d for d in choices(problem)["block_dv"] if d <= 128)
    lanes = problem.batch * problem.heads * (problem.dv // block_dv)
    one_wave = min(SEGMENTS, key=lambda n: abs(math.log2(n * lanes / sms)))
    i = SEGMENTS.index(one_wave)
    configs = [
        KernelConfig(64, block_dv, stages, 256, "smem", segments)
        for segments in SEGMENTS[max(0, i - 1) : i + 2]
        for stages in (2, 3)
    ]
    return [c for c in configs if not violated(problem, c)]
