"""Same-run comparison on the GPU: how the chunk step issues its four MMAs
(``kernel.scalar_decay.CHUNK_STEP``: "sync" waits for each one; "async" issues them with
``T.wgmma_gemm`` and waits only where a result is read, so the decay mask, the row
weights, K's weights and the output store run while the tensor cores work).

    source .gpu/setup.sh && python3 reports/h200/async_step.py > $OUT/async_step.jsonl
    python3 reports/h200/async_step.py probe > reports/h200/issue5/async_step/probe.jsonl  # CPU
    source .gpu/setup.sh && cd reports/h200 && python3 async_step.py async transposed > $OUT/run4.jsonl

Modes other than the default pair are named on the command line, as in the last line,
which compares "async" with "transposed" (the state kept transposed in registers);
"ahead" (the state copied under the outputs' last MMA) needs
``reports/h200/issue5/ahead/ahead.patch`` applied to commit 69b3d7e first.

Rows, as JSON lines: ``copy`` (the copy rate of this run); ``check`` (every kernel against
reference C on fresh inputs, NaN-prefilled output); ``time`` (the whole call, the modes
taking turns over three rounds, ``kernel.timing.alternating``; ``x_floor`` is the median
against the problem's floor at this run's copy rate). ``probe`` needs no GPU: both modes
compiled for sm_90a over the 108-config grid below at the headline shape and one split
config, one row per config and mode with its shared memory and spills.
"""

import itertools
import sys

from modes import B1H8, B2H16, B4H16, check_modes, emit, inputs_for, probe_modes, time_modes

import kernel.scalar_decay as sd
from kernel import KernelConfig, Problem
from kernel.config import HEADLINE
from tuner.bench import copy_bandwidth

MODES = ("sync", "async")
TIMED = [
    (HEADLINE, KernelConfig(64, 128, 2, 256)),
    (HEADLINE, KernelConfig(64, 128, 3, 256)),
    (B2H16, KernelConfig(64, 128, 2, 256, segments=4)),
    (B2H16, KernelConfig(64, 128, 3, 256, segments=4)),
    (B2H16, KernelConfig(64, 128, 2, 256, segments=8)),
    (B1H8, KernelConfig(64, 128, 2, 256, segments=16)),
    (B1H8, KernelConfig(64, 128, 3, 256, segments=16)),
    (B1H8, KernelConfig(64, 128, 2, 256, segments=32)),
    (B4H16, KernelConfig(64, 128, 3, 256, segments=2)),
]
CHECKED = [  # correctness only: bf16, alpha^L underflowing, ragged S, DK != DV, C = 32
    (Problem(2, 3, 300, 128, 128, 0.5, "bfloat16"), KernelConfig(64, 128, 2, 256)),
    (Problem(1, 2, 1000, 64, 128, 0.8), KernelConfig(64, 64, 1, 128, "regs")),
    (Problem(2, 2, 777, 64, 128, 0.8, "bfloat16"), KernelConfig(32, 64, 2, 128, segments=8)),
    (Problem(1, 2, 1000, 128, 128, 0.5, "bfloat16"), KernelConfig(64, 64, 1, 256, segments=4)),
    (Problem(1, 3, 4096, 128, 128, 0.999), KernelConfig(64, 128, 2, 256, segments=64)),
    (Problem(2, 1, 65, 128, 128, 0.9), KernelConfig(64, 128, 2, 256, segments=2)),
    (Problem(1, 2, 1000, 128, 128, 0.95), KernelConfig(128, 64, 2, 256)),
    (Problem(2, 2, 999, 128, 64, 0.9), KernelConfig(64, 32, 3, 128)),
]


PROBED = [
    (HEADLINE, KernelConfig(*knobs))
    for knobs in itertools.product((32, 64, 128), (32, 64, 128), (1, 2, 3), (128, 256), ("smem", "regs"))
] + [(B1H8, KernelConfig(64, 128, 2, 256, segments=16))]


def _set_mode(mode: str) -> None:
    sd.CHUNK_STEP = mode


def probe_grid(modes: tuple[str, ...] = MODES) -> int:
    for (mode, _, config), res in probe_modes(modes, _set_mode, PROBED, arch="sm_90a").items():
        row = {"mode": mode, "config": config.label, "compiled": hasattr(res, "smem_bytes")}
        if row["compiled"]:
            row |= {"smem_bytes": res.smem_bytes, "spill_bytes": res.spill_bytes}
        emit(row)
    return 0


def main(modes: tuple[str, ...] = MODES) -> int:
    cases = TIMED + CHECKED
    probes = probe_modes(modes, _set_mode, cases)
    copy_rate = copy_bandwidth()
    emit({"kind": "copy", "bytes_per_s": copy_rate})
    kernels = check_modes(probes, _set_mode, TIMED, seed=31)
    time_modes(kernels, inputs_for(kernels, seed=32), copy_rate=copy_rate)
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["probe"]:
        sys.exit(probe_grid(tuple(args[1:]) or MODES))
    sys.exit(main(tuple(args) or MODES))
