"""``decay_attention``'s gated calls: a per-token log-gate ``g`` (fla's
``chunk_simple_gla(q, k, v, g=...)``; Mamba2's ``dt * A``), a per-head decay beside it or
not, and q and k in groups (Mamba2's ``ngroups``: G heads, v H = G r), on the gated forward
(``kernel.gated``). Registered as the torch custom op ``decay_tuner::gated_attention`` so
that it runs under ``torch.compile(fullgraph=True)``; an eager call on real tensors keeps a
plan per signature, as the constant-decay op does, and launches through it. Its config is
picked as the constant-decay op's (``kernel.ops.serve.kernel_job``): the served table's
entry of the per-token gate for its shape (``python -m tuner dispatch --gate token``),
else the rule's (``kernel.rule.gated_config``).

Differentiable in q, k, v, ``g`` and the initial state by ``kernel.ops.gated_backward``: on
CUDA passes of the gated kernel (``backward_by_passes``), on the CPU float32 torch; the
per-head decay is not learned, as in the constant-decay op.
"""

import functools
import math
from typing import Any

import torch

from kernel.builder import cuda_arch
from kernel.config import Call, Problem
from kernel.gated_build import TORCH_DTYPES, PassCall, compile_gated, pass_job
from kernel.ops import inputs
from kernel.ops.gated_backward import GatedPass, backward_by_passes, gated_backward
from kernel.ops.serve import PLANS, PLANS_MAX, kernel_job


