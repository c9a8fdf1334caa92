"""Which kernels a config runs, and how one call launches them: the one place that tells
the single-pass kernel (``segments == 1``) from the sequence split, from the backward's
fused pass (``Call.dkdv``) and from a per-token gate's forward (``Problem.gate``,
``kernel.gated``), for the probe, the compiler and the call alike."""

import dataclasses
from typing import Any

from kernel.arch import get_arch
from kernel.config import PLAIN_CALL, Call, KernelConfig, Problem, whole_chunks

# TileLang's compile options for every kernel. Shared-memory reuse is off: TileLang lets
# buffers whose lifetimes do not overlap share memory, and judges a lifetime by the last
# statement that names the buffer, but a wgmma issued there reads its operands after it.
# Where a sequence has one chunk the chunk loop is unrolled, and with reuse on, O_s took
# Kw_s's memory while the state's MMA still read Kw_s (and AT_cast K_s's): output and state
# wrong (measured: experiments/model/README.md). Where the loop is kept, no buffer is
# shared: reuse buys no memory there.
PASS_CONFIGS = {"tl.disable_shared_memory_reuse": True}


def pass_configs(arch: str) -> dict[str, bool]:
    """TileLang's compile options for ``arch``: ``PASS_CONFIGS``, and no warp
    specialisation where the architecture lacks the ``setmaxnreg`` it needs
    (``kernel.arch``)."""
    return PASS_CONFIGS | ({} if get_arch(arch).setmaxnreg else {"tl.disable_warp_specialized": True})


def shape_generic(problem: Problem, config: KernelConfig, arch: str) -> Problem:
    """The problem a kernel of ``config`` compiled for ``arch`` is keyed by, in place of
    ``problem``. Where the architecture has ``symbolic_shapes`` (``kernel.arch``), every
    kernel takes its batch size and sequence length (packed: its token and sequence counts)
    from its tensors at launch, so one compiled kernel serves every B and S of a head
    count, DK, DV, dtype and chunk class (``kernel.config.whole_chunks``: S a
    multiple of the chunk, or not): the key is the class's smallest shape, B = 1 and S = C
    or 1. Elsewhere dense kernels are compiled per shape. The head count stays a
    compile-time constant: a model's is fixed, and with B, H and S all symbolic TileLang
    0.1.15 fails to lower the split's transposed outputs kernel ("[ThreadSync] Cannot lower
    a required shared-memory sync inside a divergent region"). A per-token gate's kernel
    counts every chunk's tokens at run time: one class, S = 1."""
    if not get_arch(arch).symbolic_shapes:
        return problem
    seqlen = config.chunk if whole_chunks(problem, config.chunk) and problem.gate == "head" else 1
    return dataclasses.replace(problem, batch=1, seqlen=seqlen)


def prim_funcs(problem: Problem, config: KernelConfig, call: Call = PLAIN_CALL, *, arch: str) -> list:
    """The ``@T.prim_func`` kernels of ``config``'s variant for ``arch`` (a name of
    ``kernel.arch.ARCHS``), in launch order."""
    from kernel import dkdv, gated, scalar_decay, seq_split  # TileLang: loaded when a kernel is built

    if problem.gate == "token":
        return [gated.prim_func(problem, config, call, arch=arch)]
    knobs = call.to_dict()
    slots = knobs.pop("slots")  # a pool's: the packed single-pass kernel's alone (``Call``)
    if knobs.pop("dkdv"):
        del knobs["reverse"]
        return dkdv.prim_funcs(problem, config, arch=arch, **knobs)
    if call.packed and config != packed_config(config, arch):
        raise ValueError(
            f"packed sequences run the single-pass kernel, with one stage where TileLang does not "
            f"warp-specialise ({arch}): got segments={config.segments}, num_stages={config.num_stages}"
        )
    if config.segments == 1:
        return [scalar_decay.prim_func(problem, config, arch=arch, slots=slots, **knobs)]
    del knobs["packed"]
    return list(seq_split.prim_funcs(problem, config, **knobs, arch=arch))


def packed_config(config: KernelConfig, arch: str) -> KernelConfig:
    """What a config runs as for packed sequences on ``arch``: the single-pass kernel, and
    one stage where the pipeline is not warp-specialised (``pass_configs``). TileLang
    0.1.15 software-pipelines a loop of a sequence-dependent length only when it
    warp-specialises it; elsewhere lowering fails ("Downcast from tirx.Sub to ir.IntImm",
    sm_80 and sm_89 with 2 stages)."""
    stages = config.num_stages if get_arch(arch).setmaxnreg else 1
    return dataclasses.replace(config, segments=1, num_stages=stages)


