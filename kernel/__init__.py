"""The scalar-decay chunked linear-attention kernel in TileLang, its config and its probe.

The config types load at once; ``build`` and the probe's types (and what they need:
torch, TileLang) load on first use, so a command that only parses arguments stays fast.
"""

import importlib
from typing import Any

from kernel.config import HEADLINE, SEED_CONFIG, KernelConfig, Problem

_LAZY = {
    "ScalarDecayKernel": "kernel.builder",
    "build": "kernel.builder",
    "ProbeFailure": "kernel.probe",
    "ProbeResult": "kernel.probe",
    "Resources": "kernel.probe",
}

__all__ = ["HEADLINE", "SEED_CONFIG", "KernelConfig", "Problem", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kernel' has no attribute {name!r}")
