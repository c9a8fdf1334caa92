# ruff: noqa: E501  (the children's code is kept as written, one statement a line)
"""Where a call's host time goes, and what a cold process pays before its first call (issue 52, item 5).

    source .gpu/setup.sh && python3 experiments/host_path/measure.py

One script, each part in a child process with a timeout:
  warm-up  compiles (or loads) every kernel the cases below run, so the cold runs find
           them in the disk cache and in kernel.loader's index;
  cold     a fresh process, 3 times: ``import torch``, ``import kernel.ops``, CUDA's start
           (``torch.cuda.init()`` and a tiny op), the first forward call (synchronised), then
           the first forward+backward; which heavy modules the first call imported;
  warm     eager host time per call: the median over 10 batches of the wall time of 20
           calls queued after a sync, over 20 (so few launches that CUDA's queue never
           fills and makes the host wait for the GPU); the wall time per call of 200 calls
           with the sync; the GPU kernels' time per call (torch.profiler); triton's
           ``do_bench`` (L2 flushed). Forward 8x16x4096 128/128 fp16, RetNet decays, the
           final state returned (no gradient reaches it); forward+backward at 8x16x4096
           and 2x16x16384, the gradients set to None before each call as a training
           step's ``zero_grad`` does (else each call adds into them);
  fla      the same warm figures for fla's ``chunk_simple_gla`` (skipped where fla does not import).
Prints a table; with ``OUT`` set, writes JSON lines to ``$OUT/host_path.jsonl``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {"fwd": (8, 16, 4096), "fwd+bwd": (8, 16, 4096), "fwd+bwd-long": (2, 16, 16384)}

COMMON = r"""
import sys, time, json
import torch
def tensors(b, s, h=16, d=128, grad=False):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16, generator=g).requires_grad_(grad) for _ in range(3))
    gammas = torch.tensor([1 - 2 ** (-5 - i) for i in range(h)], device="cuda")
    return q, k, v, gammas
"""

WARMUP = (
    COMMON
    + r"""
from kernel.ops import decay_attention
from kernel.builder import cuda_arch, precompile
from kernel.config import Call, Problem
from kernel.ops.serve import training_jobs
jobs = set()
for b, s in ((8, 4096), (2, 16384)):  # compiled in parallel processes first
    jobs |= training_jobs(Problem(b, 16, s, 128, 128, "float16"), Call(128 ** -0.5, False, True, False), b)
precompile(sorted(jobs, key=str), arch=cuda_arch())
for b, s in ((8, 4096), (2, 16384)):
    q, k, v, g = tensors(b, s, grad=True)
    o, st = decay_attention(q, k, v, g, output_final_state=True)
    (o.float().sum() + st.sum()).backward()
    with torch.no_grad():
        decay_attention(q, k, v, g, output_final_state=True)
torch.cuda.synchronize()
import kernel.builder
print(json.dumps({"part": "warmup", "compiled": kernel.builder.compiles()}))
"""
)

COLD = r"""
import sys, time, json
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import kernel.ops
t2 = time.perf_counter()
torch.cuda.init(); torch.ones(1, device="cuda").add_(1); torch.cuda.synchronize()
t3 = time.perf_counter()
heavy = lambda: sorted(m for m in ("tilelang", "tvm", "tvm_ffi", "ml_dtypes", "scipy", "optuna") if m in sys.modules)
at_import = heavy()
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(8, 4096, 16, 128, device="cuda", dtype=torch.float16, generator=g) for _ in range(3))
gammas = torch.tensor([1 - 2 ** (-5 - i) for i in range(16)], device="cuda")
torch.cuda.synchronize()
t4 = time.perf_counter()
with torch.no_grad():
    o, st = kernel.ops.decay_attention(q, k, v, gammas, output_final_state=True)
torch.cuda.synchronize()
t5 = time.perf_counter()
for t in (q, k, v):
    t.requires_grad_(True)
o, st = kernel.ops.decay_attention(q, k, v, gammas, output_final_state=True)
(o.float().sum() + st.sum()).backward()
torch.cuda.synchronize()
t6 = time.perf_counter()
import kernel.builder
print(json.dumps({"part": "cold", "import_torch_s": t1 - t0, "import_ops_s": t2 - t1, "cuda_start_s": t3 - t2,
                  "first_forward_s": t5 - t4, "first_fwd_bwd_s": t6 - t5, "heavy_at_import": at_import,
                  "heavy_after_calls": heavy(), "compiled_or_loaded": kernel.builder.compiles(),
                  "loaded_from_index": sum(type(c).__name__ == "LoadedKernel" for cs, _ in kernel.builder._COMPILED.values() for c in cs)}))
