"""The decode step (``kernel.decode``) compiled: built for the current GPU, or probed for
an architecture with no GPU (registers, spills, shared memory, or the compiler's refusal)."""

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import as_completed
from dataclasses import dataclass
from typing import Any

import torch

from kernel.arch import DEFAULT_ARCH, local_arch
from kernel.decode import DecodeConfig, DecodeProblem, decode_step
from kernel.probe import ProbeResult, compile_funcs, probe_funcs
from kernel.processes import compile_pool


@dataclass(frozen=True)
class DecodeKernel:
    """One compiled decode step: ``run`` launches it on checked tensors (as
    ``kernel.ops.decode.decay_decode`` checks them), for any batch and pool size."""

    problem: DecodeProblem
    config: DecodeConfig
    compiled: Any  # tilelang.JITKernel

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        decay: torch.Tensor,
        slots: torch.Tensor,
        pool: torch.Tensor,
        out: torch.Tensor | None = None,
        gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One step: q, k ``[N, 1, H, DK]``; v ``[N, 1, H, DV]``; decay fp32 ``[H]``; slots
        ``[N]``; pool ``[P, H, DK, DV]``, updated in place at the valid slots; gate (a
        gated problem's, and only its) fp32 ``[N, 1, H]``; all contiguous on one CUDA
        device, of the problem's dtypes. Returns o ``[N, 1, H, DV]`` (into ``out`` where
        given): zero rows where the slot is outside ``[0, P)``."""
        if (gate is not None) != self.problem.gated:
            raise ValueError("a gated decode kernel takes a gate, and only it")
        if out is None:
            out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        if gate is None:
            self.compiled(q, k, v, decay, slots, pool, out)
        else:
            self.compiled(q, k, v, decay, gate, slots, pool, out)
        return out

    @property
    def source(self) -> str:
        """The generated CUDA source."""
        return self.compiled.get_kernel_source()


# (problem, config, arch) -> the compiled kernel: once a process (TileLang's disk cache
# keeps it across processes).
_BUILT: dict[tuple[DecodeProblem, DecodeConfig, str], Any] = {}


def build_decode(problem: DecodeProblem, config: DecodeConfig) -> DecodeKernel:
    """Compile the decode step for the current CUDA device (once a process). ``ValueError``
    for a config that cannot run ``problem``; ``RuntimeError`` with no CUDA device."""
    config.check_fits(problem)
    arch = local_arch()
    if arch is None:
        raise RuntimeError("no CUDA device is visible to torch")
    compiled = _BUILT.get((problem, config, arch))
    if compiled is None:
        compiled = _BUILT[problem, config, arch] = compile_decode(problem, config, arch)
    return DecodeKernel(problem, config, compiled)


def compile_decode(problem: DecodeProblem, config: DecodeConfig, arch: str = DEFAULT_ARCH) -> Any:
    """TileLang-compile the decode step for ``arch`` (needs nvcc, not a GPU), through
    TileLang's disk cache: a later ``build_decode`` on a GPU of ``arch`` is a cache hit."""
    config.check_fits(problem)
    (compiled,) = compile_funcs([decode_step(problem, config)], arch)
    return compiled


def precompile_decode(
    jobs: Sequence[tuple[DecodeProblem, DecodeConfig]],
    *,
    arch: str,
    workers: int | None = None,
    done: Callable[[], object] | None = None,
) -> list[ProbeResult]:
    """``probe_decode`` many (problem, config) jobs in parallel processes, in their order:
    each compiles through TileLang's disk cache, so a later ``build_decode`` of it on a GPU
    of ``arch`` is a cache hit. ``done`` is called as each job ends (a progress bar's update)."""
    if not jobs:
        return []
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    with compile_pool(workers) as pool:
        futures = [pool.submit(probe_decode, problem, config, arch=arch) for problem, config in jobs]
        if done is not None:
            for _ in as_completed(futures):
                done()
        return [future.result() for future in futures]


def probe_decode(problem: DecodeProblem, config: DecodeConfig, *, arch: str = DEFAULT_ARCH) -> ProbeResult:
    """Compile the decode step for ``arch`` and report its resources, or the compiler's
    failure (``kernel.probe.probe_funcs``); its ``seed_register_estimate`` is the fp32
    state elements one thread holds. ``ValueError`` for a config that cannot run
    ``problem``."""
    config.check_fits(problem)
    per_thread = math.ceil(problem.dk * config.block_dv / config.threads)
    return probe_funcs(lambda: [decode_step(problem, config)], arch=arch, seed_register_estimate=per_thread)
