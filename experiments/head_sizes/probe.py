"""Which head sizes the forward compiles for, per architecture (compile-only, no GPU): one
config per (DK, DV, block_dv), 64-token chunks, one stage, 256 threads, scores in shared
memory, one segment, at 1 x 2 x 4096.

    python3 experiments/head_sizes/probe.py > experiments/head_sizes/probe.txt
"""

from kernel.builder import precompile
from kernel.config import KernelConfig, Problem
from kernel.probe import ProbeFailure

# (DK, DV, block_dv): DK over the state's rows with DV = 64, then block_dv with DK = 64
CASES = [(dk, 64, 64) for dk in (16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256)] + [
    (64, dv, b)
    for dv, b in (
        (16, 16),
        (32, 32),
        (48, 48),
        (48, 16),
        (80, 80),
        (96, 96),
        (96, 32),
        (112, 112),
        (160, 32),
        (160, 160),
        (224, 32),
        (224, 224),
    )
]


def main() -> None:
    for arch in ("sm_90a", "sm_80"):
        jobs = [(Problem(1, 2, 4096, dk, dv), KernelConfig(64, b, 1, 256, "smem", 1)) for dk, dv, b in CASES]
        for (p, c), r in zip(jobs, precompile(jobs, arch=arch), strict=True):
            said = f"failed: {r.message.splitlines()[0][:100]}" if isinstance(r, ProbeFailure) else "compiles"
            print(f"{arch}  DK {p.dk:>3}  DV {p.dv:>3}  {c.label:<22} {said}", flush=True)


if __name__ == "__main__":
    main()
