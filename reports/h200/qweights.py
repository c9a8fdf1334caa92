"""Same-run comparison on the GPU: where the inter-chunk query weights are applied
(``kernel.scalar_decay.Q_WEIGHTS``: "smem" scales Q rows into Qw_s, "acc" scales the fp32
accumulator rows after the MMA and frees Qw_s, which lets 64/128 take a third stage).

    source .gpu/setup.sh && python3 reports/h200/qweights.py > $OUT/qweights.jsonl

Every kernel is checked against reference C (NaN-prefilled output) before it is timed;
the timings alternate between the modes over three rounds, medians of CUDA events with
L2 flushed (``kernel.timing.alternating``).
"""

import json
import sys
from functools import partial

import torch
from modes import probe_modes

import kernel.scalar_decay as sd
from kernel import KernelConfig, Problem, build
from kernel.config import HEADLINE
from kernel.timing import alternating
from kernel.validate import check, random_qkv

MODES = ("smem", "acc")
B2H16, B1H8 = Problem(2, 16, 16384, 128, 128, 0.99), Problem(1, 8, 32768, 128, 128, 0.99)
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
    kernels = {}
    for (mode, problem, config), res in probes.items():
        row = {"mode": mode, "problem": problem.to_dict(), "config": config.to_dict()}
        if not getattr(res, "fits_smem", False):
            print(json.dumps(row | {"skipped": str(res.to_dict())[:200]}), flush=True)
            continue
        _set_mode(mode)
        kern = build(problem, config)
        row |= check(kern, seed=11) | {"smem_bytes": res.smem_bytes}
        print(json.dumps(row), flush=True)
        if (problem, config) in TIMED and row["finite"] and row["rel_l2"] < 2e-2:
            kernels[mode, problem, config] = kern
    inputs = {p: random_qkv(p, seed=12) for p, _ in TIMED}
    outs = {p: torch.empty_like(v) for p, (_, _, v) in inputs.items()}
    times = alternating(
        {key: partial(kern, *inputs[key[1]], out=outs[key[1]]) for key, kern in kernels.items()}
    )
    for (mode, problem, config), ms in times.items():
        shape = f"{problem.batch}x{problem.heads}x{problem.seqlen}"
        print(
            json.dumps(
                {
                    "mode": mode,
                    "shape": shape,
                    "config": config.to_dict(),
                    "median_ms": sorted(ms)[1],
                    "all_ms": ms,
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
