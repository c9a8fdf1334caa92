"""The forward a model calls: ``decay_attention``, a drop-in for the forward of fla's
``chunk_simple_gla`` for a constant decay per head, registered as the torch custom op
``decay_tuner::decay_attention`` so that it runs under ``torch.compile(fullgraph=True)``
and inside a captured CUDA graph. It is differentiable in q, k, v and the initial state:
its autograd rule is the op ``decay_tuner::decay_attention_backward``, passes of the same
kernel (``kernel.ops.backward``; dk and dv in one where ``kernel.dkdv`` serves). Called
eagerly on real tensors, the same two implementations run under a plain
``torch.autograd.Function`` instead, without the host time of torch's dispatch of the
ops; there a split forward also keeps the state entering each segment for the
backward's dq pass (``_gradients``), which the ops do not.

fla's arguments map one to one: ``g`` (a log-gate per token) is ``g``, served by the gated
forward (``kernel.ops.gated``); ``g_gamma`` (log-decay per head) is ``log(decay)``, i.e.
``decay = exp(g_gamma)``; ``scale``, ``initial_state`` and ``output_final_state`` mean the
same, and the state is fp32 ``[B, H, DK, DV]`` in both; ``cu_seqlens`` packs sequences as
fla's does (q, k, v ``[1, T, H, D]``, states ``[N, H, DK, DV]``).
"""

from typing import Any, NamedTuple

import torch

from kernel.config import Call, KernelConfig, Problem
from kernel.ops import inputs
from kernel.ops.backward import backward
from kernel.ops.gated import gated_attention
from kernel.ops.pool import pool_attention
from kernel.ops.serve import PLANS, PLANS_MAX, fuses_here, kernel_for
from kernel.variants import launch, same_segments, unused_state

# A split forward's config and the state entering each of its segments, which the
# backward's dq pass reads instead of computing them again.
Split = tuple[KernelConfig, torch.Tensor]
_PLANS, _PLANS_MAX = PLANS, PLANS_MAX


