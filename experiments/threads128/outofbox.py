"""What a fresh process serves on this GPU (``kernel.rule.default_config`` with its
bandwidth: on an H100, ``CHAIN`` where the H200's rule splits in two past 3/4 of the SMs)
against the H200's rule (the same rule without a bandwidth, served as a table of its
configs for the forward and the backward's dq sweep), forward and forward plus backward,
in one process.

    python experiments/threads128/outofbox.py [BxHxS[:N],...] > outofbox-h100.jsonl

(an argument: those bf16 shapes alone, ``:N`` a packed batch of N sequences of S/N tokens)

The call is a model's: ``decay_attention(q, k, v, decay, output_final_state=True)``, RetNet's
decays, bf16 (one fp16 shape), dense and one packed batch. Before timing, each mode's output
is checked against reference C (fp32, the kernels' chunking) and its gradients against the
other mode's (relative L2). Timings: ``kernel.timing.time_gpu`` (CUDA events, L2 flushed,
median), the host's launches queued ahead, so the GPU's time.
"""

import dataclasses
import json
import sys

import torch

import refs
from kernel.builder import cuda_arch, memory_bandwidth, precompile, sm_count
from kernel.config import Call, Problem, model_call, retnet_decay
from kernel.ops import decay_attention, serve
from kernel.ops.dispatch import Dispatch, DispatchEntry
from kernel.rule import default_config
from kernel.timing import time_gpu
from tuner.bench_rows import copy_bandwidth

# (B, H, S, dtype, packed sequences or 0): where the two rules differ at DK = DV = 128, and
# two where they agree (3x16x8192, 8x16x4096: their ratio is the run's noise).
SHAPES = [
    (4, 16, 2048, "bfloat16", 0),
    (4, 16, 4096, "bfloat16", 0),
    (4, 16, 8192, "bfloat16", 0),
    (4, 16, 16384, "bfloat16", 0),
    (4, 16, 32768, "bfloat16", 0),
    (8, 8, 8192, "bfloat16", 0),
    (7, 8, 8192, "bfloat16", 0),
    (2, 32, 4096, "bfloat16", 0),
    (1, 64, 8192, "bfloat16", 0),
    (4, 16, 8192, "float16", 0),
    (1, 16, 32768, "bfloat16", 4),
    (3, 16, 8192, "bfloat16", 0),
    (8, 16, 4096, "bfloat16", 0),
]


def h200_rule(shapes: list[tuple]) -> Dispatch:
    """The rule without a bandwidth at each shape's forward and dq sweep (128/128: the same)."""
    problems = {
        Problem(n or b, h, s // (n or 1), 128, 128, dtype) for b, h, s, dtype, n in shapes
    }  # a packed batch is served as its sequences of the mean length
    entries = [
        DispatchEntry(p, default_config(p, cuda_arch(), sm_count())) for p in sorted(problems, key=str)
    ]
    return Dispatch(entries, {})


def the_call(p: Problem, packed: int) -> Call:
    """The model's call (``model_call``), of ``packed`` sequences where it is not 0."""
    return dataclasses.replace(model_call(p), packed=bool(packed))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def shapes(argv: list[str]) -> list[tuple]:
    """``SHAPES``, or those ``argv[0]`` names."""
    if not argv:
        return SHAPES
    named = []
    for item in argv[0].split(","):
        shape, _, packed = item.partition(":")
        b, h, s = map(int, shape.split("x"))
        named.append((b, h, s, "bfloat16", int(packed or 0)))
    return named


def main() -> None:
    serve.use_table(None)  # no table: the rule, with this GPU's bandwidth
    modes = {"out of the box": None, "h200 rule": h200_rule(shapes(sys.argv[1:]))}
    props = torch.cuda.get_device_properties(0)
    print(
        json.dumps(
            {
                "kind": "env",
                "gpu": props.name,
                "memory_clock_khz": props.memory_clock_rate,
                "memory_bus_bits": props.memory_bus_width,
                "peak_bandwidth": memory_bandwidth(),
                "copy_bandwidth": copy_bandwidth(),
                "sms": sm_count(),
            }
        ),
        flush=True,
    )
    calls = []
    for b, h, s, dtype, n in shapes(sys.argv[1:]):
        p = Problem(1 if n else b, h, s, 128, 128, dtype)
        calls.append((p, n))
    jobs = set()
    for table in modes.values():
        serve.use_table(table)
        for p, n in calls:
            jobs |= serve.training_jobs(p, the_call(p, n), n or p.batch)
    precompile(sorted(jobs, key=str), arch=cuda_arch(), workers=16)
    print(json.dumps({"kind": "compiled", "kernels": len(jobs)}), flush=True)
    for p, n in calls:
        gen = torch.Generator(device="cuda").manual_seed(p.batch * p.seqlen + n)
        dt = getattr(torch, p.dtype)
        q, k, v = (
            torch.randn(p.batch, p.seqlen, p.heads, 128, device="cuda", generator=gen, dtype=dt)
            for _ in "qkv"
        )
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        do = torch.randn(p.batch, p.seqlen, p.heads, 128, device="cuda", generator=gen, dtype=dt)
        decay = torch.tensor(retnet_decay(p.heads), device="cuda", dtype=torch.float32)
        cu = None
        if n:
            cu = torch.arange(0, p.seqlen + 1, p.seqlen // n, device="cuda", dtype=torch.int32)
        ours = lambda: decay_attention(q, k, v, decay, output_final_state=True, cu_seqlens=cu)  # noqa: E731
        if n:
            want = torch.cat(
                [
                    refs.kernel_mimic(*(t.detach()[:, a:z] for t in (q, k, v)), decay, 64, scale=128**-0.5)
                    for a, z in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)
                ],
                dim=1,
            )
        else:
            want = refs.kernel_mimic(q.detach(), k.detach(), v.detach(), decay, 64, scale=128**-0.5)
        grads = {}
        for mode, table in modes.items():
            serve.use_table(table)
            o = ours()[0]
            o.backward(do)
            grads[mode] = [t.grad.clone() for t in (q, k, v)]
            for t in (q, k, v):
                t.grad = None
            row = dict(kind="time", b=p.batch, h=p.heads, s=p.seqlen, dtype=p.dtype, packed=n, mode=mode)
            row["rel_l2_vs_ref_c"] = rel(o.detach(), want)
            row["config"] = serve.kernel_job(p, the_call(p, n), n or p.batch)[1].label
            row["sweeps"] = {
                name: c.label for name, c in serve.backward_configs(p, the_call(p, n), n or p.batch).items()
            }
            with torch.no_grad():
                row["fwd_ms"] = time_gpu(ours, warmup_ms=10, rep_ms=50, host_ahead=True).median_ms
            both = time_gpu(lambda: ours()[0].backward(do), warmup_ms=10, rep_ms=50, host_ahead=True)  # noqa: B023
            row["fwdbwd_ms"] = both.median_ms
            for t in (q, k, v):
                t.grad = None
            print(json.dumps(row), flush=True)
        gap = [rel(a, b) for a, b in zip(*grads.values(), strict=True)]
        print(
            json.dumps(
                {"kind": "grads", "b": p.batch, "h": p.heads, "s": p.seqlen, "packed": n, "rel_l2": gap}
            )
        )


if __name__ == "__main__":
    main()