def gated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: float | torch.Tensor | None,
    *,
    g: torch.Tensor | None,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``decay_attention`` with ``g`` or grouped q and k (its arguments and result)."""
    if not torch.compiler.is_compiling():
        try:
            key = _signature(q, k, v, g, decay, scale, initial_state, output_final_state, cu_seqlens)
            plan = PLANS.get(key)
        except (AttributeError, TypeError):  # not tensors where tensors go: checked below
            key = plan = None
        if plan is not None:
            return plan.run(q, k, v, g, decay, initial_state, cu_seqlens)
    per_head, alpha = (None, 1.0) if decay is None and g is not None else inputs.decay_parts(decay)
    inputs.check_arguments(scale, initial_state, output_final_state, cu_seqlens)
    sizes = inputs.check_group_tensors(q, k, v)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    args = (q, k, v, g, per_head, alpha, scale, initial_state, output_final_state, cu_seqlens)
    if torch.compiler.is_compiling() or type(q) is not torch.Tensor or q.is_meta:
        _check_shapes(sizes, q, g, per_head, alpha, initial_state, cu_seqlens)
        o, final = torch.ops.decay_tuner.gated_attention(*args)
        return o, (final if output_final_state else None)
    plan = _GatedPlan(*args)
    if key is not None:
        if len(PLANS) >= PLANS_MAX:
            PLANS.clear()
        PLANS[key] = plan
    return plan.run(q, k, v, g, decay, initial_state, cu_seqlens)


def _signature(q, k, v, g, decay, scale, initial_state, output_final_state, cu_seqlens) -> tuple:
    """What an eager call's checks and its kernel depend on but the values of its tensors
    (``"gated"`` first: the constant-decay op's plans share the table)."""
    return (
        "gated", *(_tensor(t) for t in (q, k, v)), None if g is None else _tensor(g), type(decay),
        _tensor(decay) if type(decay) is torch.Tensor else decay, type(scale), scale,
        type(output_final_state), output_final_state,
        None if initial_state is None else _tensor(initial_state),
        None if cu_seqlens is None else _tensor(cu_seqlens),
    )  # fmt: skip


def _tensor(t: torch.Tensor) -> tuple:
    return type(t), t.shape, t.dtype, t.device


def _check_shapes(sizes: inputs.Sizes, q, g, decay, alpha, initial_state, cu_seqlens) -> Any:
    """The checks of a call's gate, decay, offsets and state that need no values (those of
    q, k and v gave ``sizes``); the number of sequences (B, or N packed)."""
    inputs.check_gate(g, sizes, q.device)
    inputs.check_decay(decay, alpha, sizes.heads, q.device)
    n = sizes.batch
    if cu_seqlens is not None:
        inputs.check_offsets_shape(cu_seqlens, sizes, q.device)
        n = cu_seqlens.shape[0] - 1
    inputs.check_state(initial_state, sizes, n, q.device)
    return n


class _GatedPlan:
    """One eager signature checked, and what its calls run, found once: the compiled
    kernel, the log-decay of a float decay, the stand-ins for a gate or states not passed.
    Kept in ``kernel.ops.serve.PLANS``, which ``use_table`` empties."""

    __slots__ = (
        "sizes", "per_head", "gamma", "kernel", "zero_gate", "h0", "ht", "final_shape", "want_final", "scale"
    )  # fmt: skip

    def __init__(self, q, k, v, g, per_head, alpha, scale, initial_state, output_final_state, cu_seqlens):
        sizes = inputs.check_group_tensors(q, k, v)
        n = _check_shapes(sizes, q, g, per_head, alpha, initial_state, cu_seqlens)
        b, h, s, dk, dv = sizes
        self.sizes, self.per_head, self.want_final = sizes, per_head is not None, output_final_state
        self.scale = scale
        f32 = dict(dtype=torch.float32, device=q.device)
        # fla's g_gamma = log(decay): a float decay's is a constant of the plan (zeros for
        # none: one compiled kernel serves calls with a decay and without)
        self.gamma = torch.full((h,), math.log(alpha), **f32)
        packed = cu_seqlens is not None
        problem = Problem(b, h, s, dk, dv, TORCH_DTYPES[q.dtype], "token", q.shape[2])
        call = Call(scale, initial_state is not None, output_final_state, packed)
        job = kernel_job(problem, call, n)
        self.kernel = compile_gated(*job, arch=cuda_arch())
        self.zero_gate = torch.zeros(b, s, h, **f32) if g is None else None
        rows = 1 if packed else b * h  # the packed kernel's state rows are symbolic
        self.h0 = torch.empty(rows, 1, dk, dv, **f32) if initial_state is None else None
        self.ht = torch.empty(rows, 1, dk, dv, **f32) if not output_final_state else None
        self.final_shape = (n, h, dk, dv)

    def run(self, q, k, v, g, decay, initial_state, cu_seqlens) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The call: the values of a decay or offsets tensor checked once per version; through
        autograd only where it records the call."""
        args = (q, k, v, *self.gates(g, decay), initial_state, self.offsets(cu_seqlens))
        if inputs.wants_grad(q, k, v, g, decay, initial_state):
            return _GatedFn.apply(self, *args)
        return self.forward(*args)

    def gates(self, g, decay) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's gate ``[B, S, H]`` and per-head log-decay ``[H]`` of a call."""
        gamma = torch.log(inputs.decay_values(decay)) if self.per_head else self.gamma
        return (self.zero_gate if g is None else g), gamma

    def offsets(self, cu_seqlens):
        return None if cu_seqlens is None else inputs.offsets_values(cu_seqlens, self.sizes)

    def backward_pass(self) -> GatedPass:
        """What the eager backward runs its passes on (``backward_by_passes``)."""
        return _kernel_pass(self.scale)

    def forward(
        self, q, k, v, gate, gamma, initial_state, cu_seqlens
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The launch on checked tensors: ``(o, final or None)``."""
        _, _, _, dk, dv = self.sizes
        final = (
            torch.empty(self.final_shape, dtype=torch.float32, device=q.device) if self.want_final else None
        )
        h0 = self.h0 if initial_state is None else initial_state.contiguous().view(-1, 1, dk, dv)
        ht = self.ht if final is None else final.view(-1, 1, dk, dv)
        o = torch.empty_like(v, memory_format=torch.contiguous_format)
        args = (q.contiguous(), k.contiguous(), v.contiguous(), gate.contiguous(), gamma, h0, o, ht)
        if cu_seqlens is None:
            self.kernel(*args)
        else:
            self.kernel(*args, cu_seqlens)
        return o, final


class _GatedFn(torch.autograd.Function):
    """An eager call of a kept ``_GatedPlan``: its checked tensors in, ``(o, final or None)``
    out; the backward is passes of the gated kernel (``backward_by_passes``) on the
    whole log-gate (``g`` plus the per-head log-decay)."""

    @staticmethod
    def forward(ctx: Any, plan: _GatedPlan, q, k, v, gate, gamma, initial_state, cu_seqlens):
        o, final = plan.forward(q, k, v, gate, gamma, initial_state, cu_seqlens)
        ctx.save_for_backward(q, k, v, gate, gamma, initial_state, cu_seqlens)
        ctx.plan = plan
        ctx.set_materialize_grads(False)  # a final state's gradient left None: a zero dHT
        return o, final

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor | None, dfinal: torch.Tensor | None = None) -> tuple:
        q, k, v, gate, gamma, initial_state, cu_seqlens = ctx.saved_tensors
        do = torch.zeros_like(v) if do is None else do
        dq, dk, dv, dg, dh0 = backward_by_passes(
            ctx.plan.backward_pass(), q, k, v, gate + gamma, do, scale=ctx.plan.scale,
            initial_state=initial_state, dht=dfinal, cu_seqlens=cu_seqlens,
        )  # fmt: skip
        return None, dq, dk, dv, dg, None, dh0, None


@functools.cache
def _kernel_pass(scale: float) -> GatedPass:
    """``backward_by_passes``'s gated forward on this GPU: ``kernel.gated``'s kernel in the
    backward's modes (``kernel.gated_build.PassCall``: float32 O where exact; backwards in
    time where asked) at the rule's config for the pass's heads (``pass_job``), opened as the
    forward's are (``compile_gated``: ``kernel.loader``'s index, what ``warmup`` compiled).
    One per scale a process; each pass's launch is found once per signature and kept, as
    the forward's plans are, with the zero per-head log-decay it reads (no fill a pass)."""
    kept: dict[tuple, tuple[Any, torch.Tensor]] = {}  # signature -> (launch, zero log-decays [H])

    def run(q, k, v, g, h0, want_final, cu_seqlens, reverse, exact):
        b, s, _, dk = q.shape
        heads, dv = v.shape[2], v.shape[3]
        packed = cu_seqlens is not None
        n = cu_seqlens.numel() - 1 if packed else b
        key = (
            q.shape[2:] if packed else q.shape,
            v.shape[2:],
            q.dtype,
            q.device,
            h0 is None,
            want_final,
            packed,
            reverse,
            exact,
        )
        found = kept.get(key)
        f32 = dict(dtype=torch.float32, device=q.device)
        if found is None:
            if len(kept) >= PLANS_MAX:
                kept.clear()
            job = pass_job_of(q, v, h0, want_final, cu_seqlens, reverse, exact, scale)
            # g is the whole log-gate: the kernel's per-head log-decay is zero, made once
            found = (compile_gated(*job, arch=cuda_arch()), torch.zeros(heads, **f32))
            if not torch.cuda.is_current_stream_capturing():  # else the zeros are the graph's to fill
                kept[key] = found
        launch, no_decay = found
        o = torch.empty(b, s, heads, dv, dtype=torch.float32 if exact else v.dtype, device=q.device)
        ht = torch.empty(n * heads, 1, dk, dv, **f32)
        start = ht if h0 is None else h0.reshape(-1, 1, dk, dv).contiguous()  # read only where given
        args = (q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), no_decay)
        launch(*args, start, o, ht, *(cu_seqlens.to(torch.int32),) if packed else ())
        return o, (ht.view(n, heads, dk, dv) if want_final else None)

    return run


