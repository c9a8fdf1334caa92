"""Where sm_80's 8 warps cannot share the state's DK x block_dv in whole 16 x 8 ``mma.sync``
tiles ((DK / 16) * (block_dv / 8) not a multiple of 8), the forward does not compile; where
they can, it does (compile-only, 1 x 2 x 4096, 64-token chunks, one stage, 256 threads):

    python3 experiments/head_sizes/sm80_warps.py > experiments/head_sizes/sm80_warps.txt
"""

from kernel.builder import precompile
from kernel.config import KernelConfig, Problem
from kernel.probe import ProbeFailure

CASES = [(16, 16, 16), (32, 16, 16), (32, 32, 32), (48, 48, 48), (48, 96, 32), (80, 80, 16), (48, 64, 64)]


def main() -> None:
    jobs = [(Problem(1, 2, 4096, dk, dv), KernelConfig(64, b, 1, 256, "smem", 1)) for dk, dv, b in CASES]
    for (p, c), r in zip(jobs, precompile(jobs, arch="sm_80"), strict=True):
        tiles = (p.dk // 16) * (c.block_dv // 8)
        said = f"failed: {r.message.splitlines()[0][:90]}" if isinstance(r, ProbeFailure) else "compiles"
        print(f"sm_80  DK {p.dk:>3}  DV {p.dv:>3}  {c.label:<20} {tiles:>3} tiles  {said}", flush=True)


if __name__ == "__main__":
    main()
