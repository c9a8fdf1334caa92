"""The decays of the report: a study's decays and their label, the error per decay, the decay mask of one
chunk, and where the factorised form overflows fp16 (the seed's numerical traps)."""

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import torch

from kernel.config import GATE_RANGE, retnet_decay
from refs import factorised_peak, gamma_matrix

FP16_MAX = float(torch.finfo(torch.float16).max)  # 65504
OVERFLOW_ALPHAS = (0.5, 0.8, 0.9, 0.95, 0.99, 0.999, 1.0)
OVERFLOW_CHUNKS = (16, 32, 64, 128, 256, 512, 1024, 2048)


class GammaInfo(NamedTuple):
    alpha: float
    chunk: int
    gamma: np.ndarray  # [C, C] alpha^(i-j) for j <= i; NaN above the diagonal (future tokens)


class OverflowInfo(NamedTuple):
    alphas: tuple[float, ...]
    chunks: tuple[int, ...]
    peak: np.ndarray  # [alphas, chunks] alpha^-(C-1), the factorised form's largest weight
    overflow: np.ndarray  # [alphas, chunks] bool: the peak is over the fp16 maximum
    limit: float


def gamma_info(alpha: float, chunk: int) -> GammaInfo:
    """The decay mask ``Gamma [C, C]`` of the seed's figure, future tokens as NaN."""
    gamma = gamma_matrix(alpha, chunk, torch.float64).numpy().copy()
    gamma[np.triu_indices(chunk, k=1)] = np.nan
    return GammaInfo(float(alpha), int(chunk), gamma)


def overflow_map(
    alphas: Sequence[float] = OVERFLOW_ALPHAS,
    chunks: Sequence[int] = OVERFLOW_CHUNKS,
    *,
    limit: float = FP16_MAX,
) -> OverflowInfo:
    """The factorised form's peak weight ``alpha^-(C-1)`` over alpha x C, and where it
    overflows ``limit`` (fp16: 65504)."""
    peak = np.array([[factorised_peak(a, c) for c in chunks] for a in alphas])
    return OverflowInfo(tuple(alphas), tuple(chunks), peak, peak > limit, float(limit))


def study_decays(problem: Mapping[str, Any], decays: Sequence[float] | None = None) -> tuple[float, ...]:
    """The decays a study checked its trials with: ``decays`` where its record names them
    (``reports.data.StudyInfo``), else RetNet's per head (``kernel.config.retnet_decay``,
    what the tuner uses)."""
    if decays:
        return tuple(float(d) for d in decays)
    return retnet_decay(int(problem.get("heads", 1)))


def decay_label(problem: Mapping[str, Any], decays: Sequence[float] | None = None) -> str:
    """The study's decays in a few characters: ``α = 0.99``, ``RetNet γ, H = 16: 0.969-1``,
    or a per-token gate's (``Problem.gate``) ``per-token g, -0.0001 to -20, G = 1``."""
    if problem.get("gate") == "token":
        lo, hi = GATE_RANGE
        return f"per-token g, -{lo:g} to -{hi:g}, G = {problem.get('groups') or problem.get('heads')}"
    if decays and len(decays) == 1:
        return f"α = {float(decays[0]):g}"
    decays = study_decays(problem, decays)
    return f"RetNet γ, H = {len(decays)}: {min(decays):.3g}-{max(decays):.3g}"


def error_by_decay(frame: pd.DataFrame) -> pd.DataFrame:
    """Trials with a measured error: ``decay``, ``rel_l2``, ``feasible``, ``chunk``, ``number``, ``config``,
    ``hover``."""
    has = frame[frame.rel_l2.notna()]
    return (
        has[["decay", "rel_l2", "feasible", "chunk", "number", "config", "hover"]]
        .sort_values(["decay", "number"])
        .reset_index(drop=True)
    )
