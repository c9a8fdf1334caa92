"""References B, C and D: the chunked forms of the scalar-decay recurrence (docs/design.md
sections 1-2).

Inside a chunk of length C (0-based row r), the constant decay enters at three places,
every weight <= 1 (docs/design.md section 1):

* ``Gamma[i, j] = alpha^(i-j)`` for j <= i, else 0 (intra-chunk scores);
* ``w_decay[r] = alpha^(C-1-r)``: key rows written into the state, aligned to the chunk end;
* ``w_query[r] = alpha^(r+1)``: query rows reading the state left by the previous chunk;

and the state is carried across a chunk with ``alpha^C``. Per chunk:
``O = (Q * w_query) @ S_prev + ((Q K^T) * Gamma) @ V``, then
``S = alpha^C * S_prev + (K * w_decay)^T @ V``. With one decay per head the weights gain a
leading head axis. A ragged last chunk of L < C real rows writes the state with
``alpha^(L-1-r)`` and carries it with ``alpha^L`` (``chunk_weights(length=L)``), so that
the final state is the one after the sequence's last token.

The keywords follow fla's ``chunk_simple_gla`` (``alpha_h = exp(g_gamma_h)``): ``scale``
multiplies the queries, ``initial_state`` is ``S_0`` and ``cu_seqlens`` packs independent
sequences, each chunked from its own first token (``refs._checks.run_sequences``).
"""

from functools import partial
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor
from torch.nn import functional as F

from ._checks import F64, check_alpha, check_chunk, check_qkv, from_chunks, to_chunks
from .naive import run_fla


class ChunkWeights(NamedTuple):
    """The decay weights for a float alpha; for one alpha per head each gains a leading ``[H]``."""

    gamma: Tensor  # [C, C] alpha^(i-j) where j <= i, else 0
    w_decay: Tensor  # [C] alpha^(L-1-r) where r < L, else 0 (L = C but in a ragged last chunk)
    w_query: Tensor  # [C] alpha^(r+1)
    state_decay: Tensor  # [] alpha^L


def _powers(alpha: float | Tensor, exponents: Tensor) -> Tensor:
    """``alpha^exponents``, shape ``alpha.shape + exponents.shape``.

    Log domain, as the kernel's exp2(log2(alpha) * k); never a cumulative product.
    """
    log_alpha = torch.log(torch.as_tensor(alpha, dtype=F64, device=exponents.device))
    return torch.exp(log_alpha.reshape(log_alpha.shape + (1,) * exponents.dim()) * exponents)


def chunk_weights(
    alpha: float | Tensor, chunk: int, *, length: int | None = None, device: torch.device | str | None = None
) -> ChunkWeights:
    """The float64 decay weights of one chunk (every exponent >= 0, every weight <= 1).

    alpha: a float, or one decay per head ``[H]``. length: the real rows L of a ragged
    last chunk (default: all C); only the state update depends on it.
    """
    length = chunk if length is None else length
    if not 1 <= length <= chunk:
        raise ValueError(f"length: expected 1 <= length <= chunk = {chunk}, got {length}")
    r = torch.arange(chunk, dtype=F64, device=device)
    dist, to_end = r[:, None] - r[None, :], length - 1 - r  # i - j; L-1-r
    # clamp first so the masked-off entries never evaluate a weight alpha^(negative) > 1
    gamma = torch.where(dist >= 0, _powers(alpha, dist.clamp(min=0)), 0.0)
    w_decay = torch.where(to_end >= 0, _powers(alpha, to_end.clamp(min=0)), 0.0)
    return ChunkWeights(gamma, w_decay, _powers(alpha, r + 1), _powers(alpha, r.new_tensor(float(length))))


