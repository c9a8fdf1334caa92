"""References for a decay that changes per token: fla's log-gate form, with grouped q and k.

The recurrence of ``refs.naive`` with a log-gate ``g_t`` (``alpha_t = exp(g_t)``), as fla's
``chunk_simple_gla(q, k, v, g=..., g_gamma=...)`` and Mamba2's SSD (``g = dt * A``) take it::

    S_t = exp(g_t) * S_{t-1} + outer(k_t, v_t),    o_t = (scale * q_t) @ S_t

Per head h, ``g_t`` is ``g[b, t, h]`` plus ``g_gamma[h]`` where both are given (their
log-decays add, as in fla). Groups (Mamba2's ``ngroups``, the GQA of linear attention): q
and k have G heads, v has H = G * r, and head h reads group ``h // r`` (Mamba2 repeats B and
C as ``(g r)``; fla's kernels index ``i_hq // NG``).

Within a chunk of C tokens (0-based row r), with ``G_r`` the cumulative sum of the chunk's
log-gates up to and including row r, every weight is ``exp`` of an exponent <= 0 for gates
<= 0:

* ``Gamma[i, j] = exp(G_i - G_j)`` for j <= i, else exactly 0, evaluated only where j <= i;
* ``w_key[r] = exp(G_last - G_r)``: key rows written into the state, aligned to the chunk's
  last token (0 on the rows past a ragged last chunk);
* ``w_query[r] = exp(G_r)``: query rows reading the state left by the previous chunk;
* ``exp(G_last)``: the state carried across the chunk.

A constant decay is the special case ``g = log(alpha)`` per token: then ``G_r = (r + 1)
log(alpha)`` and the weights are ``refs.chunk``'s.

Layout ``[B, S, H, D]`` everywhere; float64 results. ``cu_seqlens`` packs independent
sequences over ``[1, T, ...]`` inputs, each from its own initial state and chunked from its
own first token.
"""

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn import functional as F

from ._checks import F64, check_chunk, check_cu_seqlens, check_scale, check_state, from_chunks, to_chunks

GATE_DTYPES = (torch.float32, torch.float64)

# core(q, k, v, lg, state0) -> (o, state): float64 q (scaled) and k ``[B, L, H, DK]`` already
# expanded from groups to heads, v ``[B, L, H, DV]``, the per-token log-decay ``lg [B, L, H]``
# and the state ``[B, H, DK, DV]`` of B independent sequences of L tokens.
GatedCore = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


class GatedInputs(NamedTuple):
    """The checked inputs of one call, float64 on q's device (q and k still in groups)."""

    q: Tensor  # [B, S, G, DK], times scale
    k: Tensor  # [B, S, G, DK]
    v: Tensor  # [B, S, H, DV]
    lg: Tensor  # [B, S, H]: g + g_gamma, the log-decay of every token and head
    state0: Tensor  # [N, H, DK, DV]
    seqs: list[tuple[int, int]] | None  # the packed sequences' token ranges, or None (dense)
    group_size: int  # r = H // G


def group_size(q: Tensor, k: Tensor, v: Tensor) -> int:
    """r = H // G for q, k ``[B, S, G, DK]`` and v ``[B, S, H, DV]`` on one device; ValueError
    naming the shapes where they do not fit (H not a multiple of G among them)."""
    if q.dim() != 4 or q.shape[1] < 1:
        raise ValueError(f"q: expected 4 dims [B, S, G, DK] with S >= 1, got shape {tuple(q.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k: expected shape {tuple(q.shape)} (as q), got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        b, s = q.shape[:2]
        raise ValueError(f"v: expected shape ({b}, {s}, H, DV), got {tuple(v.shape)}")
    groups, heads = q.shape[2], v.shape[2]
    if heads % groups:
        raise ValueError(f"v: expected heads H a multiple of q and k's G = {groups}, got H = {heads}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v: expected one device, got {q.device}, {k.device}, {v.device}")
    return heads // groups


def check_gate(g: Tensor | None, g_gamma: Tensor | None, v: Tensor) -> Tensor:
    """The log-decay ``[B, S, H]`` (float64) of ``g`` (fp32 or fp64 ``[B, S, H]``, or None)
    plus ``g_gamma`` (float ``[H]``, or None), both finite and on v's device; zero (no
    decay) where neither is given. ValueError naming what is wrong: a shape, a dtype, a
    device or a value."""
    b, s, h = v.shape[:3]
    lg = torch.zeros(b, s, h, dtype=F64, device=v.device)
    for name, x, shape in (("g", g, (b, s, h)), ("g_gamma", g_gamma, (h,))):
        if x is None:
            continue
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a tensor or None, got {type(x).__name__}")
        if tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(x.shape)}")
        if x.dtype not in GATE_DTYPES:
            raise ValueError(f"{name}: expected dtype float32 or float64, got {x.dtype}")
        if x.device != v.device:
            raise ValueError(f"{name}: expected device {v.device} (as v), got {x.device}")
        if not bool(x.isfinite().all()):
            raise ValueError(f"{name}: expected finite log-decays, got range [{x.min()}, {x.max()}]")
        lg = lg + x.to(F64)
    return lg