def launch(
    problem: Problem,
    config: KernelConfig,
    call: Call,
    compiled: tuple[Any, ...],
    q,
    k,
    v,
    decay,
    h0,
    out,
    ht,
    cu_seqlens=None,
    states=None,
):
    """Run the compiled kernels of ``prim_funcs`` once on checked tensors: ``decay`` fp32
    ``[H]``; ``h0`` and ``ht`` fp32 ``[B*H, 1, DK, DV]`` (read, or written, only where
    ``call`` asks for a state in, or out); the outputs into ``out``. A packed call passes
    its int32 ``cu_seqlens`` and states ``[N*H, 1, DK, DV]``. Split, ``states`` may give
    the state entering each segment, carried (``states_buffer``'s shape): then only the
    outputs kernel runs. Returns the split's states (None single-pass)."""
    if config.segments == 1:
        (single,) = compiled
        single(q, k, v, decay, h0, out, ht, *([cu_seqlens] if call.packed else []))
        return None
    states_kernel, carry_kernel, outputs_kernel = compiled
    if states is None:
        states = states_buffer(problem, config, q.device)
        states_kernel(k, v, decay, h0, states)
        if launches_carry(problem, config, call):
            carry_kernel(k, decay, states)
    outputs_kernel(q, k, v, decay, states, out, ht)
    return states


def launch_pool(compiled: tuple[Any, ...], q, k, v, decay, pool, out, cu_seqlens, slots, from_pool) -> None:
    """Run a pool call (``Call.slots``, ``kernel.scalar_decay.pool_fwd``) once on checked
    tensors: its one single-pass kernel, the fp32 pool viewed ``[P*H, 1, DK, DV]``, the
    slots ``[N]`` and the int8 flags ``[N]`` of the sequences that start from their slot."""
    (single,) = compiled
    single(q, k, v, decay, pool, out, cu_seqlens, slots, from_pool)


def same_segments(a: KernelConfig, b: KernelConfig, seqlen: int) -> bool:
    """Whether two split configs cut a sequence of ``seqlen`` tokens into the same segments
    and hold their states alike (``states_buffer``), so that one's states serve the other
    (the backward's dq pass reads the forward's, transposed: ``kernel.ops.attention``)."""
    return a.segments == b.segments > 1 and a.segment_length(seqlen) == b.segment_length(seqlen)


def launch_dkdv(
    problem: Problem,
    config: KernelConfig,
    call: Call,
    compiled: tuple[Any, ...],
    q,
    k,
    v,
    do,
    decay,
    h0,
    ht,
    dk,
    dv,
    cu_seqlens=None,
) -> None:
    """Run the fused pass (``call.dkdv``, ``kernel.dkdv``) once on checked tensors, as
    ``launch`` runs the forward: dK and dV into ``dk`` and ``dv``. Split, its states over
    (Q, dO) are the dv pass's."""
    if config.segments == 1:
        (single,) = compiled
        single(q, k, v, do, decay, h0, ht, dk, dv, *([cu_seqlens] if call.packed else []))
        return
    states_kernel, carry_kernel, outputs_kernel = compiled
    states = states_buffer(problem, config, q.device)
    states_kernel(q, do, decay, h0, states)
    if launches_carry(problem, config, call):
        carry_kernel(q, decay, states)
    outputs_kernel(q, k, v, do, decay, states, ht, dk, dv)


def launches_carry(problem: Problem, config: KernelConfig, call: Call = PLAIN_CALL) -> bool:
    """Whether the split's call runs its carry kernel: not with two segments and no
    initial state, where ``States[1]`` is already the state entering segment 1."""
    return config.segment_count(problem.seqlen) > 2 or call.initial_state


def states_buffer(problem: Problem, config: KernelConfig, device: Any = "cuda"):
    """The split's fp32 ``[B*H, config.segments, DK, DV]`` states (uninitialised), of which
    each (batch, head) uses the first ``config.segment_count(S)``: the states kernel's
    output, the carry's in-place prefix, the outputs kernel's input."""
    import torch

    p = problem
    shape = (p.batch * p.heads, config.segments, p.dk, p.dv)
    return torch.empty(shape, dtype=torch.float32, device=device)


_UNUSED: dict[tuple, Any] = {}  # (DK, DV, device) -> the kept buffer of unused_state


def unused_state(problem: Problem, device: Any = "cuda"):
    """An fp32 ``[B*H, 1, DK, DV]`` tensor of the shape the kernels declare H0 and HT, for
    a call with no state in, or out. The kernels never read or write it, so no call
    allocates one: each takes a prefix of one buffer per (DK, DV, device), kept as large
    as the largest call yet."""
    import torch

    p, rows = problem, problem.batch * problem.heads
    key = (p.dk, p.dv, torch.device(device))
    kept = _UNUSED.get(key)
    if kept is None or kept.shape[0] < rows:
        kept = _UNUSED[key] = torch.empty(rows, 1, p.dk, p.dv, dtype=torch.float32, device=device)
    return kept[:rows]
