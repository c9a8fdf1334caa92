"""Input validation, the chunked layout, and the sequence driver shared by every reference.

Checks raise ``ValueError`` (``TypeError`` for a wrong kind of argument) naming the
expected and the actual value; they never ``assert``, which ``python -O`` removes.
"""

import math
import numbers
from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn import functional as F

F64 = torch.float64

# core(q, k, v, decay, state0) -> (o, state): float64 q (already scaled), k, v ``[B, L, H, D]``
# of independent sequences, decay ``[H]`` (or per-token ``[B, L, H]``), the state before the
# first token ``[B, H, DK, DV]``; returns o ``[B, L, H, DV]`` and the state after the last token.
Core = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """q, k: ``[B, S, H, DK]``; v: ``[B, S, H, DV]``; S >= 1; all on one device."""
    if q.dim() != 4 or q.shape[1] < 1:
        raise ValueError(f"q: expected 4 dims [B, S, H, DK] with S >= 1, got shape {tuple(q.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k: expected shape {tuple(q.shape)} (as q), got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        b, s, h, _ = q.shape
        raise ValueError(f"v: expected shape ({b}, {s}, {h}, DV), got {tuple(v.shape)}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v: expected one device, got {q.device}, {k.device}, {v.device}")


def check_alpha(alpha: float) -> float:
    """A constant decay: a real number in (0, 1]."""
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"alpha: expected a float in (0, 1], got {type(alpha).__name__}")
    if not 0.0 < alpha <= 1.0:  # also rejects NaN
        raise ValueError(f"alpha: expected 0 < alpha <= 1, got {alpha}")
    return float(alpha)


def check_alpha_t(alpha: Tensor, q: Tensor) -> Tensor:
    """Per-token decays ``[B, S, H]`` in (0, 1], returned as float64 on q's device."""
    if alpha.shape != q.shape[:3]:
        raise ValueError(
            f"alpha: expected per-token shape {tuple(q.shape[:3])} [B, S, H], got {tuple(alpha.shape)}"
        )
    return _in_unit_interval(alpha.to(device=q.device, dtype=F64), "every alpha_t")


def check_decay(alpha: float | Tensor, q: Tensor, *, per_token: bool = False) -> Tensor:
    """A float, or one decay per head ``[H]`` (or, where per_token, ``[B, S, H]``), all in (0, 1].

    Returns float64 ``[H]`` (or ``[B, S, H]``) on q's device.
    """
    h = q.shape[2]
    if not isinstance(alpha, Tensor):
        return torch.full((h,), check_alpha(alpha), dtype=F64, device=q.device)
    if per_token and alpha.dim() == 3:
        return check_alpha_t(alpha, q)
    if alpha.shape != (h,):
        kinds = f"a float, per-head shape ({h},)" + (
            f" or per-token {tuple(q.shape[:3])}" if per_token else ""
        )
        raise ValueError(f"alpha: expected {kinds}, got {tuple(alpha.shape)}")
    return _in_unit_interval(alpha.to(device=q.device, dtype=F64), "every per-head alpha_h")


def _in_unit_interval(alpha: Tensor, what: str) -> Tensor:
    if not bool(((alpha > 0) & (alpha <= 1)).all()):  # also rejects NaN
        lo, hi = alpha.min().item(), alpha.max().item()
        raise ValueError(f"alpha: expected {what} in (0, 1], got range [{lo}, {hi}]")
    return alpha


def check_chunk(chunk: int, name: str = "chunk") -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral):
        raise TypeError(f"{name}: expected an int >= 1, got {type(chunk).__name__}")
    if chunk < 1:
        raise ValueError(f"{name}: expected >= 1, got {chunk}")
    return int(chunk)


def check_scale(scale: float) -> float:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale: expected a float, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float, got {scale}")
    return float(scale)


