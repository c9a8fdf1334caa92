"""float64 torch references for chunked linear attention with a constant scalar decay.

Layout ``[B, S, H, D]`` everywhere, as the kernel. The ladder of trust (seed section 4):
``recurrent`` (A, the definition) checks ``chunked`` (B), ``kernel_mimic`` (C) and
``factorised`` (D); ``plain_chunked`` is the no-decay case they reduce to at alpha = 1.
``chunked_backward`` (E) is the chunked backward pass, checked against autograd through A.
``gated_recurrent``, ``gated_chunked``, ``gated_kernel_mimic`` are A, B and C for a decay that
changes per token (fla's log-gate ``g``, groups of q and k), ``gated_reversed`` B backwards in
time; ``gated_chunked_backward`` their backward, the gate's gradient included.
"""

import importlib
from typing import Any

# The correctness bound: relative L2 against reference C (``kernel_mimic``) that every
# kernel result must stay under, in the tuner, the validation sweep, the bench and the tests.
TOLERANCE = 2e-2

# Loaded on first use (they need torch), so that reading ``TOLERANCE`` stays cheap.
_LAZY = {
    **dict.fromkeys(
        ("ChunkWeights", "chunk_weights", "chunked", "factorised", "intra_chunk", "kernel_mimic"), "chunk"
    ),
    "chunked_backward": "backward",
    **dict.fromkeys(("gated_chunked", "gated_kernel_mimic", "gated_recurrent", "gated_reversed"), "gated"),
    "gated_chunked_backward": "gated_backward",
    "rel_l2": "metrics",
    **dict.fromkeys(("decay_mask", "parallel", "plain_chunked", "recurrent"), "naive"),
    **dict.fromkeys(
        (
            "GammaStats",
            "effective_memory_length",
            "factorised_peak",
            "factorised_safe_chunk_limit",
            "float_class",
            "gamma_matrix",
            "gamma_underflow",
        ),
        "numerics",
    ),
}

__all__ = ["TOLERANCE", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"refs.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'refs' has no attribute {name!r}")
