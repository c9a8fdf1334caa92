"""Shared by the H200 same-run comparisons of a kernel's module-level modes
(``qweights.py``, ``split_parts.py``)."""

import multiprocessing
import os
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ProcessPoolExecutor
from functools import partial

from kernel import KernelConfig, Problem, probe
from kernel.build import cuda_arch
from kernel.resources import ProbeResult

Case = tuple[Problem, KernelConfig]


def _probe(case: Case, arch: str) -> ProbeResult:
    return probe(*case, arch=arch)


def probe_modes(
    modes: Sequence[Hashable],
    set_mode: Callable[[Hashable], None],
    cases: Sequence[Case],
    arch: str | None = None,
) -> dict[tuple, ProbeResult]:
    """Compile every case under every mode, in spawned processes that each call
    ``set_mode(mode)`` first, for ``arch`` (default: the current GPU's);
    ``{(mode, problem, config): probe result}``."""
    arch = arch or cuda_arch()
    ctx = multiprocessing.get_context("spawn")
    probes = {}
    for mode in modes:
        with ProcessPoolExecutor(
            os.cpu_count(), mp_context=ctx, initializer=set_mode, initargs=(mode,)
        ) as pool:
            probes |= {
                (mode, *case): res for case, res in zip(cases, pool.map(partial(_probe, arch=arch), cases))
            }
    return probes