def pass_job_of(q, v, h0, want_final: bool, cu_seqlens, reverse: bool, exact: bool, scale: float) -> tuple:
    """The job (``kernel.gated_build.pass_job``) of a backward pass on q ``[B, S, G, D]`` and
    v ``[B, S, H, D']``: what ``_kernel_pass`` opens, and ``tuner warmup --gate token
    --backward`` compiles (``kernel.gated_build.pass_jobs``)."""
    b, s, groups, dk = q.shape
    problem = Problem(b, v.shape[2], s, dk, v.shape[3], TORCH_DTYPES[q.dtype], "token", groups)
    call = PassCall(
        scale, h0 is not None, want_final, cu_seqlens is not None, reverse=reverse,
        out_dtype="float32" if exact else None,
    )  # fmt: skip
    return pass_job(problem, call)


def _gated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    decay: torch.Tensor | None,
    alpha: float,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's implementation: ``(o, final)``, final an empty ``(0,)`` tensor unless
    ``output_final_state``."""
    plan = _GatedPlan(q, k, v, g, decay, alpha, scale, initial_state, output_final_state, cu_seqlens)
    o, final = plan.forward(q, k, v, *plan.gates(g, decay), initial_state, plan.offsets(cu_seqlens))
    return o, (final if final is not None else q.new_empty(0, dtype=torch.float32))


_gated_op = torch.library.custom_op("decay_tuner::gated_attention", mutates_args=())(_gated)


@_gated_op.register_fake
def _(q, k, v, g, decay, alpha, scale, initial_state, output_final_state, cu_seqlens):
    sizes = inputs.check_group_tensors(q, k, v)
    n = _check_shapes(sizes, q, g, decay, alpha, initial_state, cu_seqlens)
    final = q.new_empty(
        (n, sizes.heads, sizes.dk, sizes.dv) if output_final_state else (0,), dtype=torch.float32
    )
    return v.new_empty(v.shape), final


def _log_gate(
    g: torch.Tensor | None, decay: torch.Tensor | None, alpha: float, v: torch.Tensor
) -> torch.Tensor:
    """The whole log-gate ``[B, S, H]`` of a call: ``g`` plus the per-head log-decay."""
    gamma = (
        torch.log(decay.float())
        if decay is not None
        else torch.full((v.shape[2],), math.log(alpha), device=v.device)
    )
    return gamma if g is None else g + gamma


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_total: torch.Tensor,
    do: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    dht: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward op's implementation: ``(dq, dk, dv, dg, dH0)``, dH0 an empty ``(0,)``
    tensor where the forward took no state. On a CPU (the op's tests), the float32 torch
    backward; on CUDA, ``_backward_cuda``."""
    dq, dk, dv, dg, dh0 = gated_backward(
        q, k, v, g_total, do, scale=scale, initial_state=initial_state, dht=dht, cu_seqlens=cu_seqlens
    )
    return dq, dk, dv, dg, (dh0 if initial_state is not None else q.new_empty(0, dtype=torch.float32))


