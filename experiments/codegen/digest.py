"""Digest of the generated CUDA of every kernel variant, each kernel apart (see README.md).

Prints JSON: ``arch/case/kernel`` -> the first 16 hex digits of the sha256 of that
kernel's CUDA source, lowered on the CPU (no nvcc) for each architecture of
``sys.argv[1:]`` (default sm_90a and sm_80); a case that fails to lower records its error.
The cases are the 14 of ``experiments/portable_codegen/codegen_digest.py`` (whose helpers it
imports) and the variants those leave out: reversed calls (``Call.reverse``), states in and
out, chunks of 128, packed calls on the chunk steps, and the backward's fused dk and dv
sweep (``kernel.dkdv``) in one pass, split and packed. Runs against whichever ``kernel``
package is first on ``sys.path``:

    PYTHONPATH=$PWD python3 experiments/codegen/digest.py > experiments/codegen/digests.json
"""

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

from kernel.config import Call, KernelConfig, Problem, dkdv_call

_spec = importlib.util.spec_from_file_location(
    "codegen_digest", Path(__file__).resolve().parents[1] / "arch" / "codegen_digest.py"
)
arch_digest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(arch_digest)

FP16, BF16 = arch_digest.FP16, arch_digest.BF16
STATES = Call(scale=0.125, initial_state=True, final_state=True)
REVERSED = Call(scale=0.125, initial_state=True, final_state=True, reverse=True)
REVERSED_PLAIN = Call(reverse=True)
PACKED_REVERSED = Call(scale=0.125, initial_state=True, final_state=True, packed=True, reverse=True)
DKDV_STATES = Call(scale=0.125, initial_state=True, final_state=True, reverse=True, dkdv=True)
DKDV_PACKED = Call(scale=0.125, initial_state=True, final_state=True, packed=True, reverse=True, dkdv=True)
DKDV_FP16 = Problem(2, 3, 1000, 128, 128)
DKDV_BF16 = Problem(1, 2, 700, 64, 64, "bfloat16")

# (problem, config, call name, call): the cases beyond the 14 of experiments/portable_codegen.
EXTRA = [
    (FP16, KernelConfig(64, 128, 2, 256, "smem"), "states", STATES),  # transposed step
    (FP16, KernelConfig(64, 128, 2, 256, "smem"), "reversed", REVERSED),
    (FP16, KernelConfig(64, 128, 2, 256, "smem"), "packed-reversed", PACKED_REVERSED),
    (FP16, KernelConfig(64, 64, 2, 256, "smem"), "states", STATES),  # async step
    (FP16, KernelConfig(64, 64, 2, 256, "smem"), "reversed", REVERSED),
    (FP16, KernelConfig(64, 64, 1, 128, "smem"), "packed-reversed", PACKED_REVERSED),
    (FP16, KernelConfig(64, 32, 2, 128, "regs"), "reversed", REVERSED),  # scores in registers
    (FP16, KernelConfig(32, 32, 2, 128, "smem"), "reversed", REVERSED),  # sync step
    (FP16, KernelConfig(32, 32, 1, 128, "smem"), "packed", arch_digest.PACKED),
    (FP16, KernelConfig(128, 64, 1, 128, "smem"), "states", STATES),  # chunk 128
    (FP16, KernelConfig(128, 64, 1, 128, "smem"), "reversed", REVERSED),
    (FP16, KernelConfig(128, 32, 1, 128, "regs"), "plain", Call()),
    (FP16, KernelConfig(64, 128, 2, 256, "smem", segments=4), "states", STATES),  # split
    (FP16, KernelConfig(64, 128, 2, 256, "smem", segments=4), "reversed", REVERSED),
    (FP16, KernelConfig(64, 128, 2, 256, "smem", segments=2), "reversed-plain", REVERSED_PLAIN),
    (BF16, KernelConfig(32, 32, 1, 128, "smem", segments=4), "reversed", REVERSED),
    (DKDV_FP16, KernelConfig(64, 128, 2, 256, "smem"), "dkdv", dkdv_call(DKDV_FP16)),  # fused sweep
    (DKDV_FP16, KernelConfig(64, 128, 1, 256, "smem"), "dkdv-states", DKDV_STATES),
    (DKDV_FP16, KernelConfig(64, 128, 1, 256, "smem"), "dkdv-packed", DKDV_PACKED),
    (DKDV_FP16, KernelConfig(64, 128, 1, 256, "smem", segments=4), "dkdv", dkdv_call(DKDV_FP16)),
    (DKDV_FP16, KernelConfig(64, 128, 1, 256, "smem", segments=4), "dkdv-states", DKDV_STATES),
    (DKDV_BF16, KernelConfig(64, 64, 2, 256, "smem", segments=2), "dkdv-states", DKDV_STATES),
    (DKDV_BF16, KernelConfig(32, 64, 2, 128, "smem"), "dkdv-states", DKDV_STATES),
]


def cases() -> list:
    first = [(p, c, name, arch_digest.call_of(p, name)) for p, c, name in arch_digest.CASES]
    return first + EXTRA


def digests(arch: str) -> dict[str, str]:
    out = {}
    for problem, config, name, call in cases():
        key = f"{arch}/{problem.dk}-{problem.dv}-{problem.dtype}-{config.label}-{name}"
        try:
            for i, func in enumerate(arch_digest.funcs(problem, config, call, arch)):
                source = arch_digest.lowered(func, arch)
                out[f"{key}/{i}"] = hashlib.sha256(source.encode()).hexdigest()[:16]
        except Exception as exc:  # recorded, as the probe records a failure
            out[key] = f"ERR {type(exc).__name__}: {str(exc)[:100]}"
    return out


if __name__ == "__main__":
    result = {}
    for arch in sys.argv[1:] or ["sm_90a", "sm_80"]:
        result |= digests(arch)
    json.dump(result, sys.stdout, indent=1)
    print()
