"""Reference E: the backward pass of the chunked form, in float64.

The forward of one chunk (``refs.chunk``, ``Q`` already scaled) is
``O = (Q * w_query) @ S_prev + ((Q K^T) * Gamma) @ V`` and
``S = alpha^L * S_prev + (K * w_decay)^T @ V``. Given ``dO`` and ``dS``, the gradient of
the state after the chunk, its backward is four products of the same weights, every one
<= 1, so the rules of the forward hold (docs/design.md, section 6)::

    dP      = (dO @ V^T) * Gamma                      # [C, C], the scores' gradient
    dQ      = (dO @ S_prev^T) * w_query + dP @ K       # times scale for the unscaled q
    dK      = dP^T @ Q + (V @ dS^T) * w_decay
    dV      = ((Q @ K^T) * Gamma)^T @ dO + (K * w_decay) @ dS
    dS_prev = alpha^L * dS + (Q * w_query)^T @ dO

walked over the chunks last to first from ``dS`` = the final state's gradient (zero if the
forward returned none); the ``dS_prev`` of the first chunk is the initial state's gradient.
The states ``S_prev`` come from the forward, recomputed here as a kernel would recompute
them. The decay is not learned: no gradient for it.
"""

import torch
from torch import Tensor

from ._checks import F64, check_chunk, check_cu_seqlens, check_decay, check_qkv, check_scale, check_state
from .chunk import chunk_weights


def chunked_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alpha: float | Tensor,
    chunk: int,
    do: Tensor,
    *,
    scale: float = 1.0,
    initial_state: Tensor | None = None,
    dht: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """``(dq, dk, dv, dh0)`` in float64 for ``o = chunked(q, k, v, alpha, ...)`` and the
    loss whose gradients are ``do`` (``[B, S, H, DV]``) and ``dht`` (the final state's,
    ``[N, H, DK, DV]``, or None). The arguments are those of ``refs.chunked``; dh0 is the
    initial state's gradient (returned whether or not the forward took one)."""
    check_qkv(q, k, v)
    if do.shape != v.shape:
        raise ValueError(f"do: expected the shape of v {tuple(v.shape)}, got {tuple(do.shape)}")
    chunk, scale = check_chunk(chunk), check_scale(scale)
    b, _, h, dk = q.shape
    decay = check_decay(alpha, q)
    qs, k, v, do = q.to(F64) * scale, k.to(F64), v.to(F64), do.to(F64)
    seqs = [(0, q.shape[1])] if cu_seqlens is None else check_cu_seqlens(cu_seqlens, q)
    shape = (b if cu_seqlens is None else len(seqs), h, dk, v.shape[-1])
    state0 = check_state(initial_state, shape, q)
    dht = torch.zeros(shape, dtype=F64, device=q.device) if dht is None else check_state(dht, shape, q)
    grads = [torch.zeros_like(x) for x in (qs, k, v)]
    dh0 = torch.empty(shape, dtype=F64, device=q.device)
    for n, (a, e) in enumerate(seqs):
        rows = slice(None) if cu_seqlens is None else slice(n, n + 1)
        parts = _sequence(qs[:, a:e], k[:, a:e], v[:, a:e], do[:, a:e], decay, state0[rows], dht[rows], chunk)
        for grad, part in zip(grads, parts[:3]):
            grad[:, a:e] = part
        dh0[rows] = parts[3]
    dq, dk_, dv = grads
    return dq * scale, dk_, dv, dh0


def _sequence(
    q: Tensor, k: Tensor, v: Tensor, do: Tensor, decay: Tensor, state0: Tensor, ds: Tensor, chunk: int
) -> tuple[Tensor, ...]:
    """One batch of sequences of equal length: the gradients of scaled q, k, v and S_0."""
    s = q.shape[1]
    starts = range(0, s, chunk)
    weights = [chunk_weights(decay, chunk, length=min(chunk, s - a), device=q.device) for a in starts]
    # [B, H, L, D] per chunk, L = C but in a ragged last chunk; the weights cut to L.
    tiles = [[x[:, a : a + chunk].transpose(1, 2) for x in (q, k, v, do)] for a in starts]
    states = [state0]  # the state before each chunk
    for (qc, kc, vc, _), w in zip(tiles, weights):
        m = qc.shape[2]
        states.append(w.state_decay[:, None, None] * states[-1] + (kc * w.w_decay[:, :m, None]).mT @ vc)
    out: list[list[Tensor]] = [[], [], []]
    for (qc, kc, vc, doc), w, s_prev in reversed(list(zip(tiles, weights, states))):
        m = qc.shape[2]
        gamma, w_decay, w_query = w.gamma[:, :m, :m], w.w_decay[:, :m, None], w.w_query[:, :m, None]
        dp = (doc @ vc.mT) * gamma
        dq = (doc @ s_prev.mT) * w_query + dp @ kc
        dk = dp.mT @ qc + (vc @ ds.mT) * w_decay
        dv = ((qc @ kc.mT) * gamma).mT @ doc + (kc * w_decay) @ ds
        ds = w.state_decay[:, None, None] * ds + (qc * w_query).mT @ doc
        for grads, g in zip(out, (dq, dk, dv)):
            grads.insert(0, g.transpose(1, 2))
    return *(torch.cat(g, dim=1) for g in out), ds
