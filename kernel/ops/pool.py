"""Packed sequences whose states live in a server's pool of slots: ``decay_attention(...,
pool=, slots=, from_pool=)`` reads each sequence's start state from its slot where its flag
asks (else it starts from zero: a new request needs no zeroing pass) and writes its final
state back there in place, with no gather or scatter in torch
(``kernel.scalar_decay.pool_fwd``). A batch of one-token decodes followed by prefills, as a
chunked-prefill server sends it, is one call: the host says how many sequences come first
with one token each (``decodes``, vLLM's ``num_decodes``), and those run on the decode
step (``kernel.decode``), the rest on the pool prefill, each kernel on its own part of the
same tensors, with no copy and no wait for the GPU. With ``g``, a per-token log-gate, the
prefills run on the gated pool forward (``kernel.gated.packed_gated_fwd`` with slots) and the decodes on
the gated decode step.

Registered as the torch custom op ``decay_tuner::decay_attention_pool``, which mutates the
pool, so that it runs under ``torch.compile(fullgraph=True)`` and inside a captured CUDA
graph; an eager call on real tensors runs the implementation without the op's dispatch.
Inference only: no autograd.
"""

import weakref
from typing import Any

import torch

from kernel.arch import local_arch
from kernel.config import Call, Problem
from kernel.constraints import rows_error
from kernel.decode import DecodeProblem
from kernel.gated_build import compile_gated
from kernel.ops import decode as ops_decode
from kernel.ops import inputs
from kernel.ops.serve import PLANS, PLANS_MAX, kernel_for
from kernel.rule import gated_config

FLAG_DTYPES = (torch.bool, torch.int8, torch.uint8, torch.int32, torch.int64)
# id -> (weak reference, version, decodes) of the cu_seqlens whose first ``decodes``
# sequences were read to have one token each: the read waits for the GPU, so once a version.
_HINTS: dict[int, tuple[weakref.ref, int, int]] = {}


def pool_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: float | torch.Tensor | None,
    *,
    pool: torch.Tensor,
    slots: torch.Tensor,
    from_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    decodes: int = 0,
    scale: float | None = None,
    g: torch.Tensor | None = None,
) -> torch.Tensor:
    """``decay_attention`` of packed sequences on a pool (its arguments: ``check_call``).
    Returns o ``[1, T, H, DV]`` in q's dtype; the pool's rows ``slots`` names hold the
    sequences' final states after it."""
    per_head, alpha = (None, 1.0) if decay is None and g is not None else inputs.decay_parts(decay)
    inputs.check_arguments(scale, None, False, cu_seqlens)
    _refuse_grad(q, k, v, per_head, g)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    if torch.compiler.is_compiling() or type(q) is not torch.Tensor or q.is_meta:
        check_call(q, k, v, pool, slots, from_pool, cu_seqlens, decodes, g)
        op = torch.ops.decay_tuner.decay_attention_pool
        return op(q, k, v, per_head, alpha, scale, pool, slots, from_pool, cu_seqlens, decodes, g)
    return _pooled(q, k, v, per_head, alpha, scale, pool, slots, from_pool, cu_seqlens, decodes, g)


