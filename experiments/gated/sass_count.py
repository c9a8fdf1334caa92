r"""The gated forward's instructions by opcode, from its SASS (a CPU check, no GPU): the
rule's config at 128/128 (as ``codegen.py``), and beside it the constant-decay forward at the
same knobs (single pass, the model call: ``kernel.config.model_call``), each compiled for
sm_90a with TileLang's nvcc options and disassembled with ``cuobjdump`` (PyPI's ``nvidia-cuda-cuobjdump`` and
``nvidia-cuda-nvdisasm`` wheels where the toolkit has none). From the repo root:

    pip download --no-deps nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm -d /tmp/nvd
    for w in /tmp/nvd/*.whl; do python3 -m zipfile -e $w /tmp/nvd/x; done
    chmod +x /tmp/nvd/x/nvidia/cu13/bin/*
    PATH=/tmp/nvd/x/nvidia/cu13/bin:$PATH python3 experiments/gated/sass_count.py \
        >> experiments/gated/sass_count.txt   # two lines
"""

import collections
import os
import re
import subprocess
import sys
import tempfile

from kernel.config import HEADLINE, Problem, model_call
from kernel.gated import gated_fwd
from kernel.probe import compile_funcs, compile_kernel
from kernel.rule import gated_config

OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def main() -> None:
    problem = Problem(8, 16, 4096, 128, 128, "float16", "token", 16)
    c = gated_config(problem)
    func = gated_fwd(
        heads=16, groups=16, dk=128, dv=128, dtype="float16", chunk=c.chunk, block_dv=c.block_dv,
        num_stages=c.num_stages, threads=c.threads, arch="sm_90a", scale=128**-0.5, final_state=True,
    )  # fmt: skip
    (gated,) = compile_funcs([func], "sm_90a")
    constant = compile_kernel(HEADLINE, c, "sm_90a", model_call(HEADLINE))[0]  # the same knobs
    commit = _output("git", "rev-parse", "--short", "HEAD").strip()
    knobs = f"{c.chunk}/{c.block_dv}/{c.num_stages}/{c.threads}"
    for name, kernel in (("gated", gated), ("constant-decay", constant)):
        ops = collections.Counter(OPCODE.findall(_sass(kernel.get_kernel_source())))
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(12))
        print(f"{commit} {name} {knobs}: {sum(ops.values())} instructions, LDG {ops['LDG']}; {top}")


def _sass(source: str) -> str:
    """``source``'s SASS for sm_90a, compiled with TileLang's nvcc options."""
    from tilelang.contrib import nvcc

    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = os.path.join(tmp, "kernel.cu"), os.path.join(tmp, "kernel.cubin")
        open(cu, "w").write(source)
        nvcc_flags = ["--cubin", "-O3", "-arch=sm_90a", *nvcc.default_compile_options(), "-w"]
        subprocess.run(["nvcc", *nvcc_flags, "-o", cubin, cu], check=True)
        return _output("cuobjdump", "-sass", cubin)


def _output(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


if __name__ == "__main__":
    sys.exit(main())
