"""Digest of the generated CUDA of 14 (problem, config, call) cases (see README.md).

Prints JSON: case -> the first 16 hex digits of the sha256 of its kernels' CUDA source,
lowered for ``sys.argv[1]`` (default sm_90a). Runs against whichever ``kernel`` package is
first on ``sys.path``, so the same script digests the tree before and after a change.
``experiments/codegen/digest.py`` extends it (more cases, every kernel apart) and
imports its helpers.
"""

import hashlib
import inspect
import json
import sys

from kernel import probe as resources
from kernel import variants
from kernel.config import Call, KernelConfig, Problem, model_call

ARCH = sys.argv[1] if len(sys.argv) > 1 else "sm_90a"
FP16 = Problem(2, 3, 1000, 128, 128)
BF16 = Problem(1, 2, 700, 64, 128, "bfloat16")
PACKED = Call(scale=0.125, initial_state=True, final_state=True, packed=True)
CASES = [
    (FP16, KernelConfig(64, 128, 2, 256, "smem"), "plain"),  # the transposed step
    (FP16, KernelConfig(64, 64, 2, 256, "smem"), "model"),  # the async step
    (FP16, KernelConfig(64, 32, 2, 128, "regs"), "plain"),  # the seed: scores in registers
    (FP16, KernelConfig(32, 32, 2, 128, "smem"), "model"),  # the sync step
    (FP16, KernelConfig(64, 128, 2, 256, "smem"), "packed"),
    (FP16, KernelConfig(64, 128, 2, 256, "smem", segments=4), "model"),
    (FP16, KernelConfig(32, 32, 1, 128, "smem", segments=4), "plain"),
    (BF16, KernelConfig(64, 128, 2, 256, "smem"), "model"),
    (BF16, KernelConfig(128, 64, 1, 128, "smem"), "plain"),
    (BF16, KernelConfig(64, 64, 1, 128, "smem"), "packed"),
    (BF16, KernelConfig(32, 64, 2, 128, "smem"), "packed"),
    (BF16, KernelConfig(64, 64, 1, 128, "regs", segments=2), "model"),
    (BF16, KernelConfig(64, 128, 2, 256, "smem", segments=4), "plain"),
    (BF16, KernelConfig(32, 32, 1, 128, "smem", segments=4), "model"),
]


def call_of(problem: Problem, name: str) -> Call:
    return {"plain": Call(), "model": model_call(problem), "packed": PACKED}[name]


def lowered(func, arch: str = ARCH) -> str:
    # A tree that lowers for sm_90a alone has no ``arch`` keyword.
    if "arch" in inspect.signature(resources.lower).parameters:
        return resources.lower(func, arch=arch).kernel_source
    return resources.lower(func).kernel_source


def funcs(problem: Problem, config: KernelConfig, call: Call, arch: str = ARCH) -> list:
    if "arch" in inspect.signature(variants.prim_funcs).parameters:
        return variants.prim_funcs(problem, config, call, arch=arch)
    return variants.prim_funcs(problem, config, call)


def main() -> None:
    out = {}
    for problem, config, name in CASES:
        key = f"{problem.dk}-{problem.dtype}-{config.label}-{name}"
        try:
            sources = [lowered(f) for f in funcs(problem, config, call_of(problem, name))]
            out[key] = hashlib.sha256("\n".join(sources).encode()).hexdigest()[:16]
        except Exception as exc:  # recorded, as the probe records a failure
            out[key] = f"ERR {type(exc).__name__}: {str(exc)[:100]}"
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