def check_call(
    q: Any,
    k: Any,
    v: Any,
    pool: Any,
    slots: Any,
    from_pool: Any,
    cu_seqlens: Any,
    decodes: Any,
    g: Any = None,
) -> tuple[int, int, int, int, int, int]:
    """The checks that need no values, of a traced call too: q, k ``[1, T, H, DK]`` and v
    ``[1, T, H, DV]`` (``inputs.check_tensors``); ``cu_seqlens`` an int32 or int64 ``[N +
    1]``; the pool fp32 ``[P, H, DK, DV]``, contiguous; ``slots`` int32 or int64 ``[N]``;
    ``from_pool`` bool (or an integer dtype) ``[N]``; the gate None or fp32 ``[1, T, H]``
    (``inputs.check_gate``); all on q's device; ``decodes`` an int in ``[0, N]``, with T >= N
    (each sequence has a token) and T = N where every sequence is a decode; at most
    ``MAX_ROWS`` (prefill, head) pairs. Returns ``(T, N, H, DK, DV, P)``."""
    inputs.check_tensors(q, k, v)
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    Problem(*(x if type(x) is int else 64 for x in (b, h, t, dk, dv)), inputs.DTYPE_NAMES[q.dtype])
    inputs.check_gate(g, inputs.sizes(q, v), q.device)
    if b != 1:
        raise ValueError(f"with a pool, q, k, v must be packed [1, T, H, D], got a batch of {b}")
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError("a pool call packs its sequences: cu_seqlens must be an int32 tensor [N + 1]")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            "cu_seqlens must be an int32 or int64 tensor [N + 1], "
            f"got {cu_seqlens.dtype} {list(cu_seqlens.shape)}"
        )
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")
    n = cu_seqlens.shape[0] - 1
    if not isinstance(pool, torch.Tensor):
        raise ValueError(f"pool must be a tensor [P, H, DK, DV], got {_describe(pool)}")
    if pool.dim() != 4 or pool.shape[0] < 1 or tuple(pool.shape[1:]) != (h, dk, dv):
        raise ValueError(f"pool must be [P, {h}, {dk}, {dv}] with P >= 1, got {list(pool.shape)}")
    if pool.dtype != torch.float32:
        raise ValueError(f"a pool that packed sequences read and write must be float32, got {pool.dtype}")
    if pool.device != q.device:
        raise ValueError(f"pool is on {pool.device} but q is on {q.device}")
    if not pool.is_contiguous():
        raise ValueError(
            f"pool must be contiguous (it is written in place), got strides {list(pool.stride())}"
        )
    for name, t_, dtypes, what in (
        ("slots", slots, tuple(ops_decode.SLOT_DTYPES), "an int32 or int64"),
        ("from_pool", from_pool, FLAG_DTYPES, "a bool (or integer)"),
    ):
        if not isinstance(t_, torch.Tensor):
            raise ValueError(f"{name} must be {what} tensor [N], got {_describe(t_)}")
        if t_.dtype not in dtypes or tuple(t_.shape) != (n,):
            raise ValueError(f"{name} must be {what} tensor [{n}], got {t_.dtype} {list(t_.shape)}")
        if t_.device != q.device:
            raise ValueError(f"{name} is on {t_.device} but q is on {q.device}")
    if isinstance(decodes, bool) or not isinstance(decodes, int) or not 0 <= decodes <= n:
        raise ValueError(
            f"decodes must be an int in [0, N = {n}] (the one-token sequences first), got {decodes!r}"
        )
    if type(t) is int and type(n) is int:  # symbolic where torch.compile traces a new length
        if t < n or (decodes == n and t != n):
            raise ValueError(
                f"{n} sequences of which {decodes} have one token each cannot hold T = {t} tokens"
            )
    if type(n) is int and type(h) is int and (reason := rows_error(n - decodes, h, "prefill sequences")):
        raise ValueError(reason)
    return t, n, h, dk, dv, pool.shape[0]


class _Plan:
    """What an eager signature's calls run, found once: the decay of a float, the decode
    step's kernel for the first ``decodes`` sequences and the pool prefill's for the rest
    (either None where its part is empty); with a gate, the gated kernels and the log-decay
    of a float decay (``gamma``). Kept in ``kernel.ops.serve.PLANS``."""

    __slots__ = ("decode", "prefill", "decay", "gamma", "problem", "decodes", "sequences")

    def __init__(self, q, k, v, per_head, alpha, scale, pool, slots, from_pool, cu_seqlens, decodes, g):
        t, n, h, dk, dv, _ = check_call(q, k, v, pool, slots, from_pool, cu_seqlens, decodes, g)
        self.decay = inputs.decay_tensor(per_head, alpha, h, q.device)
        self.gamma = None if g is None else self.decay.log()  # the gated prefill's log-decay
        dtype, slot_dtype = inputs.DTYPE_NAMES[q.dtype], ops_decode.SLOT_DTYPES[slots.dtype]
        self.problem = Problem(1, h, t, dk, dv, dtype)
        self.decodes, self.sequences = decodes, n
        self.decode = self.prefill = None
        if decodes:
            step = DecodeProblem(h, dk, dv, dtype, "float32", slot_dtype, scale, g is not None)
            self.decode = ops_decode.kernel_for(step, decodes)
        if decodes < n:
            prefill = Problem(1, h, t - decodes, dk, dv, dtype)
            call = Call(scale, packed=True, slots=slot_dtype)
            if g is None:
                self.prefill = kernel_for(prefill, call, n - decodes)
            else:
                prefill = Problem(1, h, t - decodes, dk, dv, dtype, "token")
                config = gated_config(prefill)
                self.prefill = compile_gated(prefill, config, call, arch=local_arch())

    def run(self, q, k, v, decay, pool, slots, from_pool, cu_seqlens, g) -> torch.Tensor:
        d = self.decodes
        gamma = self.gamma
        if decay is not None:
            decay = inputs.decay_values(decay)
            gamma = None if g is None else decay.log()
        else:
            decay = self.decay
        if not torch.cuda.is_current_stream_capturing():
            cu_seqlens = inputs.offsets_values(cu_seqlens, self.problem)
            _check_decodes(cu_seqlens, d, self.sequences)
            if ops_decode.checking():
                ops_decode.check_slot_values(slots, pool.shape[0])
                _check_decode_flags(slots[:d], from_pool[:d], pool.shape[0])
        else:
            cu_seqlens = cu_seqlens.to(torch.int32).contiguous()
        q, k, v, slots = q.contiguous(), k.contiguous(), v.contiguous(), slots.contiguous()
        o = torch.empty_like(v, memory_format=torch.contiguous_format)
        g = None if g is None else g.contiguous()
        if self.decode is not None:  # tokens 0 .. d-1 as a step of d sequences: views, no copy
            step = [x[0, :d].unsqueeze(1) for x in (q, k, v, o)]
            gate = None if g is None else g[0, :d].unsqueeze(1)
            self.decode.run(*step[:3], decay, slots[:d], pool, step[3], gate=gate)
        if self.prefill is not None:
            flags = from_pool if from_pool.dtype == torch.bool else from_pool != 0
            flags = flags.contiguous().view(torch.int8)
            if g is None:
                self.prefill.run_pool(q, k, v, decay, pool, o, cu_seqlens[d:], slots[d:], flags[d:])
            else:
                rows = pool.view(-1, 1, *pool.shape[2:])
                self.prefill(q, k, v, g, gamma, rows, o, cu_seqlens[d:], slots[d:], flags[d:])
        return o