def _chunked(
    q: Tensor, k: Tensor, v: Tensor, decay: Tensor, state0: Tensor, *, chunk: int, factorised: bool
) -> tuple[Tensor, Tensor]:
    s = q.shape[1]
    qc, kc, vc = (to_chunks(x, chunk) for x in (q, k, v))  # [B, H, N, C, D]
    n = qc.shape[2]
    w = chunk_weights(decay, chunk, device=q.device)  # [H, C, C], [H, C], [H, C], [H]
    last = chunk_weights(decay, chunk, length=s - (n - 1) * chunk, device=q.device)
    if factorised:
        # alpha^(i-j) = alpha^i * alpha^-j: exact in fp64, alpha^-j > 1 overflows fp16
        r = torch.arange(chunk, dtype=F64, device=q.device)
        q_up, k_down = qc * _powers(decay, r)[:, None, :, None], kc * _powers(decay, -r)[:, None, :, None]
        intra = (q_up @ k_down.transpose(-1, -2)).tril()  # [B, H, N, C, C]
    else:
        intra = (qc @ kc.transpose(-1, -2)) * w.gamma[:, None]  # [B, H, N, C, C]
    contrib = (kc * w.w_decay[:, None, :, None]).transpose(-1, -2) @ vc  # [B, H, N, DK, DV]
    contrib[:, :, -1] = (kc[:, :, -1] * last.w_decay[..., None]).transpose(-1, -2) @ vc[:, :, -1]
    states = [state0]  # states[i] = S_prev of chunk i; states[n] = the final state
    for i in range(n):
        carry = (w if i < n - 1 else last).state_decay[:, None, None]
        states.append(carry * states[i] + contrib[:, :, i])
    out = (qc * w.w_query[:, None, :, None]) @ torch.stack(states[:-1], dim=2) + intra @ vc
    return from_chunks(out, s), states[-1]


def chunked(
    q: Tensor, k: Tensor, v: Tensor, alpha: float | Tensor, chunk: int, **keywords: Any
) -> Tensor | tuple[Tensor, Tensor]:
    """Reference B: chunked and vectorised with the three decay weights.

    q, k: ``[B, S, H, DK]``; v: ``[B, S, H, DV]``; alpha: a float in (0, 1] or one per
    head ``[H]``; chunk >= 1 (S need not be a multiple); keywords: fla's, as
    ``refs.naive.recurrent`` takes them (scale, initial_state ``[B, H, DK, DV]``,
    cu_seqlens, output_final_state). Returns float64 o ``[B, S, H, DV]``, or ``(o,
    final_state)`` with output_final_state.
    """
    return run_fla(partial(_chunked, chunk=check_chunk(chunk), factorised=False), q, k, v, alpha, keywords)


def factorised(
    q: Tensor, k: Tensor, v: Tensor, alpha: float | Tensor, chunk: int, **keywords: Any
) -> Tensor | tuple[Tensor, Tensor]:
    """Reference D: as ``chunked``, intra-chunk term ``tril((Q*alpha^i)(K*alpha^-j)^T) V``.

    Algebraically equal to B and, in float64, numerically too for moderate
    ``alpha^-(C-1)`` (it overflows fp64 past alpha^-(C-1) ~ 1.8e308, e.g. alpha = 0.05
    at C = 238); see ``intra_chunk`` for how it fails in fp16.
    """
    return run_fla(partial(_chunked, chunk=check_chunk(chunk), factorised=True), q, k, v, alpha, keywords)


def _kernel_mimic(
    q: Tensor, k: Tensor, v: Tensor, decay: Tensor, state0: Tensor, *, chunk: int, block_dv: int
) -> tuple[Tensor, Tensor]:
    b, s, h, dk = q.shape
    dv = v.shape[-1]
    pad = -s % chunk  # zero rows, as the kernel's bounds-checked tile copies read past S
    # [B, S, H, D] -> [B, H, S', D], zero-padded to whole chunks
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2).contiguous() for x in (q, k, v))
    w = chunk_weights(decay, chunk, device=q.device)  # per head: [H, C, C], [H, C], [H, C], [H]
    last = chunk_weights(decay, chunk, length=chunk - pad, device=q.device)  # the last chunk's
    out, final = q.new_empty(b, h, s + pad, dv), q.new_empty(b, h, dk, dv)
    for dv0 in range(0, dv, block_dv):
        cols = slice(dv0, dv0 + block_dv)
        state = state0[..., cols]  # loaded once per block
        for s0 in range(0, s + pad, chunk):
            ws = w if s0 + chunk < s + pad else last
            rows = slice(s0, s0 + chunk)
            qs, ks, vs = q[:, :, rows], k[:, :, rows], v[:, :, rows, cols]  # [B, H, C, D]
            inter = (qs * ws.w_query[..., None]) @ state  # [C, DK] @ [DK, bDV] -> [C, bDV]
            scores = (qs @ ks.transpose(-1, -2)) * ws.gamma  # [C, DK] @ [DK, C] -> [C, C]
            out[:, :, rows, cols] = inter + scores @ vs  # output before the state update
            state = (
                ws.state_decay[:, None, None] * state + (ks * ws.w_decay[..., None]).transpose(-1, -2) @ vs
            )
        final[..., cols] = state
    return out[:, :, :s].transpose(1, 2).contiguous(), final


