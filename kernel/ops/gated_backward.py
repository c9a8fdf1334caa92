"""The backward of the gated forward (``kernel.ops.gated``), the gate's gradient included, in
float32 torch: the chunk step's backward of ``refs.gated_backward`` run on every chunk at once.

Per chunk of C tokens, with ``G`` the gate's cumulative sums within it, ``Gamma = exp(G_i -
G_j)`` on j <= i, ``w_query = exp(G)``, ``w_key = exp(G_last - G)``, ``S_prev`` the state
before the chunk and ``dS`` the gradient of the state after it (both from one scan over the
chunks)::

    dP      = (dO @ V^T) * Gamma
    dQ      = (dO @ S_prev^T) * w_query + dP @ K        # for the scaled q
    dK      = dP^T @ Q + (V @ dS^T) * w_key
    dV      = ((Q @ K^T) * Gamma)^T @ dO + (K * w_key) @ dS
    dg_j    = exp(G_last) <dS, S_prev> + sum_{i < j} w_key_i k_i dS v_i^T
            + sum_{s >= j} w_query_s (q_s S_prev) . do_s
            + sum_{s >= j, i < j} Gamma[s, i] (q_s . k_i)(do_s . v_i)

The gate's gradient is that expansion (``refs.gated_backward`` derives it). fla's form,
``sum_{s >= t} q_s . dq_s - k_s . dk_s``, is a difference of O(1) terms: from dq and dk in
fp32 it holds as well, but from dq and dk rounded to fp16 or bf16 it loses a strong gate's
gradient (``experiments/gated/dg_form.txt``).

Its cost: the states of every chunk in float32 (``2 x B x H x S / C x DK x DV x 4`` bytes),
each scan over the chunks one matrix product (``_scans``); packed sequences run as rows, in
a few buckets of similar length (measured beside fla's in ``experiments/gated/README.md``).

``backward_by_passes`` is the same backward as passes of the gated forward, two or three of
them backwards in time, and the gate's gradient from dq's and dk's float32: what the op runs
on CUDA (``kernel.ops.gated``). It is checked on the CPU with the references standing in for
the kernel, rounding as it does (``tests/test_gated_backward.py``), and on the GPU.
"""

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn import functional as F

CHUNK = 64
# gated_pass(q, k, v, g, h0, want_final, cu_seqlens, reverse, exact) -> (o, final or None): the
# gated forward with the call's scale bound (q, k [B, S, G', D], v [B, S, H, D'], g fp32 [B, S,
# H], the states [N, H, D, D'] in float32); ``reverse``: backwards in time, as
# ``refs.gated_reversed`` (the state entering after each sequence's last token, the final
# state at its first, each token's state decayed by the next token's gate); ``exact``: o in
# float32 (dq's and dk's, whose terms the gate's gradient takes), else in v's dtype (dv's).
GatedPass = Callable[
    [Tensor, Tensor, Tensor, Tensor, Tensor | None, bool, Tensor | None, bool, bool],
    tuple[Tensor, Tensor | None],
]


