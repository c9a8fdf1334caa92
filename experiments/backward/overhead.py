"""Where the forward plus backward's time goes, beyond its kernels (issue 18).

The bench of 2026-12-01 (``bench.jsonl``) timed ``decay_attention``'s forward plus backward
at 1.12 ms at the headline shape, while its forward alone took 0.15 ms and its backward
alone 0.49 ms, with a wide spread (p20 1.02, p80 1.34 ms): the signature of a call whose
host side outlasts its kernels. This script separates the two, in the model form (RetNet's
decays, scale DK^-1/2) at one shape, in one run:

- each kernel alone (the forward and the three sweeps, as ``decay_attention`` picks them),
  CUDA events with L2 flushed (``kernel.timing.bench``);
- the wave seeds (the bench's candidate configs) forward and backwards in time: whether
  the forward's ranking, which the reversed sweeps inherit, holds reversed;
- the forward, the backward and both through ``decay_attention`` and autograd, the same way;
- both replayed from a captured CUDA graph: the kernels without the host between them;
- the host's time per call, layer by layer: TileLang's call of the forward's kernel (also
  through its cython and nvrtc execution backends, where they build), our
  checked call of it, ``decay_attention``'s forward without and with autograd, the
  backward op, and forward plus backward (100 calls back to back, then one synchronize),
  and forward and forward plus backward again at 1xHx64, where the GPU is never the bound;
- the GPU's timeline of forward plus backward after an L2 flush (torch's profiler): each
  kernel's duration and the GPU's idle time before it, waiting for the host;
- a cProfile of 100 calls of both, the top 25 functions by own time (the main thread
  only: the autograd engine runs the backward on its own thread).

    python3 experiments/backward/overhead.py --out DIR [--shape 8x16x4096]

Writes DIR/overhead.json and DIR/overhead_profile.txt and prints the JSON.
"""

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import tilelang
import torch

from kernel import attention
from kernel.arch import target
from kernel.backward import sweep_calls
from kernel.builder import build, constant_decay, cuda_arch, precompile, sm_count
from kernel.config import Call, Problem, model_call, retnet_decay
from kernel.timing import L2_FLUSH_BYTES, bench
from kernel.validate import random_qkv
from kernel.variants import pass_configs, prim_funcs, unused_state
from tuner.space import wave_seeds


