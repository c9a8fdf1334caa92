"""The search space: one table of choices derived from the problem, plus named restrictions.

Restrictions are cheap predicates on a config, checked before any compile. Everything the
compiler decides (layout failures, spills, shared memory) is left to the probe, which
records it as a value.
"""

import itertools
from collections.abc import Callable, Iterator

from optuna.distributions import CategoricalDistribution

from kernel import KernelConfig, Problem
from kernel.config import HEAD_DIM_MULTIPLE, SCORES

CHUNKS = (32, 64, 128)
STAGES = (1, 2, 3, 4)
THREADS = (128, 256)
# 1: the seed's single-pass kernel; n > 1: the sequence-split variant (kernel.seq_split).
SEGMENTS = (1, 2, 4, 8, 16, 32, 64)


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