def gated_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    do: Tensor,
    *,
    scale: float,
    initial_state: Tensor | None,
    dht: Tensor | None,
    cu_seqlens: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dg, dh0)`` of the gated forward ``o, final = f(q, k, v, g, initial_state)``
    for the gradients ``do`` of o and ``dht`` of the final state (None: zero).

    q, k ``[B, S, G, DK]``, v and do ``[B, S, H, DV]`` (H = G r), g the whole log-gate of each
    token, fp32 ``[B, S, H]`` (a per-head log-decay already added), states ``[N, H, DK, DV]``
    fp32, ``cu_seqlens`` packing N sequences into B = 1 (or None). dq, dk and dv come in the
    dtypes of q, k, v; dg and dh0 (zero-started where no ``initial_state``) in float32.
    """
    b, s, groups, dk_dim = q.shape
    heads, dv_dim = v.shape[2], v.shape[3]
    r = heads // groups
    f32 = lambda x: x.to(torch.float32)  # noqa: E731
    qh, kh = (f32(x).repeat_interleave(r, dim=2) for x in (q, k))
    vf, dof, gf = f32(v), f32(do), f32(g)
    n = b if cu_seqlens is None else cu_seqlens.numel() - 1
    zero = torch.zeros(n, heads, dk_dim, dv_dim, dtype=torch.float32, device=q.device)
    h0 = zero if initial_state is None else f32(initial_state)
    dht = zero if dht is None else f32(dht)
    if cu_seqlens is None:
        grads = _rows(qh * scale, kh, vf, gf, dof, h0, dht)
    else:
        grads = _packed(qh * scale, kh, vf, gf, dof, h0, dht, cu_seqlens.tolist())
    dq, dk, dv, dg, dh0 = grads
    dq = (dq * scale).reshape(b, s, groups, r, dk_dim).sum(3)
    dk = dk.reshape(b, s, groups, r, dk_dim).sum(3)
    # contiguous, as the backward op's fake promises (a chunk's layout leaves them permuted)
    return (
        dq.to(q.dtype).contiguous(),
        dk.to(k.dtype).contiguous(),
        dv.to(v.dtype).contiguous(),
        dg.contiguous(),
        dh0.contiguous(),
    )


def _packed(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, do: Tensor, h0: Tensor, dht: Tensor, bounds: list[int]
) -> tuple[Tensor, ...]:
    """``_rows`` of N packed sequences (``[1, T, ...]``, offsets ``bounds``): each sequence a
    row, zero-padded to the longest of its bucket, the buckets by chunk count in powers of
    two (``2^(k-1) < chunks <= 2^k``), so one call of ``_rows`` serves a bucket and a row is
    at most twice its sequence. Padded tokens change nothing (``_rows``)."""
    starts, ends = bounds[:-1], bounds[1:]
    chunks = [-(-(e - a) // CHUNK) for a, e in zip(starts, ends)]
    buckets: dict[int, list[int]] = {}
    for i, n in enumerate(chunks):
        buckets.setdefault((n - 1).bit_length(), []).append(i)
    out = [torch.zeros_like(x) for x in (q, k, v)] + [torch.zeros_like(g), torch.empty_like(h0)]
    for members in buckets.values():
        width = max(chunks[i] for i in members) * CHUNK
        src = torch.cat([torch.arange(starts[i], ends[i]) for i in members]).to(q.device)
        dst = torch.cat([j * width + torch.arange(ends[i] - starts[i]) for j, i in enumerate(members)]).to(
            q.device
        )
        rows = len(members)

        def padded(x: Tensor) -> Tensor:  # [1, T, H, ...] -> [rows, width, H, ...]
            flat = x.new_zeros(rows * width, *x.shape[2:])
            flat[dst] = x[0, src]
            return flat.view(rows, width, *x.shape[2:])

        which = torch.tensor(members, device=q.device)
        grads = _rows(*(padded(x) for x in (q, k, v, g, do)), h0[which], dht[which])
        for whole, part in zip(out[:4], grads[:4]):
            whole[0, src] = part.reshape(rows * width, *part.shape[2:])[dst]
        out[4][which] = grads[4]
    return tuple(out)


def _rows(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, do: Tensor, h0: Tensor, dht: Tensor
) -> tuple[Tensor, ...]:
    """B rows of L tokens in fp32, q scaled and in heads: per head, the gradients of the
    scaled q, of k, v and the gate, each ``[B, L, H, D]`` (the gate's ``[B, L, H]``), and the
    initial state's ``[B, H, DK, DV]``."""
    b, length, h, _ = q.shape
    pad = -length % CHUNK  # padded tokens: zero q, k, v, do and gate, so they change nothing
    if pad:
        q, k, v, do = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, do))
        g = F.pad(g, (0, 0, 0, pad))
    nc = (length + pad) // CHUNK

    def tiles(x: Tensor) -> Tensor:  # [B, L, H, D] -> [B, H, NC, C, D]
        return x.view(b, nc, CHUNK, h, -1).permute(0, 3, 1, 2, 4)

    qc, kc, vc, doc = (tiles(x) for x in (q, k, v, do))
    G = g.view(b, nc, CHUNK, h).permute(0, 3, 1, 2).cumsum(-1)  # [B, H, NC, C]
    last = G[..., -1:]
    w_query, w_key = G.exp()[..., None], (last - G).exp()[..., None]
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    gamma = torch.where(causal, G[..., :, None] - G[..., None, :], -torch.inf).exp()
    carry = last.exp()[..., None]  # [B, H, NC, 1, 1]
    delta = (kc * w_key).mT @ vc  # each chunk's own state
    contrib = (qc * w_query).mT @ doc  # each chunk's own gradient of the state before it
    prev, ds, grad = _scans(last[..., 0], delta, contrib, h0, dht)
    qk, dov = (qc @ kc.mT) * gamma, doc @ vc.mT
    dp = dov * gamma
    dq = (doc @ prev.mT) * w_query + dp @ kc
    dk = dp.mT @ qc + (vc @ ds.mT) * w_key
    dv = qk.mT @ doc + (kc * w_key) @ ds
    link = carry[..., 0] * (ds * prev).sum((-1, -2), keepdim=True)[..., 0]  # [B, H, NC, 1]
    keys = w_key[..., 0] * ((kc @ ds) * vc).sum(-1)
    queries = w_query[..., 0] * ((qc @ prev) * doc).sum(-1)
    pairs_before = _exclusive_cumsum(qk * dov)  # [s, j]: query s with the keys i < j
    dg = (
        link
        + _exclusive_cumsum(keys)
        + queries.flip(-1).cumsum(-1).flip(-1)
        + (pairs_before * causal).sum(-2)
    )

    def untile(x: Tensor) -> Tensor:  # [B, H, NC, C, D] -> [B, L, H, D]
        return x.permute(0, 2, 3, 1, 4).reshape(b, nc * CHUNK, h, -1)[:, :length]

    return untile(dq), untile(dk), untile(dv), untile(dg[..., None])[..., 0], grad


