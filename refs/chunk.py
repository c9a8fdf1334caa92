"""References B, C and D: the chunked forms of the scalar-decay recurrence (seed 3-4).

Inside a chunk of length C (0-based row r), the constant decay enters at three places,
every weight <= 1 (docs/design.md section 1):

* ``Gamma[i, j] = alpha^(i-j)`` for j <= i, else 0 (intra-chunk scores);
* ``w_decay[r] = alpha^(C-1-r)``: key rows written into the state, aligned to the chunk end;
* ``w_query[r] = alpha^(r+1)``: query rows reading the state left by the previous chunk;

and the state is carried across a chunk with ``alpha^C``. Per chunk:
``O = (Q * w_query) @ S_prev + ((Q K^T) * Gamma) @ V``, then
``S = alpha^C * S_prev + (K * w_decay)^T @ V``.
"""

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor
from torch.nn import functional as F

from ._checks import F64, check_alpha, check_chunk, check_qkv, from_chunks, to_chunks


class ChunkWeights(NamedTuple):
    gamma: Tensor  # [C, C] alpha^(i-j) where j <= i, else 0
    w_decay: Tensor  # [C] alpha^(C-1-r)
    w_query: Tensor  # [C] alpha^(r+1)
    state_decay: float  # alpha^C


def _powers(alpha: float, exponents: Tensor) -> Tensor:
    # log domain, as the kernel's exp2(log2(alpha) * k); never a cumulative product
    return torch.exp(math.log(alpha) * exponents)


def chunk_weights(alpha: float, chunk: int, *, device: torch.device | str | None = None) -> ChunkWeights:
    """The float64 decay weights of one chunk (every exponent >= 0, every weight <= 1)."""
    r = torch.arange(chunk, dtype=F64, device=device)
    dist = r[:, None] - r[None, :]  # i - j
    # clamp first so the masked-off entries (j > i) never evaluate alpha^(i-j) > 1
    gamma = torch.where(dist >= 0, _powers(alpha, dist.clamp(min=0)), 0.0)
    return ChunkWeights(gamma, _powers(alpha, chunk - 1 - r), _powers(alpha, r + 1), alpha**chunk)


def _chunk_forward(q: Tensor, k: Tensor, v: Tensor, alpha: float, chunk: int, *, factorised: bool) -> Tensor:
    check_qkv(q, k, v)
    alpha, chunk = check_alpha(alpha), check_chunk(chunk)
    qc, kc, vc = (to_chunks(x, chunk) for x in (q, k, v))  # [B, H, N, C, D]
    w = chunk_weights(alpha, chunk, device=q.device)
    if factorised:
        # alpha^(i-j) = alpha^i * alpha^-j: exact in fp64, alpha^-j > 1 overflows fp16
        r = torch.arange(chunk, dtype=F64, device=q.device)
        q_up, k_down = qc * _powers(alpha, r)[:, None], kc * _powers(alpha, -r)[:, None]
        intra = (q_up @ k_down.transpose(-1, -2)).tril()  # [B, H, N, C, C]
    else:
        intra = (qc @ kc.transpose(-1, -2)) * w.gamma  # [B, H, N, C, C]
    contrib = (kc * w.w_decay[:, None]).transpose(-1, -2) @ vc  # [B, H, N, DK, DV]
    states = torch.zeros_like(contrib)  # states[:, :, n] = S_prev of chunk n
    for n in range(1, contrib.shape[2]):
        states[:, :, n] = w.state_decay * states[:, :, n - 1] + contrib[:, :, n - 1]
    out = (qc * w.w_query[:, None]) @ states + intra @ vc  # [B, H, N, C, DV]
    return from_chunks(out, q.shape[1])


def chunked(q: Tensor, k: Tensor, v: Tensor, alpha: float, chunk: int) -> Tensor:
    """Reference B (seed 4.2): chunked and vectorised with the three decay weights.

    q, k: ``[B, S, H, DK]``; v: ``[B, S, H, DV]``; alpha in (0, 1]; chunk >= 1 (S need
    not be a multiple). Returns float64 ``[B, S, H, DV]``.
    """
    return _chunk_forward(q, k, v, alpha, chunk, factorised=False)


def factorised(q: Tensor, k: Tensor, v: Tensor, alpha: float, chunk: int) -> Tensor:
    """Reference D (seed 3-4): as ``chunked``, intra-chunk term ``tril((Q*alpha^i)(K*alpha^-j)^T) V``.

    Algebraically equal to B and, in float64, numerically too for moderate
    ``alpha^-(C-1)``; see ``intra_chunk`` for how it fails in fp16.
    """
    return _chunk_forward(q, k, v, alpha, chunk, factorised=True)


def kernel_mimic(
    q: Tensor, k: Tensor, v: Tensor, alpha: float, chunk: int, *, block_dv: int | None = None
) -> Tensor:
    """Reference C (seed 4.3): the kernel's control flow, with a streaming state.

    Outer loop over DV blocks of width ``block_dv`` (the kernel grid's first axis; default
    all of DV), inner loop over chunks in order (the ``T.Pipelined`` loop), batch and heads
    vectorised (the grid's second axis). The output of a chunk is written before the state
    is updated, and the state is decayed before the chunk's contribution is added. Runs
    on the inputs' device. Shapes as in ``chunked``; returns float64 ``[B, S, H, DV]``.
    """
    check_qkv(q, k, v)
    alpha, chunk = check_alpha(alpha), check_chunk(chunk)
    b, s, h, dk = q.shape
    dv = v.shape[-1]
    block_dv = dv if block_dv is None else check_chunk(block_dv, "block_dv")
    pad = -s % chunk  # zero rows, as the kernel's bounds-checked tile copies read past S
    # [B, S, H, D] -> [B, H, S', D], zero-padded to whole chunks
    q, k, v = (F.pad(x.to(F64), (0, 0, 0, 0, 0, pad)).transpose(1, 2).contiguous() for x in (q, k, v))
    w = chunk_weights(alpha, chunk, device=q.device)
    out = q.new_empty(b, h, s + pad, dv)
    for dv0 in range(0, dv, block_dv):
        cols = slice(dv0, dv0 + block_dv)
        state = q.new_zeros(b, h, dk, min(block_dv, dv - dv0))  # cleared once per block
        for s0 in range(0, s + pad, chunk):
            rows = slice(s0, s0 + chunk)
            qs, ks, vs = q[:, :, rows], k[:, :, rows], v[:, :, rows, cols]  # [B, H, C, D]
            inter = (qs * w.w_query[:, None]) @ state  # [C, DK] @ [DK, bDV] -> [C, bDV]
            scores = (qs @ ks.transpose(-1, -2)) * w.gamma  # [C, DK] @ [DK, C] -> [C, C]
            out[:, :, rows, cols] = inter + scores @ vs  # output before the state update
            state = w.state_decay * state + (ks * w.w_decay[:, None]).transpose(-1, -2) @ vs
    return out[:, :, :s].transpose(1, 2).contiguous()


def intra_chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alpha: float,
    *,
    form: Literal["ratio", "factorised"],
    storage: torch.dtype = torch.float16,
) -> Tensor:
    """The seed's single-chunk experiment (3.1): fp16 storage, fp32 accumulation.

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
