"""Digest of the generated CUDA of 9 configs at two problems (see README.md)."""

import hashlib
import json
import sys

from kernel import probe as resources  # the package on sys.path: see README.md
from kernel.config import KernelConfig, Problem

P = [Problem(2, 3, 1000, 128, 128, 0.9), Problem(1, 2, 700, 64, 128, 0.5, "bfloat16")]
C = [
    KernelConfig(64, 128, 2, 256, "smem"),
    KernelConfig(64, 64, 2, 256, "smem"),
    KernelConfig(64, 32, 2, 128, "regs"),
    KernelConfig(32, 32, 2, 128, "smem"),
    KernelConfig(128, 64, 1, 128, "smem"),
    KernelConfig(64, 64, 1, 128, "smem"),
    KernelConfig(64, 128, 2, 256, "smem", segments=4),
    KernelConfig(64, 64, 1, 128, "regs", segments=2),
    KernelConfig(32, 32, 1, 128, "smem", segments=4),
]
out = {}
for p in P:
    for c in C:
        try:
            c.check_fits(p)
            funcs = resources.prim_funcs(p, c)
            srcs = [resources.lower(f).kernel_source for f in funcs]
            out[f"{p.dk}-{p.dtype}-{c.label}"] = hashlib.sha256("\n".join(srcs).encode()).hexdigest()[:16]
        except Exception as e:
            out[f"{p.dk}-{p.dtype}-{c.label}"] = "ERR " + type(e).__name__ + str(e)[:100]
json.dump(out, sys.stdout, indent=1)
