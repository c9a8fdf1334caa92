"""float64 torch references for chunked linear attention with a constant scalar decay.

Layout ``[B, S, H, D]`` everywhere, as the kernel. The ladder of trust (seed section 4):
``recurrent`` (A, the definition) checks ``chunked`` (B), ``kernel_mimic`` (C) and
``factorised`` (D); ``plain_chunked`` is the no-decay case they reduce to at alpha = 1.
"""

from .chunk import ChunkWeights, chunk_weights, chunked, factorised, intra_chunk, kernel_mimic
from .metrics import rel_l2
from .naive import decay_mask, parallel, plain_chunked, recurrent
from .numerics import (
    GammaStats,
    effective_memory_length,
    factorised_peak,
    factorised_safe_chunk_limit,
    float_class,
    gamma_table,
    gamma_underflow,
)

__all__ = [
    "ChunkWeights",
    "GammaStats",
    "chunk_weights",
    "chunked",
    "decay_mask",
    "effective_memory_length",
    "factorised",
    "factorised_peak",
    "factorised_safe_chunk_limit",
    "float_class",
    "gamma_table",
    "gamma_underflow",
    "intra_chunk",
    "kernel_mimic",
    "parallel",
    "plain_chunked",
    "recurrent",
    "rel_l2",
]