def decay_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: float | torch.Tensor | None = None,
    *,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    pool: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    from_pool: torch.Tensor | None = None,
    decodes: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``o_t = (scale * q_t) S_t`` with ``S_t = decay_h * S_{t-1} + k_t^T v_t`` per head
    (with ``g``: ``S_t = exp(g_t) * decay_h * S_{t-1} + k_t^T v_t``).

    Args:
        q, k: ``[B, S, H, DK]``; v: ``[B, S, H, DV]``; float16 or bfloat16 CUDA tensors.
            With ``g``, or where q and k hold fewer heads than v, q and k are ``[B, S, G,
            DK]`` and v ``[B, S, H, DV]``, H a multiple of G: head h reads group ``h // (H //
            G)`` (Mamba2's ``ngroups``) (``kernel.ops.gated``).
        decay: a float in (0, 1], or a tensor ``[H]`` of one alpha per head in (0, 1]; may
            be None (no decay but ``g``'s) where ``g`` is given.
        g: fp32 ``[B, S, H]`` (packed ``[1, T, H]``), a log-gate per token and head (<= 0;
            not checked: that would wait for the GPU), as fla's ``chunk_simple_gla(g=...)``
            takes it; with ``decay`` too, their log-decays add (fla's ``g`` and ``g_gamma =
            log(decay)``). Differentiable in ``g`` too (``kernel.ops.gated_backward``).
        scale: multiplies the queries (default ``DK ** -0.5``, as fla).
        initial_state: fp32 ``[B, H, DK, DV]``, the state before the first token (default zero).
        output_final_state: return the state after the last token.
        cu_seqlens: packed sequences, an int32 (or int64) tensor ``[N + 1]`` of offsets
            from 0 to T, strictly increasing, with q, k, v ``[1, T, H, D]`` and states
            ``[N, H, DK, DV]``; no state crosses from one sequence to the next.
        pool: packed sequences whose states live in a server's pool, fp32 ``[P, H, DK, DV]``,
            contiguous: sequence n starts from ``pool[slots[n]]`` where ``from_pool[n]``,
            else from zero, and its final state is written there in place; a slot outside
            ``[0, P)`` (-1: padding) touches no state. Inference only; no
            ``initial_state`` or ``output_final_state`` (``kernel.ops.pool``).
        slots: int32 (or int64) ``[N]``, the pool row of each sequence (with ``pool``).
        from_pool: bool ``[N]`` (with ``pool``): true where a sequence goes on from its slot.
        decodes: the first ``decodes`` sequences have one token each (decodes before
            prefills, as vLLM orders them): they run on the decode step
            (``kernel.ops.decode``), the rest on the packed kernel, in one call.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, S, H, DV]`` in q's dtype, and the fp32
        ``[B, H, DK, DV]`` state after the last token when ``output_final_state``, else None.

    A wrong input raises ``ValueError`` before anything is launched. Each scale is a
    constant of the kernels (compiled once per value), where the decay is read at run time.
    """
    pooled = (
        pool is not None or slots is not None or from_pool is not None or type(decodes) is not int or decodes
    )
    if inputs.grouped(q, v) or (g is not None and not pooled):
        if pooled:
            raise ValueError("a pool call (pool, slots, from_pool, decodes) takes no grouped q and k yet")
        return gated_attention(
            q, k, v, decay, g=g, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        )  # fmt: skip
    if pooled:
        if pool is None or slots is None or from_pool is None:
            raise ValueError(
                "a pool call takes pool, slots and from_pool together (and decodes only with them)"
            )
        if initial_state is not None or output_final_state is not False:
            raise ValueError(
                "a pool call's states are the pool's: pass no initial_state or output_final_state"
            )
        o = pool_attention(
            q, k, v, decay, pool=pool, slots=slots, from_pool=from_pool, cu_seqlens=cu_seqlens,
            decodes=decodes, scale=scale, g=g,
        )  # fmt: skip
        return o, None
    if not torch.compiler.is_compiling():
        # An eager call of a signature served before: its checks passed then, and what
        # they found is kept (``_Plan``); the values of tensors are checked as they change.
        try:
            key = _signature(q, k, v, decay, scale, initial_state, output_final_state, cu_seqlens)
            plan = _PLANS.get(key)
        except (AttributeError, TypeError):  # not tensors where tensors go: checked below
            key = plan = None
        if plan is not None:
            return plan.run(q, k, v, decay, initial_state, cu_seqlens)
    per_head, alpha = inputs.decay_parts(decay)
    inputs.check_arguments(scale, initial_state, output_final_state, cu_seqlens)
    inputs.check_tensors(q, k, v)  # no Problem: torch.compile traces this function
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    args = (q, k, v, per_head, alpha, scale, initial_state, output_final_state, cu_seqlens)
    # Traced (torch.compile, fake or meta tensors): the op, whose fake implementation gives
    # the shapes. Called on real tensors: the same implementation, without the op's dispatch.
    traced = torch.compiler.is_compiling() or type(q) is not torch.Tensor or q.is_meta
    if traced:
        o, final = torch.ops.decay_tuner.decay_attention(*args)
        return o, (final if output_final_state else None)
    plan = _Plan(*args)
    if key is not None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan.run(q, k, v, decay, initial_state, cu_seqlens)


def _signature(q, k, v, decay, scale, initial_state, output_final_state, cu_seqlens) -> tuple:
    """What an eager call's checks and its kernel depend on but the values of its tensors:
    the types (so that ``True`` is not ``1``), shapes, dtypes and devices."""
    return (
        type(q), type(k), type(v), q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
        q.device, k.device, v.device, type(decay),
        (decay.shape, decay.dtype, decay.device) if type(decay) is torch.Tensor else decay,
        type(scale), scale, type(output_final_state), output_final_state,
        None if initial_state is None else _tensor_signature(initial_state),
        None if cu_seqlens is None else _tensor_signature(cu_seqlens),
    )  # fmt: skip


def _tensor_signature(t: torch.Tensor) -> tuple:
    return type(t), t.shape, t.dtype, t.device


class _Plan:
    """One eager signature (``_signature``) checked, and what its calls run, found once:
    the problem, the kernel serving it with its launch arguments, the decay of a float,
    the stand-ins for a state not passed, and the backward's kernels as it first runs
    them. Kept in ``kernel.ops.serve.PLANS``, which ``use_table`` empties."""

    __slots__ = (
        "problem", "sequences", "call", "alpha", "scale", "per_head", "kern", "decay", "launch",
        "unused", "final_shape", "want_final", "passes",
    )  # fmt: skip

    def __init__(self, q, k, v, per_head, alpha, scale, initial_state, output_final_state, cu_seqlens):
        problem = inputs.check_qkv(q, k, v)
        self.decay = inputs.decay_tensor(per_head, alpha, problem.heads, q.device)
        sequences = problem.batch
        if cu_seqlens is not None:
            inputs.check_offsets(cu_seqlens, problem, q.device)
            sequences = cu_seqlens.numel() - 1
        inputs.check_state(initial_state, problem, sequences, q.device)
        self.problem, self.sequences, self.per_head = problem, sequences, per_head is not None
        self.call = Call(scale, initial_state is not None, output_final_state, cu_seqlens is not None)
        self.alpha, self.scale, self.want_final = alpha, scale, output_final_state
        self.kern = kern = kernel_for(problem, self.call, sequences)
        self.launch = (kern.problem, kern.config, kern.call, kern.launchers or kern.compiled)
        self.unused = unused_state(kern.problem, q.device)
        self.final_shape = (sequences, problem.heads, problem.dk, problem.dv)
        self.passes: dict[tuple | str, Any] = {}

    def run(self, q, k, v, decay, initial_state, cu_seqlens) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The call: the values of a decay or offsets tensor checked once per version; through
        autograd only where it records the call."""
        recorded = inputs.wants_grad(q, k, v, decay, initial_state)
        if self.per_head:
            decay = inputs.decay_values(decay)
        else:
            decay = self.decay
        if cu_seqlens is not None:
            cu_seqlens = inputs.offsets_values(cu_seqlens, self.problem)
        if not recorded:
            o, final, _ = self.forward(q, k, v, decay, initial_state, cu_seqlens)
            return o, final
        if self.want_final:
            return _EagerPlan.apply(self, q, k, v, decay, initial_state, cu_seqlens)
        return _EagerPlan.apply(self, q, k, v, decay, initial_state, cu_seqlens), None

    def forward(self, q, k, v, decay, initial_state, cu_seqlens):
        """``(o, final or None, Split or None)`` on the checked tensors."""
        final = ht = None
        if self.want_final:
            final = torch.empty(self.final_shape, dtype=torch.float32, device=q.device)
            ht = final.view(-1, 1, self.problem.dk, self.problem.dv)
        h0 = self.unused if initial_state is None else initial_state.contiguous().view(ht_shape(self.problem))
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o = torch.empty_like(v, memory_format=torch.contiguous_format)
        states = launch(*self.launch, q, k, v, decay, h0, o, self.unused if ht is None else ht, cu_seqlens)
        return o, final, (None if states is None else (self.kern.config, states))


def ht_shape(problem: Problem) -> tuple[int, int, int, int]:
    """A state's shape as the kernels declare it, ``[rows, 1, DK, DV]``."""
    return (-1, 1, problem.dk, problem.dv)


class _EagerPlan(torch.autograd.Function):
    """``_Eager`` for a call of a kept ``_Plan``: its checked tensors in, ``o`` (and the
    final state where the call asks for it) out."""

    @staticmethod
    def forward(ctx: Any, plan: "_Plan", q, k, v, decay, initial_state, cu_seqlens):
        o, final, split = plan.forward(q, k, v, decay, initial_state, cu_seqlens)
        config, states = (None, None) if split is None else split
        ctx.save_for_backward(q, k, v, decay, initial_state, cu_seqlens, states)
        ctx.plan, ctx.split_config = plan, config
        ctx.set_materialize_grads(False)  # a final state's gradient left None: no zeros made
        return (o, final) if plan.want_final else o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor | None, dfinal: torch.Tensor | None = None) -> tuple:
        q, k, v, decay, initial_state, cu_seqlens, states = ctx.saved_tensors
        plan = ctx.plan
        do = torch.zeros_like(v) if do is None else do
        g = _Grads(q, k, v, do, decay, 1.0, plan.scale, initial_state, dfinal, cu_seqlens)
        split = None if states is None else (ctx.split_config, states)
        dq, dk, dv, dh0 = _passes(g, split, plan.passes, zero_start=plan.want_final and dfinal is None)
        return None, dq, dk, dv, None, (dh0 if initial_state is not None else None), None


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor | None,
    alpha: float,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's implementation: ``(o, final)``, final an empty ``(0,)`` tensor unless
    ``output_final_state``."""
    o, final, _ = _forward(q, k, v, decay, alpha, scale, initial_state, output_final_state, cu_seqlens)
    return o, final


def _forward(*args: Any) -> tuple[torch.Tensor, torch.Tensor, Split | None]:
    """``_attention``, and the forward's ``Split`` where it ran split."""
    q, k, v, decay, alpha, scale, initial_state, output_final_state, cu_seqlens = args
    problem = inputs.check_qkv(q, k, v)
    decay = inputs.decay_tensor(decay, alpha, problem.heads, q.device)
    sequences = problem.batch
    if cu_seqlens is not None:
        cu_seqlens = inputs.check_offsets(cu_seqlens, problem, q.device)
        sequences = cu_seqlens.numel() - 1
    inputs.check_state(initial_state, problem, sequences, q.device)
    call = Call(scale, initial_state is not None, output_final_state, cu_seqlens is not None)
    final = _empty_state(q, problem, sequences, output_final_state)
    kern = kernel_for(problem, call, sequences)
    o, states = kern.run(  # checked above: no second check
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        decay,
        initial_state=None if initial_state is None else initial_state.contiguous(),
        final_state=final if output_final_state else None,
        cu_seqlens=cu_seqlens,
    )
    return o, final, (None if states is None else (kern.config, states))


