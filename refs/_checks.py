"""Input validation and the chunked layout shared by every reference.

Checks raise ``ValueError`` (``TypeError`` for a wrong kind of argument) naming the
expected and the actual value; they never ``assert``, which ``python -O`` removes.
"""

import numbers

import torch
from torch import Tensor
from torch.nn import functional as F

F64 = torch.float64


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """q, k: ``[B, S, H, DK]``; v: ``[B, S, H, DV]``; all on one device."""
    if q.dim() != 4:
        raise ValueError(f"q: expected 4 dims [B, S, H, DK], got shape {tuple(q.shape)}")
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
    alpha = alpha.to(device=q.device, dtype=F64)
    if not bool(((alpha > 0) & (alpha <= 1)).all()):
        lo, hi = alpha.min().item(), alpha.max().item()
        raise ValueError(f"alpha: expected every alpha_t in (0, 1], got range [{lo}, {hi}]")
    return alpha


def check_chunk(chunk: int, name: str = "chunk") -> int:
    if isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral):
        raise TypeError(f"{name}: expected an int >= 1, got {type(chunk).__name__}")
    if chunk < 1:
        raise ValueError(f"{name}: expected >= 1, got {chunk}")
    return int(chunk)


def to_chunks(x: Tensor, chunk: int) -> Tensor:
    """``[B, S, H, D]`` -> float64 ``[B, H, N, C, D]``, N = ceil(S / C).

    The ragged last chunk is zero-padded: zero keys and values add nothing to the state
    or to the scores of real tokens, and the padded rows are cut off by ``from_chunks``.
    """
    b, s, h, d = x.shape
    n = -(-s // chunk)
    x = F.pad(x.to(F64), (0, 0, 0, 0, 0, n * chunk - s))
    return x.reshape(b, n, chunk, h, d).permute(0, 3, 1, 2, 4)


def from_chunks(y: Tensor, seqlen: int) -> Tensor:
    """``[B, H, N, C, D]`` -> ``[B, S, H, D]``, dropping the padded rows."""
    b, h, n, c, d = y.shape
    return y.permute(0, 2, 3, 1, 4).reshape(b, n * c, h, d)[:, :seqlen].contiguous()