"""

WARM = (
    COMMON
    + r"""
which = sys.argv[1]
if which == "ours":
    from kernel.ops import decay_attention
    def call(q, k, v, g):
        return decay_attention(q, k, v, g, output_final_state=True)
else:
    from fla.ops.simple_gla import chunk_simple_gla
    def call(q, k, v, g):
        return chunk_simple_gla(q, k, v, g=None, g_gamma=g.log(), scale=q.shape[-1] ** -0.5, output_final_state=True)
N, QUEUED = 200, 20
def run(case, b, s):
    backward = case != "fwd"
    q, k, v, gammas = tensors(b, s, grad=backward)
    do = torch.randn_like(v)
    if backward:
        def once():  # gradients set to None first, as a training step's zero_grad does
            q.grad = k.grad = v.grad = None
            o, st = call(q, k, v, gammas)
            o.backward(do)
    else:
        def once():
            with torch.no_grad():
                call(q, k, v, gammas)
    for _ in range(20):
        once()
    hosts = []
    for _ in range(10):  # 20 calls queued after a sync: too few launches to fill CUDA's queue
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(QUEUED):
            once()
        hosts.append((time.perf_counter() - t) / QUEUED)
    host = sorted(hosts)[len(hosts) // 2]
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(N):
        once()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / N
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            once()
        torch.cuda.synchronize()
    kern = sum(e.device_time_total for e in prof.events() if e.device_type.name == "CUDA") / 20
    from triton.testing import do_bench
    bench = do_bench(once, warmup=25, rep=200, return_mode="median")
    return {"part": "warm", "impl": which, "case": case, "shape": f"{b}x16x{s}", "host_us": host * 1e6,
            "wall_us": wall * 1e6, "kernels_us": kern, "do_bench_us": bench * 1e3}
for case, (b, h, s) in json.loads(sys.argv[2]).items():
    print(json.dumps(run(case, b, s)), flush=True)
"""
)


def child(code: str, *args: str, timeout: int) -> list[dict]:
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return [{"part": "error", "what": f"timed out after {timeout} s", "args": list(args)}]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0:
        rows.append(
            {"part": "error", "rc": done.returncode, "stderr": done.stderr[-3000:], "args": list(args)}
        )
    return rows


def show(r: dict) -> None:
    """Print one row as it arrives, and append it to ``$OUT/host_path.jsonl`` where set (a run
    cut short keeps what it measured)."""
    if r["part"] == "cold":
        print(
            f"cold: import torch {r['import_torch_s']:.2f} s, import kernel.ops +{r['import_ops_s']:.3f} s, "
            f"CUDA start {r['cuda_start_s']:.2f} s, first forward {r['first_forward_s']:.3f} s, "
            f"first fwd+bwd {r['first_fwd_bwd_s']:.3f} s; heavy at import {r['heavy_at_import']}, "
            f"after {r['heavy_after_calls']}; kernels {r['compiled_or_loaded']} "
            f"({r['loaded_from_index']} from the index)"
        )
    elif r["part"] == "warm":
        print(
            f"{r['impl']:5} {r['case']:13} {r['shape']:11} host {r['host_us']:7.1f} us/call  "
            f"wall {r['wall_us']:7.1f} us/call  kernels {r['kernels_us']:7.1f} us/call  "
            f"do_bench {r['do_bench_us']:7.1f} us"
        )
    else:
        print(json.dumps(r)[:3000])
    sys.stdout.flush()
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "host_path.jsonl", "a") as f:
            f.write(json.dumps(r) + "\n")


def main() -> None:
    for r in child(WARMUP, timeout=540):
        show(r)
    for _ in range(3):
        for r in child(COLD, timeout=120):
            show(r)
    for r in child(WARM, "ours", json.dumps(SHAPES), timeout=240):
        show(r)
    fla = subprocess.run([sys.executable, "-c", "import fla.ops.simple_gla"], capture_output=True, cwd=ROOT)
    rows = (
        child(WARM, "fla", json.dumps(SHAPES), timeout=300)
        if fla.returncode == 0
        else [{"part": "fla", "skipped": fla.stderr.decode()[-300:]}]
    )
    for r in rows:
        show(r)


if __name__ == "__main__":
    main()
