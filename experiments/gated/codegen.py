"""Print the CUDA TileLang generates for the gated forward at the rule's config for DK = DV =
128 (64/128/1/256, fp16, the final state out), compiled for sm_90a on the CPU:

    python3 experiments/gated/codegen.py > /tmp/gated.cu

What it shows is in experiments/gated/README.md ("Where a chunk waits").
"""

from kernel.config import Problem
from kernel.gated import gated_fwd
from kernel.probe import compile_funcs
from kernel.rule import gated_config


def main() -> None:
    config = gated_config(Problem(8, 16, 4096, 128, 128, "float16", "token", 16))
    func = gated_fwd(
        heads=16, groups=16, dk=128, dv=128, dtype="float16", chunk=config.chunk, block_dv=config.block_dv,
        num_stages=config.num_stages, threads=config.threads, arch="sm_90a", scale=128**-0.5,
        final_state=True,
    )  # fmt: skip
    (kernel,) = compile_funcs([func], "sm_90a")
    print(kernel.get_kernel_source())


if __name__ == "__main__":
    main()