def host_us(fn, calls: int = 100) -> float:
    """Microseconds of host time per call of ``fn``, ``calls`` calls back to back before one
    synchronize (few enough launches that the GPU's queue never blocks the host)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def gpu_idle_us(fn, reps: int = 20) -> dict:
    """The GPU's timeline of ``fn()`` after an L2 flush, as ``bench`` times it, from
    torch's profiler: per kernel of the call, in launch order, its name, its duration and
    the GPU's idle time before it (since the previous kernel ended; the first's since the
    flush ended), medians over ``reps`` calls, in microseconds. Idle time is time the
    kernels waited for the host to launch them."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            fn()
            torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    flush_name = kernels[0].name
    calls: list[list] = []
    for e in kernels:  # each call: the flush, then its own kernels
        if e.name == flush_name:
            calls.append([e])
        else:
            calls[-1].append(e)
    lengths = {len(c) for c in calls}
    if len(lengths) != 1:
        return {"error": f"calls launched different numbers of kernels: {sorted(lengths)}"}

    def median(values: list[float]) -> float:
        return statistics.median(values)

    steps = []
    for i in range(1, lengths.pop()):
        steps.append(
            {
                "kernel": calls[0][i].name[:80],
                "idle_before_us": median([c[i].time_range.start - c[i - 1].time_range.end for c in calls]),
                "duration_us": median([c[i].time_range.end - c[i].time_range.start for c in calls]),
            }
        )
    span = median([c[-1].time_range.end - c[0].time_range.end for c in calls])
    return {"reps": len(calls), "span_after_flush_us": span, "kernels": steps}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="8x16x4096", help="BxHxS, DK = DV = 128, bf16")
    args = parser.parse_args()
    b, h, s = (int(x) for x in args.shape.split("x"))
    problem = Problem(b, h, s, 128, 128, "bfloat16")
    call = Call(model_call(problem).scale)  # no state, as the bench's backward rows
    q, k, v = (x.requires_grad_() for x in random_qkv(problem, seed=2))
    do = torch.randn_like(v, dtype=torch.float32).to(v.dtype)
    decay = constant_decay(retnet_decay(h), h, q.device)

    def forward():
        return attention.decay_attention(q, k, v, decay, scale=call.scale)[0]

    def both():
        return torch.autograd.grad(forward(), (q, k, v), do)

    kept = forward()

    def backward():
        return torch.autograd.grad(kept, (q, k, v), do, retain_graph=True)

    result: dict = {"shape": args.shape, "kernels_ms": {}, "calls_ms": {}}
    # Each kernel on the inputs decay_attention hands it (kernel.backward): the forward on
    # (q, k, v); dq = F(do, v, k); dk = F_rev(v, do, q); dv = F_rev(k, q, do).
    inputs = {"forward": (q, k, v), "dq sweep": (do, v, k), "dk sweep": (v, do, q), "dv sweep": (k, q, do)}
    jobs = [attention.kernel_job(p, c, b) for p, c in [(problem, call), *sweep_calls(problem, call)]]
    # The reversed sweeps run the forward's configs: does the forward's ranking hold
    # backwards in time? The wave seeds (the bench's candidates) are timed both ways.
    seeds = wave_seeds(problem, arch=cuda_arch(), sms=sm_count())
    ways = [(c, dataclasses.replace(call, reverse=r)) for c in seeds for r in (False, True)]
    tiny = Problem(1, h, 64, 128, 128, "bfloat16")
    jobs_tiny = attention.training_jobs(tiny, call, 1)
    precompile([*jobs, *jobs_tiny, *((problem, c, w) for c, w in ways)], arch=cuda_arch())  # in parallel
    built = {}
    for (name, tensors), job in zip(inputs.items(), jobs):
        kernel = built[name] = build(*job)
        tensors = [t.detach() for t in tensors]
        timing = bench(lambda kernel=kernel, tensors=tensors: kernel(*tensors, decay=decay))
        result["kernels_ms"][name] = {"config": job[1].label, "median_ms": timing.median_ms}
    plain = [t.detach() for t in (q, k, v)]
    result["directions_ms"] = []
    for config, way in ways:
        kernel = build(problem, config, way)
        timing = bench(lambda kernel=kernel: kernel(*plain, decay=decay))
        result["directions_ms"].append(
            {"config": config.label, "reverse": way.reverse, "median_ms": timing.median_ms}
        )
    with torch.no_grad():
        result["calls_ms"]["forward"] = bench(forward).median_ms
    result["calls_ms"]["backward"] = bench(backward).median_ms
    result["calls_ms"]["fwd+bwd"] = bench(both).median_ms

    # The capture's own leaves, warmed up on a side stream as torch advises: autograd
    # keeps the stream it first met a leaf on, and the leaves above met the default stream.
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

    def captured():
        o = attention.decay_attention(*leaves, decay, scale=call.scale)[0]
        return torch.autograd.grad(o, leaves, do)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        captured()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured()
    result["calls_ms"]["fwd+bwd, CUDA graph replay"] = bench(graph.replay).median_ms

    # The host's time per call, layer by layer, from TileLang's own call of the forward's
    # kernel up to the forward plus backward.
    kernel = built["forward"]
    h0, ht, out = unused_state(problem, q.device), unused_state(problem, q.device), torch.empty_like(v)
    backward_op = torch.ops.decay_tuner.decay_attention_backward
    layers = {
        "TileLang's call of the forward's kernel": lambda: kernel.compiled[0](*plain, decay, h0, out, ht),
        "ScalarDecayKernel call (checks its tensors)": lambda: kernel(*plain, decay=decay),
        "decay_attention forward, no autograd": lambda: attention.decay_attention(
            *plain, decay, scale=call.scale
        ),
        "decay_attention forward, with autograd": forward,
        "the backward op (three sweeps)": lambda: backward_op(
            *plain, do, decay, 1.0, call.scale, None, None, None
        ),
        "the backward's implementation, as an eager call runs it": lambda: attention._backward(
            *plain, do, decay, 1.0, call.scale, None, None, None
        ),
        "forward plus backward": both,
    }
    if kernel.config.segments != 1:  # the split launches several kernels of other signatures
        del layers["TileLang's call of the forward's kernel"]
    else:  # the same kernel behind TileLang's other execution backends
        for backend in ("cython", "nvrtc"):
            try:
                other = tilelang.compile(
                    prim_funcs(problem, kernel.config, call, arch=cuda_arch())[0],
                    target=target(cuda_arch()),
                    pass_configs=pass_configs(cuda_arch()),
                    execution_backend=backend,
                )
            except Exception as exc:  # a backend this machine cannot build: say why
                result.setdefault("backend_errors", {})[backend] = f"{type(exc).__name__}: {exc}"[:300]
                continue
            layers[f"TileLang's call, {backend} backend"] = lambda k=other: k(*plain, decay, h0, out, ht)
    result["host_us"] = {name: host_us(fn) for name, fn in layers.items()}
    # The same calls at a shape whose kernels take a few microseconds: the GPU's queue
    # cannot bound the loop there, so these are the host's own times.
    tq, tk, tv = (x.requires_grad_() for x in random_qkv(tiny, seed=3))
    tdo = torch.randn_like(tv)

    def tiny_forward():
        return attention.decay_attention(tq, tk, tv, decay, scale=call.scale)[0]

    result["host_us_tiny"] = {
        "shape": f"1x{h}x64",
        "decay_attention forward, with autograd": host_us(tiny_forward),
        "forward plus backward": host_us(lambda: torch.autograd.grad(tiny_forward(), (tq, tk, tv), tdo)),
    }

    result["gpu_idle_us"] = gpu_idle_us(both)

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(100):
        both()
    torch.cuda.synchronize()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overhead_profile.txt").write_text(text.getvalue())
    (args.out / "overhead.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
