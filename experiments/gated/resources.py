"""Registers, spills and shared memory (ptxas, compiled for sm_90a on a CPU) of the gated
forward at the rule's config for 128/128 and at 2 stages, beside ``gate_tma.py``'s kernels
(gates by TMA: ``[B, H, S]``, box 0; the op's ``[B, S, H]`` by boxes of 4 heads, box 4), and of
the backward's modes (``reverse``, ``out_dtype="float32"``) at block_dv 64, dense and packed:

    python3 experiments/gated/resources.py > experiments/gated/resources.txt
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gate_tma import gated_fwd_t  # noqa: E402

from kernel.gated import gated_fwd, packed_gated_fwd  # noqa: E402
from kernel.probe import ProbeFailure, probe_funcs  # noqa: E402

ARCH = "sm_90a"
HEADS = dict(
    heads=16, groups=16, dk=128, dv=128, dtype="float16", chunk=64, threads=256, arch=ARCH, scale=128**-0.5
)


def show(label: str, make) -> None:
    found = probe_funcs(make, arch=ARCH)
    if isinstance(found, ProbeFailure):
        print(f"{label} | FAILED at {found.stage}", flush=True)
        return
    print(f"{label} | {found.registers} {found.spill_bytes} {found.smem_bytes} {found.fits_smem}", flush=True)


def main() -> None:
    print("kernel | block_dv/stages | regs spill_bytes smem(B) fits")
    for stages in (1, 2):
        knobs = dict(HEADS, block_dv=128, num_stages=stages, final_state=True)
        show(f"kernel.gated dense | 128/{stages}", lambda: [gated_fwd(**knobs)])
        for box in (0, 4):
            show(f"gate_tma box {box} | 128/{stages}", lambda: [gated_fwd_t(**knobs, box=box)])
    modes = {"reverse": dict(reverse=True), "fp32 out": dict(out_dtype="float32")}
    for name, mode in {"forward": {}, **modes}.items():
        for fwd in (gated_fwd, packed_gated_fwd):
            knobs = dict(HEADS, block_dv=64, num_stages=1, initial_state=True, final_state=True, **mode)
            show(f"{fwd.__name__} {name} | 64/1", lambda: [fwd(**knobs)])


if __name__ == "__main__":
    main()
