"""The backward pass: three passes of the forward kernel, or one pass of it and
the fused dk and dv pass (``kernel.dkdv``) where that serves the problem.

With ``o_t = scale q_t S_t``, ``S_t = a S_{t-1} + k_t^T v_t`` and ``S_{-1} = H0`` (the
initial state), over T tokens, the gradients given ``do`` and ``dHT`` (the final state's)
are, with ``dS_t = sum_{s >= t} a^(s-t) scale q_s^T do_s + a^(T-1-t) dHT``::

    dq_t = scale do_t S_t^T = scale (a^(t+1) do_t H0^T + sum_{s <= t} a^(t-s) (do_t . v_s) k_s)
    dk_t = v_t dS_t^T
    dv_t = k_t dS_t
    dH0  = sum_t scale a^(t+1) q_t^T do_t + a^T dHT

``dq`` is the forward itself with (q, k, v) := (do, v, k) and the initial state ``H0^T``.
``dk`` and ``dv`` are the forward run backwards in time (``reverse``: token ``T-1-t``
first): with (v, do, q) and (k, q, do), the reversed sum over ``s' <= t'`` is the sum over
``s >= t``, and the state term ``scale a^(t'+1) q'_t' H0'`` is the ``dHT`` term when ``H0'
= dHT / (scale a)`` (transposed for ``dk``). The ``dv`` pass's final state ``F = a^T H0'
+ sum_s a^s q_s^T do_s`` gives ``dH0 = scale a F``.

So each pass is a forward call: the same kernel, its fp32 state and weights <= 1
(docs/design.md), and the config the dispatch table tuned for its shape ((DV, DK) for the
``dq`` and ``dk`` passes). The kernel runs backwards in time itself
(``kernel.scalar_decay.Direction``): it reads the tensors in place, no reversed copies.
Dividing ``dHT`` by ``scale a`` stays finite for every decay of a model (it overflows fp32
only where ``|dHT| > 3e38 scale a``). The decay is not learned: no gradient for it.

The dk pass's state is the dv pass's transposed, so ``kernel.dkdv`` carries it once and
writes both: from the dv pass's start, with its final state, and with its own config:
the table's entry for it where ``dispatch --backward`` tuned one (``--sweep dkdv``), else
``kernel.rule.dkdv_config``'s rule.

``backward`` takes the forward as ``forward_pass`` so that the same algebra runs on the GPU kernel
(``kernel.ops.attention``) and, in the tests, on the fp64 references, whose reversed pass is
the forward on reversed copies of the tokens.
"""

import dataclasses
from collections.abc import Callable

from torch import Tensor

from kernel.config import Call, Problem

# forward_pass(q, k, v, initial_state, output_final_state, cu_seqlens, reverse) -> (o, final or None):
# the forward with the decay and the scale bound, backwards in time where ``reverse``.
ForwardPass = Callable[
    [Tensor, Tensor, Tensor, Tensor | None, bool, Tensor | None, bool], tuple[Tensor, Tensor | None]
]
# dkdv(q, k, v, do, start, output_final_state, cu_seqlens) -> (dk, dv, final or None): the dk
# and dv passes in one (``kernel.dkdv``), from the dv pass's start, with its final state.
Fused = Callable[
    [Tensor, Tensor, Tensor, Tensor, Tensor | None, bool, Tensor | None],
    tuple[Tensor, Tensor, Tensor | None],
]


def backward(
    forward_pass: ForwardPass,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    do: Tensor,
    decay: Tensor,
    scale: float,
    *,
    initial_state: Tensor | None = None,
    dht: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    want_dh0: bool = False,
    fused: Fused | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(dq, dk, dv, dH0)`` of ``o = forward(q, k, v)`` for the gradients ``do`` of ``o``
    and ``dht`` of the final state (None: zero), in the forward's layout: q, k
    ``[B, S, H, DK]``, v and do ``[B, S, H, DV]``, states ``[B or N, H, DK, DV]`` in fp32,
    decay ``[H]`` (one alpha per head). dH0 is computed only with ``want_dh0``. With
    ``fused``, dk and dv come from it instead of two reversed passes."""
    h0_t = None if initial_state is None else initial_state.transpose(-1, -2).contiguous()
    dq, _ = forward_pass(do, v, k, h0_t, False, cu_seqlens, False)
    start = None
    if dht is not None:  # the dHT term enters as the reversed passes' initial state
        start = dht / (scale * decay.to(dht.dtype)[:, None, None])
    if fused is not None:
        dk, dv, final = fused(q, k, v, do, start, want_dh0, cu_seqlens)
    else:
        start_t = None if start is None else start.transpose(-1, -2).contiguous()
        dk, _ = forward_pass(v, do, q, start_t, False, cu_seqlens, True)
        dv, final = forward_pass(k, q, do, start, want_dh0, cu_seqlens, True)
    dh0 = None
    if want_dh0:
        assert final is not None
        dh0 = final * (scale * decay.to(final.dtype)[:, None, None])
    return dq, dk, dv, dh0


def pass_calls(problem: Problem, call: Call, fused: bool = False) -> list[tuple[Problem, Call]]:
    """The kernel calls the backward of ``call`` on ``problem`` makes, dq's, dk's and dv's
    (with ``fused``: dq's, then dk's and dv's in one): what it compiles, and what a table
    must hold to serve it. The reversed passes start from the final state's gradient where
    the forward returned its state, and the dv pass returns a state where the forward
    took one."""
    swapped = dataclasses.replace(problem, dk=problem.dv, dv=problem.dk)
    scale, packed = call.scale, call.packed
    dq = (swapped, Call(scale, call.initial_state, False, packed))
    dk = (swapped, Call(scale, call.final_state, False, packed, reverse=True))
    dv = (problem, Call(scale, call.final_state, call.initial_state, packed, reverse=True, dkdv=fused))
    return [dq, dv] if fused else [dq, dk, dv]