_backward_op = torch.library.custom_op("decay_tuner::gated_attention_backward", mutates_args=())(_backward)


@_backward_op.register_kernel("cuda")
def _backward_cuda(q, k, v, g_total, do, scale, initial_state, dht, cu_seqlens):
    """The backward op on CUDA: passes of the gated kernel (``backward_by_passes``)."""
    dq, dk, dv, dg, dh0 = backward_by_passes(
        _kernel_pass(scale), q, k, v, g_total, do, scale=scale, initial_state=initial_state, dht=dht,
        cu_seqlens=cu_seqlens,
    )  # fmt: skip
    return dq, dk, dv, dg, (dh0 if dh0 is not None else q.new_empty(0, dtype=torch.float32))


@_backward_op.register_fake
def _(q, k, v, g_total, do, scale, initial_state, dht, cu_seqlens):
    dh0 = (
        torch.empty_like(initial_state) if initial_state is not None else q.new_empty(0, dtype=torch.float32)
    )
    return (
        torch.empty_like(q),
        torch.empty_like(k),
        torch.empty_like(v),
        do.new_empty(v.shape[:3], dtype=torch.float32),
        dh0,
    )


def _setup(ctx: Any, inputs: tuple, output: tuple) -> None:  # torch names the argument "inputs"
    q, k, v, g, decay, alpha, scale, initial_state, _, cu_seqlens = inputs
    ctx.save_for_backward(q, k, v, g, decay, initial_state, cu_seqlens)
    ctx.alpha, ctx.scale = alpha, scale


def _gradients(ctx: Any, do: torch.Tensor | None, dfinal: torch.Tensor | None) -> tuple:
    """The op's autograd rule: gradients for q, k, v, g and the initial state; none for the
    decay (not learned) or the offsets."""
    q, k, v, g, decay, initial_state, cu_seqlens = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do
    dht = dfinal if dfinal is not None and dfinal.numel() else None  # the (0,) stand-in: no state
    g_total = _log_gate(g, decay, ctx.alpha, v).expand(v.shape[:3]).contiguous()
    dq, dk, dv, dg, dh0 = torch.ops.decay_tuner.gated_attention_backward(
        q, k, v, g_total, do, ctx.scale, initial_state, dht, cu_seqlens
    )
    dg = dg if g is not None else None
    return dq, dk, dv, dg, None, None, None, (dh0 if initial_state is not None else None), None, None


torch.library.register_autograd("decay_tuner::gated_attention", _gradients, setup_context=_setup)
