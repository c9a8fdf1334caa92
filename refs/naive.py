"""Reference A and its companions: the definition, its matrix form, and no decay.

Everything is float64 in the kernel's layout ``[B, S, H, D]``. The state is stored
transposed as the kernel holds it (docs/design.md section 1): ``S in R^{DK x DV}``,
``S_t = alpha_t * S_{t-1} + outer(k_t, v_t)``, ``o_t = (scale * q_t) @ S_t``, from ``S_0``
(``initial_state``, default zero). The keywords follow fla's ``chunk_simple_gla``
(``alpha_h = exp(g_gamma_h)``); see ``refs._checks.run_sequences``.
"""

from typing import Any

import torch
from torch import Tensor

from ._checks import F64, Core, check_chunk, check_qkv, from_chunks, run_sequences, to_chunks

# fla's keywords (``chunk_simple_gla``) with their defaults: every reference takes them.
FLA_DEFAULTS = {"scale": 1.0, "initial_state": None, "cu_seqlens": None, "output_final_state": False}


def run_fla(
    core: Core,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alpha: float | Tensor,
    keywords: dict[str, Any],
    **checks: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    """``core`` through ``refs._checks.run_sequences`` with fla's ``keywords`` (``scale``,
    ``initial_state``, ``cu_seqlens``, ``output_final_state``; an absent one takes its
    ``FLA_DEFAULTS`` value, any other raises ``TypeError``) and ``checks`` (``per_token``)."""
    return run_sequences(core, q, k, v, alpha, **checks, **(FLA_DEFAULTS | keywords))


def _recurrent(q: Tensor, k: Tensor, v: Tensor, decay: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    b, s, h, _ = q.shape
    decay = decay.expand(b, s, h)
    out = q.new_empty(b, s, h, v.shape[-1])
    for t in range(s):
        # S = alpha_t * S + outer(k_t, v_t): [B, H, DK, DV]
        state = decay[:, t, :, None, None] * state + k[:, t, :, :, None] * v[:, t, :, None, :]
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], state)  # o_t = q_t @ S_t
    return out, state


def recurrent(
    q: Tensor, k: Tensor, v: Tensor, alpha: float | Tensor, **keywords: Any
) -> Tensor | tuple[Tensor, Tensor]:
    """Reference A: the recurrence token by token, vectorised over batch and heads.

    q, k: ``[B, S, H, DK]``; v: ``[B, S, H, DV]``; alpha: a float in (0, 1], one decay per
    head ``[H]``, or per-token decays ``alpha_t`` ``[B, S, H]``. keywords: fla's
    (``run_fla``): scale (multiplies q), initial_state ``[B, H, DK, DV]`` (``[N, H, DK,
    DV]`` with cu_seqlens, N + 1 packed offsets over ``[1, T, H, D]`` inputs),
    output_final_state. Returns float64 o ``[B, S, H, DV]``, or ``(o, final_state)`` with
    output_final_state.
    """
    return run_fla(_recurrent, q, k, v, alpha, keywords, per_token=True)


def decay_mask(alpha: Tensor) -> Tensor:
    """The decay-aware causal mask ``Gamma[i, j] = gamma_i / gamma_j`` (j <= i), else 0.

    alpha: per-token decays ``[B, S, H]`` in (0, 1]. Returns float64 ``[B, H, S, S]``.
    ``log(gamma_i / gamma_j)`` is the segment sum of ``log alpha_r`` over j < r <= i,
    summed from j on (Mamba2's ``segsum``): no cumulative product to underflow, and no
    difference of two long prefix sums to cancel. It is exponentiated only where j <= i
    (elsewhere the ratio is > 1 and may overflow), so every entry lies in [0, 1].
    """
    s = alpha.shape[1]
    log_alpha = torch.log(alpha.to(F64)).transpose(1, 2)  # [B, H, S]
    strict = torch.ones(s, s, dtype=torch.bool, device=alpha.device).tril(-1)  # r > j
    terms = log_alpha[..., :, None].expand(*log_alpha.shape, s).masked_fill(~strict, 0.0)
    log_ratio = terms.cumsum(dim=-2)  # [B, H, S(i), S(j)]: sum of log alpha_r, j < r <= i
    causal = torch.ones(s, s, dtype=torch.bool, device=alpha.device).tril()
    return torch.exp(log_ratio.masked_fill(~causal, float("-inf")))


def _parallel(q: Tensor, k: Tensor, v: Tensor, decay: Tensor, state0: Tensor) -> tuple[Tensor, Tensor]:
    b, s, h, _ = q.shape
    decay = decay.expand(b, s, h)
    gamma = decay_mask(decay)  # [B, H, S, S]
    scores = torch.einsum("bihk,bjhk->bhij", q, k)  # [B, H, S, S]
    out = torch.einsum("bhij,bjhv->bihv", scores * gamma, v)
    # S_0 reaches token t decayed by alpha_0 ... alpha_t: a prefix sum of logs, exp <= 1
    from_start = torch.exp(torch.log(decay).cumsum(dim=1))  # [B, S, H]
    out = out + torch.einsum("bihk,bhkv->bihv", q * from_start[..., None], state0)
    # token j reaches the end decayed by alpha_{j+1} ... alpha_{S-1}: Gamma's last row
    state = from_start[:, -1, :, None, None] * state0 + torch.einsum(
        "bhj,bjhk,bjhv->bhkv", gamma[:, :, -1], k, v
    )
    return out, state


def parallel(
    q: Tensor, k: Tensor, v: Tensor, alpha: float | Tensor, **keywords: Any
) -> Tensor | tuple[Tensor, Tensor]:
    """The matrix parallel form ``O = ((Q K^T) * Gamma) V + (Q * gamma) S_0`` per sequence.

    Arguments and result as in ``recurrent``. O(S^2) memory: for checks, not for long
    sequences.
    """
    return run_fla(_parallel, q, k, v, alpha, keywords, per_token=True)


def plain_chunked(q: Tensor, k: Tensor, v: Tensor, chunk: int) -> Tensor:
    """Chunked linear attention without decay (the previous article's reference).

    Per chunk: ``O = Q @ S_prev + tril(Q K^T) V`` (diagonal included), where ``S_prev``
    is the sum of ``K^T V`` over the earlier chunks. Shapes as in ``recurrent``; S need
    not be a multiple of ``chunk``. Returns float64 ``[B, S, H, DV]``.
    """
    check_qkv(q, k, v)
    chunk = check_chunk(chunk)
    qc, kc, vc = (to_chunks(x, chunk) for x in (q, k, v))  # [B, H, N, C, D]
    kv = kc.transpose(-1, -2) @ vc  # [B, H, N, DK, DV]
    # exclusive prefix sum over chunks: chunk n reads the state left by chunks < n
    states = torch.cat([torch.zeros_like(kv[:, :, :1]), kv[:, :, :-1]], dim=2).cumsum(dim=2)
    scores = (qc @ kc.transpose(-1, -2)).tril()  # [B, H, N, C, C]
    return from_chunks(qc @ states + scores @ vc, q.shape[1])
