"""The seed's pure-arithmetic tables (sections 3 and 6) as functions."""

import math
from typing import Literal, NamedTuple

import torch

from ._checks import check_alpha, check_chunk
from .chunk import chunk_weights

FloatClass = Literal["normal", "subnormal", "zero"]


def factorised_peak(alpha: float, chunk: int) -> float:
    """``alpha^-(C-1)``: the largest weight the factorised form materialises (inf past fp64)."""
    alpha, chunk = check_alpha(alpha), check_chunk(chunk)
    try:
        return math.exp(-(chunk - 1) * math.log(alpha))
    except OverflowError:
        return math.inf


def factorised_safe_chunk_limit(alpha: float, dtype: torch.dtype = torch.float16) -> int | float:
    """The seed's "C < limit" bound (section 3 table): the largest n with alpha^-n <= max(dtype).

    Reproduces the seed's numbers (fp16: 1103, 216, 105, 49, 15 for alpha = 0.99, 0.95,
    0.90, 0.80, 0.50). Taken literally, the bound is conservative: the factorised form's
    peak weight is alpha^-(C-1), so it stays finite for every ``C <= limit + 1``.
    Returns ``math.inf`` at alpha = 1.
    """
    alpha = check_alpha(alpha)
    if alpha == 1.0:
        return math.inf
    # log domain: alpha^-n itself overflows float64 for fp64's own limit
    return math.floor(math.log(torch.finfo(dtype).max) / -math.log(alpha))


def effective_memory_length(alpha: float, eps: float = 1e-3) -> float:
    """``L = ln(eps) / ln(alpha)``: tokens until a weight decays to eps (seed 6; inf at 1).

    The seed prints it rounded to the nearest token (66 at 0.9, 135 at 0.95).
    """
    alpha = check_alpha(alpha)
    if not 0.0 < eps < 1.0:
        raise ValueError(f"eps: expected 0 < eps < 1, got {eps}")
    return math.inf if alpha == 1.0 else math.log(eps) / math.log(alpha)


def gamma_matrix(alpha: float, chunk: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The intra-chunk weights ``Gamma [C, C]`` (alpha^(i-j), j <= i, else 0) rounded to dtype."""
    return chunk_weights(check_alpha(alpha), check_chunk(chunk)).gamma.to(dtype)


def float_class(x: float, dtype: torch.dtype) -> FloatClass:
    """Whether ``x >= 0`` rounded to dtype is a normal number, subnormal, or zero."""
    y = torch.tensor(x, dtype=torch.float64).to(dtype).item()
    if y == 0.0:
        return "zero"
    return "normal" if y >= torch.finfo(dtype).tiny else "subnormal"


class GammaStats(NamedTuple):
    max: float
    min_nonzero: float  # smallest nonzero weight of the causal triangle
    underflow_fraction: float  # causal (j <= i) weights that rounded to 0
    corner: float  # alpha^(C-1), the smallest weight, as stored in dtype
    corner_class: FloatClass


def gamma_underflow(alpha: float, chunk: int, dtype: torch.dtype = torch.float32) -> GammaStats:
    """How ``Gamma`` fares when stored in dtype (seed 3.1 and 3.2 tables)."""
    gamma = gamma_matrix(alpha, chunk, dtype).to(torch.float64)
    causal = gamma[torch.ones_like(gamma, dtype=torch.bool).tril()]
    nonzero = causal[causal > 0]
    corner = alpha ** (chunk - 1)
    return GammaStats(
        max=causal.max().item(),
        min_nonzero=nonzero.min().item(),
        underflow_fraction=(causal == 0).double().mean().item(),
        corner=gamma[-1, 0].item(),
        corner_class=float_class(corner, dtype),
    )