def _scans(
    carry_log: Tensor, delta: Tensor, contrib: Tensor, h0: Tensor, dht: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The two scans over the chunks, each as one matrix product (no launch per chunk): the
    state before each chunk, ``S_c = exp(G_last,c-1) S_{c-1} + delta_{c-1}`` from ``h0``; the
    gradient of the state after each chunk, ``dS_c = exp(G_last,c+1) dS_{c+1} + contrib_{c+1}``
    from ``dht``; and the initial state's gradient, ``exp(G_last,0) dS_0 + contrib_0``.
    ``carry_log [B, H, NC]``: each chunk's gate sum; ``delta``, ``contrib`` ``[B, H, NC, DK,
    DV]``. With ``P_c`` the sum of the first c chunks' (in float64, so that the difference of
    two long sums keeps a short one's precision), ``S_c = sum_{c' < c} exp(P_c - P_{c'+1})
    delta_c' + exp(P_c) h0``, and ``dS_c = sum_{c' > c} exp(P_c' - P_{c+1}) contrib_c' +
    exp(P_NC - P_{c+1}) dht``: every exponent <= 0, the others never exponentiated."""
    nc = carry_log.shape[-1]
    P = F.pad(carry_log.double().cumsum(-1), (1, 0))  # [B, H, NC + 1]
    c = torch.arange(nc, device=delta.device)

    def weights(exponent: Tensor, used: Tensor | None = None) -> Tensor:
        exponent = exponent if used is None else torch.where(used, exponent, -torch.inf)
        return exponent.exp().to(delta.dtype)

    def times(w: Tensor, x: Tensor) -> Tensor:  # [B, H, c, c'] @ [B, H, c', DK, DV]
        return (w @ x.flatten(-2)).view_as(x)

    to_h0, from_dht = (
        weights(P[..., :nc])[..., None, None],
        weights(P[..., -1:] - P[..., 1:])[..., None, None],
    )
    forward = weights(P[..., :nc, None] - P[..., None, 1:], c[:, None] > c[None, :])  # [B, H, c, c']
    backward = weights(P[..., None, :nc] - P[..., 1:, None], c[None, :] > c[:, None])
    prev = times(forward, delta) + to_h0 * h0[:, :, None]
    ds = times(backward, contrib) + from_dht * dht[:, :, None]
    grad = (to_h0 * contrib).sum(2) + weights(P[..., -1])[..., None, None] * dht
    return prev, ds, grad


def _exclusive_cumsum(x: Tensor) -> Tensor:
    """The sums over i < j along the last axis, each without x_j (``refs.gated_backward``'s:
    a tiny sum beside a large x_j keeps its precision)."""
    return F.pad(x[..., :-1], (1, 0)).cumsum(-1)


def backward_by_passes(
    gated_pass: GatedPass,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    do: Tensor,
    *,
    scale: float,
    initial_state: Tensor | None,
    dht: Tensor | None,
    cu_seqlens: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """``gated_backward``'s ``(dq, dk, dv, dg, dh0)`` by three passes of the gated forward
    (``gated_pass``; a fourth where ``dht`` is given), as ``kernel.ops.backward`` runs the
    constant decay's, and the gate's gradient from the float32 outputs of dq's and dk's (dv's
    pass writes v's dtype). dh0 is None where there is no ``initial_state``.

    With ``S_t`` the state after token t and ``dS_t = sum_{s >= t} exp(G_s - G_t) scale q_s^T
    do_s + exp(G_last - G_t) dHT`` (G the gate's sums from the sequence's start), per head:

    * ``dq_t = scale do_t S_t^T``: the forward on (do, v, k) from ``H0^T``;
    * ``dv_t = k_t dS_t``: the forward backwards in time on (k, q, do) from ``dHT / scale``;
      its final state times ``scale exp(g_0)`` is dH0;
    * ``dk_t = v_t dS_t^T``: the same on (v, do, q) from none, plus ``x_t = exp(G_last - G_t)
      v_t dHT^T``, the same on (v, 0, 0) from ``dHT^T / scale``;
    * ``dg_t = sum_{s >= t} (q_s . dq_s - k_s . dk_s) + <dHT, HT>``: the loss's derivative in
      ``G_s`` is ``q_s . dq_s - k_s . dk_s`` (the terms of token s with itself cancel) and
      ``<dHT, HT>`` more for the last token. Its dHT part is summed forwards, ``exp(G_last)
      <dHT, H0> + sum_{s < t} k_s . x_s``: summed backwards it would be ``<dHT, HT>`` less
      nearly all of itself, and each pass rounds its state to fp16 or bf16 for its products,
      which that difference does not survive where the gates are strong (bf16 at -20 per
      token; measured with reference C rounding as the kernel does:
      ``experiments/gated/dg_final_state.txt``).

    Heads of one group (q and k in G < H heads) each run their own dq and dk, summed after."""
    b, s, groups, dk_dim = q.shape
    heads = v.shape[2]
    r = heads // groups
    in_heads = (lambda x: x.repeat_interleave(r, dim=2)) if r > 1 else (lambda x: x)  # noqa: E731
    qh, kh = in_heads(q), in_heads(k)
    h0_t = None if initial_state is None else initial_state.transpose(-1, -2).contiguous()
    dq, _ = gated_pass(do, v, kh, g, h0_t, False, cu_seqlens, False, True)
    start = None if dht is None else dht / scale
    dv, back = gated_pass(k, q, do, g, start, initial_state is not None, cu_seqlens, True, False)
    dk, _ = gated_pass(v, do, qh, g, None, False, cu_seqlens, True, True)
    step = (dq * qh).sum(-1) - (dk * kh).sum(-1)  # [B, S, H] in float32: the products promote, no cast copy
    dg = _token_sums(step, cu_seqlens, after=True)
    if dht is not None:
        start_t = start.transpose(-1, -2).contiguous()
        zeros = torch.zeros_like(do), torch.zeros_like(qh)
        x, _ = gated_pass(v, *zeros, g, start_t, False, cu_seqlens, True, True)
        dk = dk + x
        dg = dg + _token_sums((x * kh).sum(-1), cu_seqlens, after=False)
        if initial_state is not None:  # exp(G_last) <dHT, H0>, G_last a sequence's whole sum
            whole = _token_sums(g, cu_seqlens, after=True)
            firsts = whole[:, 0] if cu_seqlens is None else whole[0, cu_seqlens[:-1].long()]  # [N, H]
            term = torch.exp(firsts) * (dht.double() * initial_state.double()).sum((-1, -2))
            dg = dg + (term[:, None] if cu_seqlens is None else term[_sequence_of(cu_seqlens, s)][None])
    dh0 = None
    if initial_state is not None:
        first = g[:, 0] if cu_seqlens is None else g[0, cu_seqlens[:-1].long()]  # [N, H]
        dh0 = back * (scale * torch.exp(first))[..., None, None]

    def to_groups(x: Tensor, like: Tensor) -> Tensor:
        return (x if r == 1 else x.reshape(b, s, groups, r, dk_dim).sum(3)).to(like.dtype)

    return to_groups(dq, q), to_groups(dk, k), dv, dg.float(), dh0


def _sequence_of(cu_seqlens: Tensor, tokens: int) -> Tensor:
    """The sequence of each of the packed tokens."""
    return torch.searchsorted(
        cu_seqlens[1:].long(), torch.arange(tokens, device=cu_seqlens.device), right=True
    )


def _token_sums(x: Tensor, cu_seqlens: Tensor | None, *, after: bool) -> Tensor:
    """float64 ``[B, S, H]``: each token's sum of ``x`` over the tokens of its sequence from it
    to the end (``after``) or before it."""
    x = x.double()
    sums = x.flip(1).cumsum(1).flip(1) if after else F.pad(x[:, :-1], (0, 0, 1, 0)).cumsum(1)
    if cu_seqlens is None:
        return sums
    bounds = (cu_seqlens[1:] if after else cu_seqlens[:-1]).long()  # where the sums leave its sequence
    return sums - F.pad(sums, (0, 0, 0, 1))[:, bounds[_sequence_of(cu_seqlens, x.shape[1])]]