_attention_op = torch.library.custom_op("decay_tuner::decay_attention", mutates_args=())(_attention)


@_attention_op.register_fake
def _(q, k, v, decay, alpha, scale, initial_state, output_final_state, cu_seqlens):
    inputs.check_tensors(q, k, v)  # the checks that need no values, as _forward's
    p = inputs.sizes(q, v)
    inputs.check_decay(decay, alpha, p.heads, q.device)
    n = p.batch
    if cu_seqlens is not None:
        inputs.check_offsets_shape(cu_seqlens, p, q.device)
        n = cu_seqlens.shape[0] - 1
    inputs.check_state(initial_state, p, n, q.device)
    final = q.new_empty((n, p.heads, p.dk, p.dv) if output_final_state else (0,), dtype=torch.float32)
    return q.new_empty(p.batch, p.seqlen, p.heads, p.dv), final


class _Grads(NamedTuple):
    """What the backward reads: the forward's checked inputs and the outputs' gradients."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    decay: torch.Tensor | None
    alpha: float
    scale: float
    initial_state: torch.Tensor | None
    dht: torch.Tensor | None
    cu_seqlens: torch.Tensor | None


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    decay: torch.Tensor | None,
    alpha: float,
    scale: float,
    initial_state: torch.Tensor | None,
    dht: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward op's implementation: ``(dq, dk, dv, dH0)`` by the kernel's passes
    (``kernel.ops.backward``) on the inputs the forward checked; dH0 is an empty ``(0,)``
    tensor where the forward took no state."""
    return _passes(_Grads(q, k, v, do, decay, alpha, scale, initial_state, dht, cu_seqlens), None)


