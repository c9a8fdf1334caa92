"""Top-level torch ops of one call of the gated torch backward (``kernel.ops.gated_backward``),
its scans over the chunks one launch per chunk (commit 164b3f1's module, read from git) against
one matrix product each (this checkout's), and their largest difference: torch.profiler on
the CPU, 1x4096 tokens, 4 heads of 64 by 64, fp16, states in and out.

    python3 experiments/gated/scan_ops.py > experiments/gated/scan_ops.txt   # in a git checkout
"""

import importlib.util
import subprocess
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import kernel.ops.gated_backward as matrix

LOOP = "164b3f1"


def loop_module():
    source = subprocess.run(
        ["git", "show", f"{LOOP}:kernel/ops/gated_backward.py"], capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "loop_backward.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("loop_backward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    b, s, g, h, d = 1, 4096, 4, 4, 64
    q, k = (torch.randn(b, s, g, d, generator=gen).half() for _ in range(2))
    v, do = (torch.randn(b, s, h, d, generator=gen).half() for _ in range(2))
    gate = -torch.rand(b, s, h, generator=gen)
    h0, dht = (torch.randn(b, h, d, d, generator=gen) for _ in range(2))
    results = {}
    for name, module in ((f"loop ({LOOP})", loop_module()), ("matrix (this checkout)", matrix)):

        def call(module=module):
            return module.gated_backward(
                q, k, v, gate, do, scale=d**-0.5, initial_state=h0, dht=dht, cu_seqlens=None
            )

        call()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            results[name] = call()
        ops = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
        print(f"{name}: {len(ops)} top-level aten ops a backward")
    (a, b_) = results.values()
    for label, x, y in zip(("dq", "dk", "dv", "dg", "dh0"), a, b_):
        err = ((x.double() - y.double()).norm() / y.double().norm()).item()
        print(f"{label}: rel L2 between the two {err:.1e}")


if __name__ == "__main__":
    main()
