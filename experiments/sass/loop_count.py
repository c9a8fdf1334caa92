r"""The instructions of the headline kernel's chunk loop, from its SASS (a CPU check).

Compiles the headline forward in the model form (64/128/3/256/smem/1, ``model_call``) for
sm_90a, builds its cubin with TileLang's nvcc options, disassembles it with ``cuobjdump``
(from PyPI's ``nvidia-cuda-cuobjdump`` wheel where the toolkit has none), finds the
consumer's chunk loop (the backward branch whose body holds the most ``HGMMA``) and counts
its instructions by opcode. From the repo root:

    pip download --no-deps nvidia-cuda-cuobjdump -d /tmp/nvd
    python3 -m zipfile -e /tmp/nvd/*.whl /tmp/nvd/x
    chmod +x /tmp/nvd/x/nvidia/cu13/bin/cuobjdump
    python3 experiments/sass/loop_count.py --cuobjdump /tmp/nvd/x/nvidia/cu13/bin/cuobjdump \
        > experiments/sass/loop_count.json
"""

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile

from kernel.config import HEADLINE, KernelConfig, model_call
from kernel.probe import compile_kernel

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([.\w]*)(.*?);")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuobjdump", default="cuobjdump")
    args = parser.parse_args()
    from tilelang.contrib import nvcc

    config = KernelConfig(64, 128, 3, 256, "smem", 1)
    source = compile_kernel(HEADLINE, config, "sm_90a", model_call(HEADLINE))[0].get_kernel_source()
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = os.path.join(tmp, "head.cu"), os.path.join(tmp, "head.cubin")
        open(cu, "w").write(source)
        options = nvcc.default_compile_options()
        subprocess.run(
            ["nvcc", "--cubin", "-O3", "-arch=sm_90a", *options, "-w", "-o", cubin, cu], check=True
        )
        sass = subprocess.run(
            [args.cuobjdump, "-sass", cubin], check=True, capture_output=True, text=True
        ).stdout
    code = [(int(m[1], 16), m[2], m[2] + m[3], m[4]) for m in LINE.finditer(sass)]
    loops = []  # (start, end) of each backward branch's body
    for address, op, _, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest)
        if op == "BRA" and target and int(target[1], 16) < address:
            loops.append((int(target[1], 16), address))
    body = max(
        ([c for c in code if start <= c[0] <= end] for start, end in loops),
        key=lambda b: sum(c[1] == "HGMMA" for c in b),
    )
    print(
        json.dumps(
            {
                "kernel": "headline forward, model call, " + config.label + ", sm_90a",
                "loop": [hex(body[0][0]), hex(body[-1][0])],
                "instructions": len(body),
                "by_opcode": dict(collections.Counter(c[1] for c in body).most_common()),
                "hgmma_shapes": dict(collections.Counter(c[2] for c in body if c[1] == "HGMMA")),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
