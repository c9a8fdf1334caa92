"""Time the gated op (``decay_attention(q, k, v, None, g=g)``) forward and forward plus
backward beside fla's ``chunk_simple_gla(g=...)`` at the issue's goal shapes, as a training
step calls them (no state in or out, the gradients set to None before each call). One JSON
line per measurement.

    source .gpu/setup.sh && python3 experiments/gated/training.py | tee experiments/gated/training.jsonl

Gates from -1e-4 to -20 per token (as ``bench.py``); fp16; scale DK^-1/2. fla's simple_gla
takes no groups: its q and k are repeated to H heads outside the timed call, and its
gradients stop there. Timing: ``kernel.timing.time_gpu`` (CUDA events after warm-up, L2
flushed before each repetition, median and p20/p80), with ``host_ahead``: the GPU's time
with launches queued ahead and the host's time per call. The op's rule config for each
shape and its backward's passes are compiled first, in parallel processes.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench import SHAPES, inputs  # noqa: E402  (this folder's bench: its shapes and inputs)

from kernel.builder import cuda_arch, precompile
from kernel.config import Call, Problem
from kernel.gated_build import pass_jobs
from kernel.ops import decay_attention
from kernel.ops.serve import kernel_job
from kernel.timing import time_gpu


def main() -> None:
    dtype = torch.float16
    jobs = []
    for b, h, s, dk, dv, groups in SHAPES:  # the forward and its backward's passes
        problem = Problem(b, h, s, dk, dv, "float16", "token", groups)
        jobs += [kernel_job(problem, Call(dk**-0.5), b), *pass_jobs(problem, Call(dk**-0.5))]
    precompile(jobs, arch=cuda_arch())
    print(json.dumps({"device": torch.cuda.get_device_name()}), flush=True)
    fla = None
    if "--no-fla" not in sys.argv:
        from fla.ops.simple_gla import chunk_simple_gla as fla
    for b, h, s, dk, dv, groups in SHAPES:
        shape = dict(shape=f"{b}x{h}x{s}", dk=dk, dv=dv, groups=groups, dtype="float16")
        q, k, v, g = inputs(b, h, s, dk, dv, groups, dtype)
        do = torch.randn_like(v)
        r = h // groups
        impls = {"ours": (lambda q, k, v, g: decay_attention(q, k, v, None, g=g)[0], q, k)}
        if fla is not None:
            qh, kh = (x.repeat_interleave(r, dim=2).contiguous() for x in (q, k))
            impls["fla"] = (lambda q, k, v, g: fla(q, k, v, g=g, scale=dk**-0.5)[0], qh, kh)
        for name, (op, q_, k_) in impls.items():
            with torch.no_grad():
                t = time_gpu(lambda: op(q_, k_, v, g), host_ahead=True)
            print(json.dumps(shape | {"impl": name, "pass": "forward"} | t.to_dict()), flush=True)
            leaves = [x.detach().clone().requires_grad_() for x in (q_, k_, v, g)]

            def step():
                for x in leaves:
                    x.grad = None
                op(*leaves).backward(do)

            t = time_gpu(step, host_ahead=True)
            print(json.dumps(shape | {"impl": name, "pass": "forward+backward"} | t.to_dict()), flush=True)


if __name__ == "__main__":
    main()
