"""The scalar-decay chunked linear-attention kernel in TileLang, its config and its probe."""

from kernel.build import ScalarDecayKernel, build
from kernel.config import SEED_CONFIG, KernelConfig, Problem
from kernel.resources import SMEM_LIMIT_BYTES, ProbeFailure, ProbeResult, Resources, probe

__all__ = [
    "SEED_CONFIG",
    "SMEM_LIMIT_BYTES",
    "KernelConfig",
    "ProbeFailure",
    "ProbeResult",
    "Problem",
    "Resources",
    "ScalarDecayKernel",
    "build",
    "probe",
]