def kernel_mimic(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alpha: float | Tensor,
    chunk: int,
    *,
    block_dv: int | None = None,
    **keywords: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """Reference C: the kernel's control flow (docs/design.md section 4), with a streaming state.

    Per sequence (a grid block walks one), outer loop over DV blocks of width ``block_dv``
    (the kernel grid's first axis; default all of DV), inner loop over chunks in order (the
    ``T.Pipelined`` loop), batch and heads vectorised (the grid's second axis) with per-head
    decay weights. The output of a chunk is written before the state is updated, and the
    state is decayed before the chunk's contribution is added. Runs on the inputs' device.
    Arguments and result as in ``chunked``.
    """
    block_dv = v.shape[-1] if block_dv is None else check_chunk(block_dv, "block_dv")
    return run_fla(
        partial(_kernel_mimic, chunk=check_chunk(chunk), block_dv=block_dv), q, k, v, alpha, keywords
    )


def intra_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alpha: float,
    *,
    form: Literal["ratio", "factorised"],
    storage: torch.dtype = torch.float16,
) -> Tensor:
    """The single-chunk experiment of docs/design.md section 2: fp16 storage, fp32 accumulation.

    The whole sequence is one chunk (C = S). q, k: ``[B, C, H, DK]``; v: ``[B, C, H, DV]``.
    Inputs are rounded to ``storage``; every matmul takes ``storage`` operands and
    accumulates in fp32 (products of fp16 values are exact in fp32).

    * ``"ratio"``: scores ``Q K^T`` in fp32, times the fp32 table ``Gamma`` (evaluated
      only where j <= i); the product is cast to ``storage`` before ``@ V``.
    * ``"factorised"``: ``Q * alpha^i`` and ``K * alpha^-j`` materialised in ``storage``
      (``alpha^-j`` overflows fp16 to inf for alpha <= 0.8 at C = 64, so the output is
      NaN), scores in fp32, ``tril``, cast to ``storage`` before ``@ V``.

    Returns the fp32 accumulator as float64 ``[B, C, H, DV]`` (not rounded to storage).
    """
    check_qkv(q, k, v)
    alpha = check_alpha(alpha)
    if form not in ("ratio", "factorised"):
        raise ValueError(f"form: expected 'ratio' or 'factorised', got {form!r}")
    acc = torch.promote_types(storage, torch.float32)
    chunk = q.shape[1]

    def mm(a: Tensor, b: Tensor, spec: str) -> Tensor:  # storage operands, fp32 accumulation
        return torch.einsum(spec, a.to(storage).to(acc), b.to(storage).to(acc))

    qs, ks, vs = (x.to(storage).to(acc) for x in (q, k, v))
    if form == "ratio":
        gamma = chunk_weights(alpha, chunk, device=q.device).gamma.to(acc)  # [C, C]
        scores = mm(qs, ks, "bihk,bjhk->bhij") * gamma
    else:
        r = torch.arange(chunk, dtype=F64, device=q.device)
        up, down = _powers(alpha, r).to(acc), _powers(alpha, -r).to(acc)  # [C]
        q_up = (qs * up[:, None, None]).to(storage)  # [B, C, H, DK]
        k_down = (ks * down[:, None, None]).to(storage)
        scores = mm(q_up, k_down, "bihk,bjhk->bhij").tril()
    return mm(scores, vs, "bhij,bjhv->bihv").to(F64)
