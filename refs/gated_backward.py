"""The backward of the gated references (``refs.gated``) in float64, the gate's gradient included.

Per chunk, with the gated weights of ``refs.gated`` (``Gamma = exp(G_i - G_j)`` on j <= i,
``w_query = exp(G)``, ``w_key = exp(G_last - G)``, the carry ``exp(G_last)``), the chunk
step's backward is ``refs.backward``'s with those weights::

    dP      = (dO @ V^T) * Gamma
    dQ      = (dO @ S_prev^T) * w_query + dP @ K       # per head, for the scaled q
    dK      = dP^T @ Q + (V @ dS^T) * w_key
    dV      = ((Q @ K^T) * Gamma)^T @ dO + (K * w_key) @ dS
    dS_prev = exp(G_last) * dS + (Q * w_query)^T @ dO

The gate. ``dg_t = exp(g_t) <dS_t, S_{t-1}>``, with ``dS_t`` the gradient of the state
after token t. Expanded over a chunk (rows j, ``dS`` the gradient of the state after the
chunk) it is four sums of terms whose weights are all ``exp`` of exponents <= 0::

    dg_j = exp(G_last) <dS, S_prev>                               # the states' own link
         + sum_{i < j} exp(G_last - G_i) k_i dS v_i^T             # keys before j, seen after
         + sum_{s >= j} exp(G_s) (q_s S_prev) . do_s              # queries from j on, the old state
         + sum_{s >= j, i < j} Gamma[s, i] (q_s . k_i)(do_s . v_i)  # pairs across j in the chunk

Written with the gradients of q and k instead (fla's form), ``dg_t`` is the sum over s >= t
of ``q_s . dq_s - k_s . dk_s`` (+ ``<dS_T, S_T>`` at the last token): the same number, but
the pairs on both sides of t cancel there, so a gate of -20 per token, whose true gradient
is ~exp(-20), comes out of a difference of O(1) terms with a relative error of 1e-7 even in
fp64; the expansion above has no such cancellation. ``g_gamma`` adds to every token's gate:
its gradient is ``dg`` summed over tokens. With groups, a group's dq and dk sum its heads'.
"""

import torch
from torch import Tensor
from torch.nn import functional as F

from ._checks import F64, check_chunk, check_state
from .gated import check_inputs, chunk_cumsum, gate_mask, to_heads


def gated_chunked_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    chunk: int,
    do: Tensor,
    *,
    g_gamma: Tensor | None = None,
    scale: float = 1.0,
    initial_state: Tensor | None = None,
    dht: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """The gradients of ``o = refs.gated_chunked(q, k, v, g, chunk, ...)`` for the loss whose
    gradients are ``do`` (``[B, S, H, DV]``) and ``dht`` (the final state's, ``[N, H, DK,
    DV]``, or None).

    Args: as ``refs.gated_chunked``.

    Returns:
        float64 ``(dq, dk, dv, dg, dg_gamma, dh0)``: dq, dk ``[B, S, G, DK]``, dv ``[B, S,
        H, DV]``, dg ``[B, S, H]`` (the log-gate's), dg_gamma ``[H]`` (the per-head
        log-decay's, whether or not one was given), dh0 the initial state's ``[N, H, DK,
        DV]`` (whether or not one was given).
    """
    x = check_inputs(
        q, k, v, g, g_gamma=g_gamma, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
    )
    chunk = check_chunk(chunk)
    if do.shape != v.shape:
        raise ValueError(f"do: expected the shape of v {tuple(v.shape)}, got {tuple(do.shape)}")
    do = do.to(device=v.device, dtype=F64)
    dht = torch.zeros_like(x.state0) if dht is None else check_state(dht, tuple(x.state0.shape), q)
    qh, kh = to_heads(x.q, x.group_size), to_heads(x.k, x.group_size)
    seqs = [(0, q.shape[1])] if x.seqs is None else x.seqs
    dq, dk, dv = torch.zeros_like(qh), torch.zeros_like(kh), torch.zeros_like(x.v)
    dg, dh0 = torch.zeros_like(x.lg), torch.empty_like(x.state0)
    for n, (a, e) in enumerate(seqs):
        rows = slice(None) if x.seqs is None else slice(n, n + 1)
        parts = _sequence(
            qh[:, a:e], kh[:, a:e], x.v[:, a:e], do[:, a:e], x.lg[:, a:e], x.state0[rows], dht[rows], chunk
        )
        for grad, part in zip((dq, dk, dv, dg), parts):
            grad[:, a:e] = part
        dh0[rows] = parts[4]
    b, s, groups, dk_dim = q.shape
    r = x.group_size
    dq = dq.reshape(b, s, groups, r, dk_dim).sum(3) * scale
    dk = dk.reshape(b, s, groups, r, dk_dim).sum(3)
    return dq, dk, dv, dg, dg.sum(dim=(0, 1)), dh0


