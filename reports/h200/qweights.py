"""Same-run comparison on the GPU: where the inter-chunk query weights are applied
(``kernel.scalar_decay.Q_WEIGHTS``: "smem" scales Q rows into Qw_s, "acc" scales the fp32
accumulator rows after the MMA and frees Qw_s, which lets 64/128 take a third stage).

    source .gpu/setup.sh && python3 reports/h200/qweights.py > $OUT/qweights.jsonl

Every kernel is checked against reference C (NaN-prefilled output) before it is timed;
the timings alternate between the modes over three rounds, medians of CUDA events with
L2 flushed (``kernel.timing.alternating``). The committed ``qweights.jsonl`` came from
this script before its rows took the shared form of ``modes.check_modes`` (``kind``
field, config as its label): there each config is a dict of knobs and rows carry no kind.
"""

import sys

from modes import B1H8, B2H16, check_modes, inputs_for, probe_modes, time_modes

import kernel.scalar_decay as sd
from kernel import KernelConfig, Problem
from kernel.config import HEADLINE

MODES = ("smem", "acc")
TIMED = [
    (HEADLINE, KernelConfig(64, 128, 2, 256)),
    (HEADLINE, KernelConfig(64, 128, 3, 256)),
    (HEADLINE, KernelConfig(64, 128, 1, 256)),
    (B2H16, KernelConfig(64, 128, 2, 256, segments=4)),
    (B2H16, KernelConfig(64, 128, 3, 256, segments=4)),
    (B1H8, KernelConfig(64, 128, 2, 256, segments=16)),
    (B1H8, KernelConfig(64, 128, 3, 256, segments=16)),
]
CHECKED = [  # correctness only: bf16, small alpha, ragged, DK != DV, both variants
    (Problem(2, 3, 300, 128, 128, 0.5, "bfloat16"), KernelConfig(64, 128, 2, 256)),
    (Problem(1, 2, 1000, 64, 128, 0.8), KernelConfig(64, 64, 1, 128, "regs")),
    (Problem(2, 2, 777, 64, 128, 0.8, "bfloat16"), KernelConfig(32, 64, 2, 128, segments=8)),
    (Problem(1, 2, 1000, 128, 128, 0.5, "bfloat16"), KernelConfig(64, 64, 1, 256, segments=4)),
]


def _set_mode(mode: str) -> None:
    sd.Q_WEIGHTS = mode


def main() -> int:
    cases = TIMED + CHECKED
    probes = probe_modes(MODES, _set_mode, cases)
    kernels = check_modes(probes, _set_mode, TIMED, seed=11)
    time_modes(kernels, inputs_for(kernels, seed=12))
    return 0


if __name__ == "__main__":
    sys.exit(main())
