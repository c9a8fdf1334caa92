"""The backward pass (issue 18): three sweeps of the forward kernel, no kernel of its own.

With ``o_t = scale q_t S_t``, ``S_t = a S_{t-1} + k_t^T v_t`` and ``S_{-1} = H0`` (the
initial state), over T tokens, the gradients given ``do`` and ``dHT`` (the final state's)
are, with ``dS_t = sum_{s >= t} a^(s-t) scale q_s^T do_s + a^(T-1-t) dHT``::

    dq_t = scale do_t S_t^T = scale (a^(t+1) do_t H0^T + sum_{s <= t} a^(t-s) (do_t . v_s) k_s)
    dk_t = v_t dS_t^T
    dv_t = k_t dS_t
    dH0  = sum_t scale a^(t+1) q_t^T do_t + a^T dHT

``dq`` is the forward itself with (q, k, v) := (do, v, k) and the initial state ``H0^T``.
``dk`` and ``dv`` are the forward run backwards in time (``rev``, token ``T-1-t`` first):
with (rev v, rev do, rev q) and (rev k, rev q, rev do), the forward's sum over ``s' <= t'``
is the sum over ``s >= t``, and its state term ``scale a^(t'+1) q'_t' H0'`` is the ``dHT``
term when ``H0' = dHT / (scale a)`` (transposed for ``dk``). The ``dv`` sweep's final state
``F = a^T H0' + sum_s a^s q_s^T do_s`` gives ``dH0 = scale a F``.

So each sweep is a forward call: the same kernel, its fp32 state and weights <= 1
(docs/design.md), and the config the dispatch table tuned for its shape ((DV, DK) for the
``dq`` and ``dk`` sweeps). Dividing ``dHT`` by ``scale a`` stays finite for every decay of a
model (it overflows fp32 only where ``|dHT| > 3e38 scale a``). The decay is not learned:
no gradient for it. Packed sequences reverse as a whole: the last sequence comes first,
with offsets ``T - cu_seqlens`` reversed and the states in reverse order.

The sweeps read their inputs reversed through copies (``Tensor.flip``); ``backward`` takes
the forward as ``sweep`` so that the same algebra runs on the GPU kernel
(``kernel.attention``) and, in the tests, on the fp64 references.
"""

import dataclasses
from collections.abc import Callable

from torch import Tensor

from kernel.config import Call, Problem

# sweep(q, k, v, initial_state, output_final_state, cu_seqlens) -> (o, final_state or None):
# the forward with the decay and the scale bound.
Sweep = Callable[[Tensor, Tensor, Tensor, Tensor | None, bool, Tensor | None], tuple[Tensor, Tensor | None]]


def backward(
    sweep: Sweep,
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
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(dq, dk, dv, dH0)`` of ``o = forward(q, k, v)`` for the gradients ``do`` of ``o``
    and ``dht`` of the final state (None: zero), in the forward's layout: q, k
    ``[B, S, H, DK]``, v and do ``[B, S, H, DV]``, states ``[B or N, H, DK, DV]`` in fp32,
    decay ``[H]`` (one alpha per head). dH0 is computed only with ``want_dh0``."""
    packed = cu_seqlens is not None
    rev_cu = None if cu_seqlens is None else cu_seqlens[-1] - cu_seqlens.flip(0)
    h0_t = None if initial_state is None else initial_state.transpose(-1, -2).contiguous()
    dq, _ = sweep(do, v, k, h0_t, False, cu_seqlens)

    start = None
    if dht is not None:  # the dHT term enters as the reversed sweeps' initial state
        start = _order(dht / (scale * decay.to(dht.dtype)[:, None, None]), packed)
    rev_q, rev_do = q.flip(1), do.flip(1)
    start_t = None if start is None else start.transpose(-1, -2).contiguous()
    dk_rev, _ = sweep(v.flip(1), rev_do, rev_q, start_t, False, rev_cu)
    dv_rev, final = sweep(k.flip(1), rev_q, rev_do, start, want_dh0, rev_cu)
    dh0 = None
    if want_dh0:
        assert final is not None
        dh0 = _order(final, packed) * (scale * decay.to(final.dtype)[:, None, None])
    return dq, dk_rev.flip(1), dv_rev.flip(1), dh0


def _order(states: Tensor, packed: bool) -> Tensor:
    """Per-sequence states in the reversed sweeps' order: packed sequences come last first."""
    return states.flip(0) if packed else states


def sweep_calls(problem: Problem, call: Call) -> list[tuple[Problem, Call]]:
    """The forward calls the backward of ``call`` on ``problem`` makes, dq's, dk's and dv's:
    what it compiles, and what a table must hold to serve it. The reversed sweeps start
    from the final state's gradient where the forward returned its state, and the dv sweep
    returns a state where the forward took one."""
    swapped = dataclasses.replace(problem, dk=problem.dv, dv=problem.dk)
    scale, packed = call.scale, call.packed
    return [
        (swapped, Call(scale, call.initial_state, False, packed)),
        (swapped, Call(scale, call.final_state, False, packed)),
        (problem, Call(scale, call.final_state, call.initial_state, packed)),
    ]