def _passes(
    g: _Grads, split: Split | None, kept: dict[tuple | str, Any] | None = None, zero_start: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_backward``, given the forward's ``Split`` where it ran split (an eager call
    keeps it): the dq pass, the forward on (dO, V, K), has the forward's states
    transposed, so where it cuts the sequence into the same segments it reads them and
    runs its outputs kernel alone. ``kept``: the kernel of each pass, by what decides it
    (an eager ``_Plan``'s, filled on its first backward). ``zero_start``: the forward
    returned its final state but no gradient reached it; the reversed passes run the
    kernels a final state's backward runs (those ``warmup`` compiled) from a kept zero
    state, where dividing a zero gradient would cost launches."""
    if kept is None:
        decay = inputs.decay_tensor(g.decay, g.alpha, g.q.shape[2], g.q.device)
    else:  # an eager plan's: the fp32 decay its forward checked and ran
        decay = g.decay
    cu = None if g.cu_seqlens is None else g.cu_seqlens.to(torch.int32)
    q, k, v, do = g.q.contiguous(), g.k.contiguous(), g.v.contiguous(), g.do.contiguous()
    problem = inputs.shape_problem(q.shape, v.shape[-1], q.dtype)
    sequences = problem.batch if cu is None else cu.numel() - 1
    scale = g.scale
    kept = {} if kept is None else kept

    def kernel(p: Problem, *flags: bool) -> Any:
        key = (p.dk, *flags)  # DK tells the dq and dk passes' (DV, DK) from the others
        kern = kept.get(key)
        if kern is None:
            kern = kept[key] = kernel_for(p, Call(scale, *flags[:4], dkdv=flags[4]), sequences)
        return kern

    def zeros() -> torch.Tensor:
        """The reversed passes' zero start (``zero_start``), made once per plan."""
        start = kept.get("zero")
        if start is None:
            start = torch.zeros(sequences * problem.heads * problem.dk * problem.dv, device=q.device)
            if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):  # else the graph's
                kept["zero"] = start
        return start

    def forward_pass(q_, k_, v_, h0, want_final, offsets, reverse):
        p = problem if q_ is q else inputs.shape_problem(q_.shape, v_.shape[-1], q_.dtype)
        if reverse and zero_start and h0 is None:
            h0 = zeros()
        final = _empty_state(q, p, sequences, True) if want_final else None
        kern, states = kernel(p, h0 is not None, want_final, offsets is not None, reverse, False), None
        if split is not None and not reverse and same_segments(kern.config, split[0], p.seqlen):
            states = split[1].transpose(-1, -2).contiguous()  # the dq pass's states
        return kern.run(q_, k_, v_, decay, h0, final, None, offsets, states)[0], final

    def fused(q_, k_, v_, do_, start, want_final, offsets):
        final = _empty_state(q, problem, sequences, True) if want_final else None
        if zero_start and start is None:
            start = zeros()
        kern = kernel(problem, start is not None, want_final, offsets is not None, True, True)
        return *kern.run_dkdv(q_, k_, v_, do_, decay, start, final, offsets), final

    dq, dk, dv, dh0 = backward(
        forward_pass,
        q,
        k,
        v,
        do,
        decay,
        scale,
        initial_state=None if g.initial_state is None else g.initial_state.contiguous(),
        dht=g.dht,
        cu_seqlens=cu,
        want_dh0=g.initial_state is not None,
        fused=fused if fuses_here(problem) else None,
    )
    return dq, dk, dv, (torch.empty(0, dtype=torch.float32, device=q.device) if dh0 is None else dh0)