def _pooled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor | None,
    alpha: float,
    scale: float,
    pool: torch.Tensor,
    slots: torch.Tensor,
    from_pool: torch.Tensor,
    cu_seqlens: torch.Tensor,
    decodes: int,
    g: torch.Tensor | None = None,
) -> torch.Tensor:
    """The op's implementation: the checks of a new signature and its kernels found once
    (``_Plan``), then the launches."""
    try:
        tensors = (q, k, v, pool, slots, from_pool, cu_seqlens, decay, g)
        key = ("pool", *(_tensor_signature(t) for t in tensors))
        key += (pool.is_contiguous(), type(decodes), decodes, alpha, scale)
        plan = PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors where tensors go: checked below
        key = plan = None
    if plan is None:
        plan = _Plan(q, k, v, decay, alpha, scale, pool, slots, from_pool, cu_seqlens, decodes, g)
        if key is not None:
            if len(PLANS) >= PLANS_MAX:
                PLANS.clear()
            PLANS[key] = plan
    return plan.run(q, k, v, decay, pool, slots, from_pool, cu_seqlens, g)


_pool_op = torch.library.custom_op("decay_tuner::decay_attention_pool", mutates_args=("pool",))(_pooled)


@_pool_op.register_fake
def _(q, k, v, decay, alpha, scale, pool, slots, from_pool, cu_seqlens, decodes, g=None):
    _, _, h, _, _, _ = check_call(q, k, v, pool, slots, from_pool, cu_seqlens, decodes, g)
    inputs.check_decay(decay, alpha, h, q.device)
    return q.new_empty(v.shape)


def _check_decodes(cu_seqlens: torch.Tensor, decodes: int, sequences: int) -> None:
    """``ValueError`` unless the first ``decodes`` sequences have one token each
    (``cu_seqlens[decodes] == decodes``): read once per offsets tensor, version and count,
    and on every call where ``DECAY_TUNER_CHECK_SLOTS`` is on."""
    if not 0 < decodes < sequences:  # none, or all (T = N, checked by shape)
        return
    seen = _HINTS.get(id(cu_seqlens))
    if seen is not None and seen[0]() is cu_seqlens and seen[1:] == (cu_seqlens._version, decodes):
        if not ops_decode.checking():
            return
    if int(cu_seqlens[decodes]) != decodes:
        raise ValueError(
            f"decodes={decodes}: the first {decodes} sequences must have one token each, "
            f"but cu_seqlens[{decodes}] = {int(cu_seqlens[decodes])}"
        )
    key = id(cu_seqlens)
    _HINTS[key] = (weakref.ref(cu_seqlens, lambda _: _HINTS.pop(key, None)), cu_seqlens._version, decodes)


def _check_decode_flags(slots: torch.Tensor, from_pool: torch.Tensor, rows: int) -> None:
    """``ValueError`` where a decode of a slot in the pool is flagged to start from zero:
    a decode continues its sequence from its slot (its flag is not read); a new
    one-token request goes with the prefills."""
    live = (slots >= 0) & (slots < rows)
    if bool((live & (from_pool == 0)).any()):
        raise ValueError(
            "a decode (one of the first `decodes` sequences) starts from its slot: from_pool must be "
            "true there; put a new one-token request after the decodes, with the prefills"
        )


def _refuse_grad(*tensors: Any) -> None:
    if inputs.wants_grad(*tensors):
        raise ValueError(
            "a pool call is inference only (no autograd): run it under torch.no_grad() or "
            "torch.inference_mode(), or pass no tensor that requires grad"
        )


def _tensor_signature(t: Any) -> tuple:
    """What the checks read of an argument but its values: of a tensor its type, shape,
    dtype and device; else its type and itself (hashable, else ``TypeError``)."""
    return (type(t), t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else (type(t), t)


def _describe(x: Any) -> str:
    return f"shape {list(x.shape)}" if isinstance(x, torch.Tensor) else f"{type(x).__name__} {x!r}"[:120]