def check_cu_seqlens(cu_seqlens: Tensor, q: Tensor) -> list[tuple[int, int]]:
    """fla's packed offsets ``0 = c_0 < c_1 < ... < c_N = T`` over q ``[1, T, H, DK]``.

    Returns the N sequences as ``(start, end)`` token ranges.
    """
    integer = not (
        cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool
    )
    if cu_seqlens.dim() != 1 or len(cu_seqlens) < 2 or not integer:
        raise ValueError(
            f"cu_seqlens: expected a 1-D int tensor of N + 1 >= 2 offsets, got shape "
            f"{tuple(cu_seqlens.shape)} {cu_seqlens.dtype}"
        )
    if q.shape[0] != 1:
        raise ValueError(f"q: expected batch 1 [1, T, H, DK] with cu_seqlens, got shape {tuple(q.shape)}")
    c = [int(x) for x in cu_seqlens.tolist()]
    if c[0] != 0 or c[-1] != q.shape[1] or any(a >= b for a, b in zip(c, c[1:])):
        raise ValueError(f"cu_seqlens: expected strictly increasing from 0 to T = {q.shape[1]}, got {c}")
    return list(zip(c, c[1:]))


def check_state(state: Tensor | None, shape: tuple[int, ...], q: Tensor) -> Tensor:
    """The state before the first token, ``[N, H, DK, DV]`` in any float dtype (zero if None)."""
    if state is None:
        return torch.zeros(shape, dtype=F64, device=q.device)
    if tuple(state.shape) != shape or not state.is_floating_point():
        raise ValueError(
            f"initial_state: expected a float tensor of shape {shape} [N, H, DK, DV], "
            f"got {tuple(state.shape)} {state.dtype}"
        )
    return state.to(device=q.device, dtype=F64)


def run_sequences(
    core: Core,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alpha: float | Tensor,
    *,
    scale: float,
    initial_state: Tensor | None,
    cu_seqlens: Tensor | None,
    output_final_state: bool,
    per_token: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Validate the inputs shared by every reference, then run ``core`` on each sequence.

    Without cu_seqlens the B rows are the sequences (one call); with it, each packed
    sequence is its own call, from its own initial state, so nothing crosses a boundary.
    Returns float64 o ``[B, S, H, DV]``, and with output_final_state also the final
    state ``[N, H, DK, DV]``.
    """
    check_qkv(q, k, v)
    b, _, h, dk = q.shape
    decay = check_decay(alpha, q, per_token=per_token)
    q = q.to(F64) * check_scale(scale)
    k, v = k.to(F64), v.to(F64)
    if cu_seqlens is None:
        state0 = check_state(initial_state, (b, h, dk, v.shape[-1]), q)
        out, state = core(q, k, v, decay, state0)
    else:
        seqs = check_cu_seqlens(cu_seqlens, q)
        state0 = check_state(initial_state, (len(seqs), h, dk, v.shape[-1]), q)
        parts = [
            core(
                q[:, a:e],
                k[:, a:e],
                v[:, a:e],
                decay[:, a:e] if decay.dim() == 3 else decay,
                state0[n : n + 1],
            )
            for n, (a, e) in enumerate(seqs)
        ]
        out, state = torch.cat([o for o, _ in parts], dim=1), torch.cat([s for _, s in parts])
    return (out, state) if output_final_state else out


def to_chunks(x: Tensor, chunk: int) -> Tensor:
    """``[B, S, H, D]`` -> float64 ``[B, H, N, C, D]``, N = ceil(S / C).

    The ragged last chunk is zero-padded: zero keys and values add nothing to the scores
    of real tokens, and the padded rows are cut off by ``from_chunks``. (They would still
    decay the state: the state after a ragged last chunk takes that chunk's own weights,
    ``chunk_weights(..., length=...)``.)
    """
    b, s, h, d = x.shape
    n = -(-s // chunk)
    x = F.pad(x.to(F64), (0, 0, 0, 0, 0, n * chunk - s))
    return x.reshape(b, n, chunk, h, d).permute(0, 3, 1, 2, 4)


def from_chunks(y: Tensor, seqlen: int) -> Tensor:
    """``[B, H, N, C, D]`` -> ``[B, S, H, D]``, dropping the padded rows."""
    b, h, n, c, d = y.shape
    return y.permute(0, 2, 3, 1, 4).reshape(b, n * c, h, d)[:, :seqlen].contiguous()
