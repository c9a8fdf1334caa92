"""Which kernels a config runs, and how one call launches them: the one place that tells
the single-pass kernel (``segments == 1``) from the sequence split, for the probe, the
compiler and the call alike."""

from typing import Any

from kernel.config import KernelConfig, Problem


def prim_funcs(problem: Problem, config: KernelConfig) -> list:
    """The ``@T.prim_func`` kernels of ``config``'s variant, in launch order."""
    from kernel import scalar_decay, seq_split  # TileLang: loaded when a kernel is built

    if config.segments == 1:
        return [scalar_decay.prim_func(problem, config)]
    return list(seq_split.prim_funcs(problem, config))


def launch(problem: Problem, config: KernelConfig, compiled: tuple[Any, ...], q, k, v, out) -> None:
    """Run the compiled kernels of ``prim_funcs`` once on checked tensors, into ``out``."""
    if config.segments == 1:
        (single,) = compiled
        single(q, k, v, out)
        return
    states_kernel, carry_kernel, outputs_kernel = compiled
    states = states_buffer(problem, config, q.device)
    states_kernel(k, v, states)
    if launches_carry(problem, config):
        carry_kernel(states)
    outputs_kernel(q, k, v, states, out)


def launches_carry(problem: Problem, config: KernelConfig) -> bool:
    """Whether the split's call runs its carry kernel: not with two segments, where
    ``States[1]`` is already the state entering segment 1."""
    return config.segment_count(problem.seqlen) > 2


def states_buffer(problem: Problem, config: KernelConfig, device: Any = "cuda"):
    """The split's fp32 ``[B*H, P, DK, DV]`` states (uninitialised): the states kernel's
    output, the carry's in-place prefix, the outputs kernel's input."""
    import torch

    p = problem
    return torch.empty(p.batch * p.heads, config.segment_count(p.seqlen), p.dk, p.dv, device=device)
