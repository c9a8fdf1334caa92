"""Compile kernel.gated's forward for sm_90a on a CPU (no GPU needed) and print each config's
registers, spills and shared memory, as ``kernel.probe.probe_funcs`` reads them from
ptxas and the lowered module.

    python3 experiments/gated/probe.py > experiments/gated/probe.txt
    python3 experiments/gated/probe.py --packed > experiments/gated/probe_packed.txt
"""

import argparse
import itertools

from kernel.gated import gated_fwd, packed_gated_fwd
from kernel.probe import ProbeFailure, probe_funcs

ARCH = "sm_90a"
# (DK, DV, H, G): the goal shapes' heads (Mamba2's: d_state 128, head dim 64, one group)
HEADS = [(128, 128, 16, 16), (64, 64, 32, 32), (128, 64, 24, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--packed", action="store_true", help="the packed kernel (cu_seqlens)")
    fwd = packed_gated_fwd if parser.parse_args().packed else gated_fwd
    print("dk dv H G | chunk/bDV/stages/threads | regs spill_bytes smem(B) fits | compile s")
    for (dk, dv, h, g), block_dv, stages, threads in itertools.product(HEADS, (64, 128), (1, 2), (128, 256)):
        if block_dv > dv:
            continue
        knobs = dict(chunk=64, block_dv=block_dv, num_stages=stages, threads=threads)
        make = lambda: [
            fwd(
                heads=h, groups=g, dk=dk, dv=dv, dtype="float16", arch=ARCH, scale=dk**-0.5,
                initial_state=True, final_state=True, **knobs,
            )
        ]  # fmt: skip
        found = probe_funcs(make, arch=ARCH)
        label = f"{dk} {dv} {h} {g} | 64/{block_dv}/{stages}/{threads}"
        if isinstance(found, ProbeFailure):
            print(f"{label} | FAILED at {found.stage}: {found.message.splitlines()[-1][:150]}", flush=True)
            continue
        print(
            f"{label} | {found.registers} {found.spill_bytes} {found.smem_bytes} {found.fits_smem} "
            f"| {found.compile_seconds:.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