def check_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    *,
    g_gamma: Tensor | None,
    scale: float,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
) -> GatedInputs:
    """Every check of a gated reference call, and its inputs as float64 (``GatedInputs``)."""
    r = group_size(q, k, v)
    lg = check_gate(g, g_gamma, v)
    h, dk, dv = v.shape[2], q.shape[3], v.shape[3]
    qs = q.to(F64) * check_scale(scale)
    seqs = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, q)
    n = q.shape[0] if seqs is None else len(seqs)
    state0 = check_state(initial_state, (n, h, dk, dv), q)
    return GatedInputs(qs, k.to(F64), v.to(F64), lg, state0, seqs, r)


def to_heads(x: Tensor, r: int) -> Tensor:
    """Groups ``[B, S, G, D]`` -> heads ``[B, S, G * r, D]``: head h reads group ``h // r``."""
    return x.repeat_interleave(r, dim=2)


def run_gated(
    core: GatedCore,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    *,
    g_gamma: Tensor | None = None,
    scale: float = 1.0,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    output_final_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Check the inputs, then run ``core`` on each sequence (dense: the B rows in one call;
    packed: each sequence alone, from its own initial state). Returns float64 o ``[B, S, H,
    DV]``, and with output_final_state also the final state ``[N, H, DK, DV]``."""
    x = check_inputs(
        q, k, v, g, g_gamma=g_gamma, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
    )
    qh, kh = to_heads(x.q, x.group_size), to_heads(x.k, x.group_size)
    if x.seqs is None:
        out, state = core(qh, kh, x.v, x.lg, x.state0)
    else:
        parts = [
            core(qh[:, a:e], kh[:, a:e], x.v[:, a:e], x.lg[:, a:e], x.state0[n : n + 1])
            for n, (a, e) in enumerate(x.seqs)
        ]
        out, state = torch.cat([o for o, _ in parts], dim=1), torch.cat([s for _, s in parts])
    return (out, state) if output_final_state else out


# ---- A: the recurrence -------------------------------------------------------------------


def _recurrent(q: Tensor, k: Tensor, v: Tensor, lg: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    out = q.new_empty(*v.shape)
    for t in range(q.shape[1]):
        # S = exp(g_t) * S + outer(k_t, v_t): [B, H, DK, DV]
        state = torch.exp(lg[:, t, :, None, None]) * state + k[:, t, :, :, None] * v[:, t, :, None, :]
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], state)  # o_t = q_t @ S_t
    return out, state


def gated_recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, **keywords
) -> Tensor | tuple[Tensor, Tensor]:
    """Reference A: the gated recurrence token by token (the definition).

    Args:
        q, k: ``[B, S, G, DK]``; v: ``[B, S, H, DV]``, H a multiple of G.
        g: the log-gate ``[B, S, H]`` (fp32 or fp64, finite), or None.
        keywords: ``g_gamma`` (``[H]``, a log-decay per head added to g), ``scale``
            (multiplies q; default 1), ``initial_state`` (``[B, H, DK, DV]``, or ``[N, H,
            DK, DV]`` with cu_seqlens), ``cu_seqlens`` (N + 1 offsets over ``[1, T, ...]``),
            ``output_final_state``.

    Returns:
        float64 o ``[B, S, H, DV]``, or ``(o, final_state)`` with output_final_state.
    """
    return run_gated(_recurrent, q, k, v, g, **keywords)


# ---- B: chunked and vectorised -----------------------------------------------------------


def chunk_cumsum(lg: Tensor, chunk: int) -> Tensor:
    """``[B, S, H]`` log-decays -> ``[B, H, N, C]``: their cumulative sums within each chunk
    (``G_r``, rows 0..r). The rows past S are zero-padded, so ``G`` stays at the last real
    row's value past it: ``G[..., -1]`` is a ragged last chunk's ``G_last`` too."""
    b, s, h = lg.shape
    n = -(-s // chunk)
    padded = F.pad(lg.to(F64), (0, 0, 0, n * chunk - s))
    return padded.reshape(b, n, chunk, h).permute(0, 3, 1, 2).cumsum(dim=-1)


def gate_mask(G: Tensor) -> Tensor:
    """``Gamma[..., i, j] = exp(G_i - G_j)`` for j <= i, else exactly 0, from ``G [..., C]``.
    The masked-off exponents are replaced by -inf before ``exp``, never exponentiated: they
    are >= 0 and may overflow even fp64 (20 per token over 64 tokens is exp(1260))."""
    c = G.shape[-1]
    causal = torch.ones(c, c, dtype=torch.bool, device=G.device).tril()
    return torch.exp(torch.where(causal, G[..., :, None] - G[..., None, :], -torch.inf))


def _chunked(q: Tensor, k: Tensor, v: Tensor, lg: Tensor, state0: Tensor, *, chunk: int):
    qc, kc, vc = (to_chunks(x, chunk) for x in (q, k, v))  # [B, H, N, C, D]
    G = chunk_cumsum(lg, chunk)  # [B, H, N, C]
    g_last = G[..., -1:]  # [B, H, N, 1]
    intra = (qc @ kc.mT) * gate_mask(G)  # [B, H, N, C, C]
    contrib = (kc * torch.exp(g_last - G)[..., None]).mT @ vc  # [B, H, N, DK, DV]
    states = [state0]  # states[i]: the state before chunk i; states[n]: the final state
    for i in range(qc.shape[2]):
        states.append(torch.exp(g_last[:, :, i, :, None]) * states[i] + contrib[:, :, i])
    inter = (qc * torch.exp(G)[..., None]) @ torch.stack(states[:-1], dim=2)
    return from_chunks(inter + intra @ vc, q.shape[1]), states[-1]


def gated_chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, chunk: int, **keywords
) -> Tensor | tuple[Tensor, Tensor]:
    """Reference B: chunked and vectorised with the gate's cumulative sums per chunk.

    Per chunk: ``O = (Q * exp(G)) @ S_prev + ((Q K^T) * Gamma) @ V`` and ``S = exp(G_last)
    S_prev + (K * exp(G_last - G))^T @ V``. chunk >= 1 (S need not be a multiple); the
    other arguments and the result as in ``gated_recurrent``.
    """
    return run_gated(partial(_chunked, chunk=check_chunk(chunk)), q, k, v, g, **keywords)


def _reversed(core: GatedCore) -> GatedCore:
    """``core`` run backwards in time: on the tokens reversed, token ``t'`` of the reversed
    sequence decaying by the gate of token ``L - t'`` (0 at ``t' = 0``)."""

    def run(q: Tensor, k: Tensor, v: Tensor, lg: Tensor, state0: Tensor) -> tuple[Tensor, Tensor]:
        shifted = F.pad(lg.flip(1)[:, :-1], (0, 0, 1, 0))
        out, state = core(q.flip(1), k.flip(1), v.flip(1), shifted, state0)
        return out.flip(1), state

    return run


def gated_reversed(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, chunk: int, **keywords
) -> Tensor | tuple[Tensor, Tensor]:
    """Reference B backwards in time, as the gated backward's reversed passes run the kernel::

        S_t = exp(g_{t+1}) * S_{t+1} + outer(k_t, v_t),    o_t = (scale * q_t) @ S_t

    from ``S_T`` = the initial state (after each sequence's last token, whose following gate
    counts as 0) down to ``S_0``, the final state. Arguments and result as in
    ``gated_chunked``."""
    return run_gated(_reversed(partial(_chunked, chunk=check_chunk(chunk))), q, k, v, g, **keywords)


# ---- C: the kernel's control flow --------------------------------------------------------


def _kernel_mimic(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lg: Tensor,
    state0: Tensor,
    *,
    chunk: int,
    block_dv: int,
    scale: float,
    rounded: torch.dtype | None,
):
    cast = (lambda x: x) if rounded is None else (lambda x: x.to(rounded).to(F64))  # noqa: E731
    b, s, h, dk = q.shape
    dv = v.shape[-1]
    pad = -s % chunk  # zero rows, as the kernel's bounds-checked tile copies read past S
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2) for x in (q, k, v))  # [B, H, S', D]
    lg = F.pad(lg, (0, 0, 0, pad)).transpose(1, 2)  # [B, H, S']
    r = torch.arange(chunk, device=q.device)
    causal = r[:, None] >= r[None, :]
    out, final = q.new_empty(b, h, s + pad, dv), q.new_empty(b, h, dk, dv)
    for dv0 in range(0, dv, block_dv):
        cols = slice(dv0, dv0 + block_dv)
        state = state0[..., cols]  # loaded once per block
        for s0 in range(0, s + pad, chunk):
            m = min(chunk, s - s0)  # the chunk's real rows
            rows = slice(s0, s0 + chunk)
            qs, ks, vs = q[:, :, rows], k[:, :, rows], v[:, :, rows, cols]  # [B, H, C, D]
            gate = torch.where(r < m, lg[:, :, rows], 0.0)  # rows past m: no decay
            G = gate.cumsum(dim=-1)  # [B, H, C], the chunk's scan
            g_last = G[..., m - 1 : m]  # [B, H, 1]
            # exp only where j <= i: the other exponents are >= 0
            diff = torch.where(causal, G[..., :, None] - G[..., None, :], 0.0)
            gamma = torch.where(causal, scale * torch.exp(diff), 0.0)  # [B, H, C, C]
            w_query = scale * torch.exp(G)  # [B, H, C]
            w_key = torch.where(r < m, torch.exp(g_last - G), 0.0)  # past m, G = G_last
            inter = (qs @ cast(state)) * w_query[..., None]  # [C, DK] @ [DK, bDV] -> [C, bDV], rows weighted
            scores = cast((qs @ ks.mT) * gamma)  # [C, DK] @ [DK, C] -> [C, C]
            out[:, :, rows, cols] = inter + scores @ vs  # output before the state update
            state = torch.exp(g_last)[..., None] * state + cast(ks * w_key[..., None]).mT @ vs
        final[..., cols] = state
    return out[:, :, :s].transpose(1, 2).contiguous(), final


def gated_kernel_mimic(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None,
    chunk: int,
    *,
    block_dv: int | None = None,
    scale: float = 1.0,
    rounded: torch.dtype | None = None,
    reverse: bool = False,
    **keywords,
) -> Tensor | tuple[Tensor, Tensor]:
    """Reference C: the gated kernel's control flow (``kernel.gated``), with a streaming state.

    Per sequence, outer loop over DV blocks of width ``block_dv`` (default all of DV), inner
    loop over chunks in order; per chunk the gate rows past the chunk's m real tokens are
    zeroed, scanned into ``G``, and every weight is ``exp`` of an exponent <= 0 (for gates
    <= 0), evaluated only where it is used; the scale rides on the query weights and the
    mask, never on Q. Output before the state update; the state decayed by ``exp(G_last)``
    before the chunk's keys are added. ``rounded``: a dtype (the kernel's inputs') that the
    three products' inputs the kernel casts are rounded to, the state, the masked scores
    and the weighted keys; None keeps them float64. ``reverse``: backwards in time, as
    ``gated_reversed``. Other arguments and the result as in ``gated_chunked``.
    """
    block_dv = v.shape[-1] if block_dv is None else check_chunk(block_dv, "block_dv")
    # q reaches the core unscaled, as the kernel reads it; the scale rides on its weights
    core = partial(
        _kernel_mimic, chunk=check_chunk(chunk), block_dv=block_dv, scale=check_scale(scale), rounded=rounded
    )
    return run_gated(_reversed(core) if reverse else core, q, k, v, g, scale=1.0, **keywords)