_backward_op = torch.library.custom_op("decay_tuner::decay_attention_backward", mutates_args=())(_backward)


@_backward_op.register_fake
def _(q, k, v, do, decay, alpha, scale, initial_state, dht, cu_seqlens):
    dh0 = (
        torch.empty_like(initial_state) if initial_state is not None else q.new_empty(0, dtype=torch.float32)
    )
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dh0


def _setup_backward(ctx: Any, inputs: tuple, output: tuple, split: Split | None = None) -> None:
    q, k, v, decay, alpha, scale, initial_state, _, cu_seqlens = inputs
    config, states = (None, None) if split is None else split
    ctx.save_for_backward(q, k, v, decay, initial_state, cu_seqlens, states)
    ctx.alpha, ctx.scale, ctx.split_config = alpha, scale, config


def _gradients(ctx: Any, do: torch.Tensor | None, dfinal: torch.Tensor | None, op: Any) -> tuple:
    """The autograd rule of the op ``decay_attention``: gradients for q, k, v and the
    initial state by the backward op ``op`` (which ``torch.compile`` traces); none for the
    decay (not learned) or the offsets."""
    q, k, v, decay, initial_state, cu_seqlens, _ = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do
    dht = dfinal if dfinal is not None and dfinal.numel() else None  # the (0,) stand-in: no state
    dq, dk, dv, dh0 = op(q, k, v, do, decay, ctx.alpha, ctx.scale, initial_state, dht, cu_seqlens)
    return dq, dk, dv, None, None, None, (dh0 if initial_state is not None else None), None, None


def _op_gradients(ctx: Any, do: torch.Tensor | None, dfinal: torch.Tensor | None) -> tuple:
    return _gradients(ctx, do, dfinal, torch.ops.decay_tuner.decay_attention_backward)


torch.library.register_autograd("decay_tuner::decay_attention", _op_gradients, setup_context=_setup_backward)


def _empty_state(q: torch.Tensor, problem: Problem, sequences: int, wanted: bool) -> torch.Tensor:
    shape = (sequences, problem.heads, problem.dk, problem.dv) if wanted else (0,)
    return torch.empty(shape, dtype=torch.float32, device=q.device)
