"""Which forward configs of block_dv 256 compile on sm_90a (compile-only, no GPU): the rule
picked 64/256/3/256/smem at DK = 64, DV = 256, which failed ("Layout infer conflict"; the
H200 sweep of 128/256 failed every 256-thread config of block_dv 256 the same way,
``experiments/shipped/sweep-128x128_128x256-bfloat16-heldout.jsonl``). At 1 x 2 x 4096.

    python3 experiments/head_sizes/wide.py > experiments/head_sizes/wide.txt
"""

from kernel.builder import precompile
from kernel.config import KernelConfig, Problem
from kernel.probe import ProbeFailure

# (DK, DV, config): block_dv 256 at each knob off the rule's, then the widths below it
CASES = [
    (64, 256, KernelConfig(64, 256, 3, 256, "smem", 1)),
    (64, 256, KernelConfig(64, 256, 1, 256, "smem", 1)),
    (64, 256, KernelConfig(64, 256, 1, 256, "regs", 1)),
    (64, 256, KernelConfig(64, 256, 1, 128, "smem", 1)),
    (64, 256, KernelConfig(32, 256, 1, 256, "smem", 1)),
    (64, 256, KernelConfig(64, 128, 3, 256, "smem", 1)),
    (64, 256, KernelConfig(64, 256, 3, 256, "smem", 2)),
    (64, 192, KernelConfig(64, 192, 3, 256, "smem", 1)),
    (64, 224, KernelConfig(64, 224, 3, 256, "smem", 1)),
]


def main() -> None:
    jobs = [(Problem(1, 2, 4096, dk, dv), c) for dk, dv, c in CASES]
    for (p, c), r in zip(jobs, precompile(jobs, arch="sm_90a"), strict=True):
        said = f"failed: {r.message.splitlines()[0][:120]}" if isinstance(r, ProbeFailure) else "compiles"
        print(f"DK {p.dk} DV {p.dv} {c.label:<22} {said}", flush=True)


if __name__ == "__main__":
    main()