def _sequence(
    q: Tensor, k: Tensor, v: Tensor, do: Tensor, lg: Tensor, state0: Tensor, ds: Tensor, chunk: int
) -> tuple[Tensor, ...]:
    """B sequences of L tokens, q scaled and in heads: per head, the gradients of the scaled q,
    k, v and the gate ``[B, L, H]``, and the initial state's."""
    s = q.shape[1]
    G = chunk_cumsum(lg, chunk)  # [B, H, N, C]
    starts = range(0, s, chunk)
    tiles = [[x[:, a : a + chunk].transpose(1, 2) for x in (q, k, v, do)] for a in starts]  # [B, H, m, D]
    states = [state0]  # the state before each chunk, then the final state
    for c, (_, kc, vc, _) in enumerate(tiles):
        m = kc.shape[2]
        gc = G[:, :, c, :m]  # [B, H, m]
        w_key = torch.exp(gc[..., -1:] - gc)[..., None]
        states.append(torch.exp(gc[..., -1, None, None]) * states[-1] + (kc * w_key).mT @ vc)
    grads: list[list[Tensor]] = [[], [], [], []]
    for c in reversed(range(len(tiles))):
        qc, kc, vc, doc = tiles[c]
        m, s_prev = qc.shape[2], states[c]
        gc = G[:, :, c, :m]
        gamma, w_query = gate_mask(gc), torch.exp(gc)[..., None]  # [B, H, m, m], [B, H, m, 1]
        w_key = torch.exp(gc[..., -1:] - gc)[..., None]
        # the gate's four sums (module docstring), with dS still the state after the chunk
        link = torch.exp(gc[..., -1]) * (ds * s_prev).sum(dim=(-1, -2))  # [B, H]
        keys = w_key[..., 0] * torch.einsum("bhik,bhkv,bhiv->bhi", kc, ds, vc)
        queries = w_query[..., 0] * torch.einsum("bhsk,bhkv,bhsv->bhs", qc, s_prev, doc)
        pairs = (qc @ kc.mT) * gamma * (doc @ vc.mT)  # [B, H, s, i]
        before = _exclusive_cumsum(pairs)  # [s, j]: the pairs of query s with keys i < j
        rows = torch.arange(m, device=q.device)
        dg = (
            link[..., None]
            + _exclusive_cumsum(keys)
            + queries.flip(-1).cumsum(-1).flip(-1)
            + (before * (rows[:, None] >= rows[None, :])).sum(-2)
        )
        dp = (doc @ vc.mT) * gamma
        dq = (doc @ s_prev.mT) * w_query + dp @ kc
        dk = dp.mT @ qc + (vc @ ds.mT) * w_key
        dv = ((qc @ kc.mT) * gamma).mT @ doc + (kc * w_key) @ ds
        ds = torch.exp(gc[..., -1, None, None]) * ds + (qc * w_query).mT @ doc
        for out, grad in zip(grads, (dq, dk, dv, dg[..., None])):
            out.insert(0, grad.transpose(1, 2))  # [B, m, H, D]
    dq, dk, dv, dg = (torch.cat(x, dim=1) for x in grads)
    return dq, dk, dv, dg[..., 0], ds


def _exclusive_cumsum(x: Tensor) -> Tensor:
    """The sums over i < j along the last axis, each summed without x_j: a tiny sum next to
    a large x_j (a gate of -20) keeps its relative precision, which ``cumsum - x`` loses."""
    return F.pad(x[..., :-1], (1, 0)).cumsum(-1)
