"""Time kernel.gated's forward beside fla's ``chunk_simple_gla(g=...)`` and the HBM floor at
the issue's goal shapes, in the model form (scale DK^-1/2, per-token gates from -1e-4 to
-20, the final state returned). One JSON line per measurement.

    source .gpu/setup.sh && python3 experiments/gated/bench.py | tee experiments/gated/bench.jsonl
    ... --dtype bfloat16 | tee experiments/gated/bench_bf16.jsonl

The floor: the bytes of q and k (G heads), v, g and o, and the final state, at the device's
measured copy rate (``tuner.bench_rows.copy_bandwidth``). fla's simple_gla takes no groups:
its q and k are repeated to H heads outside the timed call (it reads r times more of them).
Timing: ``kernel.timing.time_gpu`` (CUDA events, warm-up, L2 flushed before each
repetition, median and p20/p80). Each row carries the error of the output and the final
state against reference B in fp64, on a slice of heads where the shape is large.
"""

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

import refs
from kernel.arch import local_arch
from kernel.builder import precompile
from kernel.config import Call, KernelConfig, Problem
from kernel.gated_build import compile_gated
from kernel.processes import compile_pool
from kernel.timing import time_gpu
from kernel.variants import shape_generic
from tuner.bench_rows import copy_bandwidth

# (B, H, S, DK, DV, G)
SHAPES = [(8, 16, 4096, 128, 128, 16), (16, 32, 2048, 64, 64, 32), (4, 24, 4096, 128, 64, 1)]
# chunk/block_dv/stages/threads; every one fits in shared memory at the three head sizes
# (sm_90a, compiled on a CPU; at block_dv 128 with 256 threads ptxas spills about 200 bytes)
CONFIGS = [
    KernelConfig(64, 64, 1, 128),
    KernelConfig(64, 64, 2, 128),
    KernelConfig(64, 64, 3, 128),
    KernelConfig(64, 64, 1, 256),
    KernelConfig(64, 64, 2, 256),
    KernelConfig(64, 64, 3, 256),
    KernelConfig(64, 128, 1, 128),
    KernelConfig(64, 128, 1, 256),
    KernelConfig(64, 128, 2, 256),
    KernelConfig(64, 128, 3, 256),
]


def compile_variant(h, dk, dv, groups, config, box, dtype, arch):
    """A variant of the product's kernel for one config, in a compile process (into TileLang's
    disk cache): ``box`` 0, gate_tma.py's kernel of gates ``[B, H, S]`` by TMA; 1, the
    product's with each gate a scalar load (``kernel.gated.GATE_BOX`` = 1: what it ran before
    643639d); 4, gate_tma.py's boxes of 4 heads (the product's way since 643639d)."""
    from kernel.probe import compile_funcs

    if box == 1:
        from kernel import gated

        problem = shape_generic(Problem(1, h, 64, dk, dv, dtype, "token", groups), config, arch)
        box, gated.GATE_BOX = gated.GATE_BOX, 1  # the variant's trace alone
        try:
            func = gated.prim_func(problem, config, Call(dk**-0.5, final_state=True), arch=arch)
        finally:
            gated.GATE_BOX = box
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        from gate_tma import gated_fwd_t

        func = gated_fwd_t(
            heads=h, groups=groups, dk=dk, dv=dv, dtype=dtype, chunk=config.chunk, block_dv=config.block_dv,
            num_stages=config.num_stages, threads=config.threads, arch=arch, scale=dk**-0.5, final_state=True,
            box=box,
        )  # fmt: skip
    (kernel,) = compile_funcs([func], arch)
    return kernel


def precompile_variant(*args) -> None:
    compile_variant(*args)


def inputs(b, h, s, dk, dv, groups, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(b, s, groups, dk, generator=gen, device="cuda", dtype=dtype) for _ in range(2))
    v = torch.randn(b, s, h, dv, generator=gen, device="cuda", dtype=dtype)
    u = torch.rand(b, s, h, generator=gen, device="cuda")
    g = -torch.exp(math.log(1e-4) + u * (math.log(20.0) - math.log(1e-4)))  # -1e-4 .. -20
    return q, k, v, g.float()


def floor_bytes(b, h, s, dk, dv, groups, dtype) -> int:
    item = torch.tensor([], dtype=dtype).element_size()
    return b * s * (2 * groups * dk + 2 * h * dv) * item + b * s * h * 4 + b * h * dk * dv * 4


def error(o, ht, q, k, v, g, scale, heads: int = 2) -> float:
    """The worse rel L2 of o and the final state against reference B, on the first heads."""
    r = v.shape[2] // q.shape[2]
    groups = -(-heads // r)
    want_o, want_s = refs.gated_chunked(
        q[:1, :, :groups], k[:1, :, :groups], v[:1, :, : groups * r], g[:1, :, : groups * r], 64,
        scale=scale, output_final_state=True,
    )  # fmt: skip
    return max(refs.rel_l2(o[:1, :, : groups * r], want_o), refs.rel_l2(ht[:1, : groups * r], want_s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--variants", action="store_true", help="also compile_variant's kernels, dense")
    parser.add_argument(
        "--boxes",
        type=int,
        nargs="+",
        default=[0, 1],
        help="compile_variant's (0: [B, H, S]; 1: scalar)",
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth()
    print(
        json.dumps({"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bandwidth / 1e9}),
        flush=True,
    )
    arch = local_arch()
    jobs = [
        (Problem(b, h, s, dk, dv, args.dtype, "token", groups), config, Call(dk**-0.5, final_state=True))
        for b, h, s, dk, dv, groups in SHAPES
        for config in CONFIGS
        if config.block_dv <= dv
    ]
    precompile(jobs, arch=arch)  # in parallel, into the disk cache the loop below loads from
    variants = {}
    if args.variants:  # compiled in parallel too: each compile_variant below then hits the disk cache
        keys = [
            (h, dk, dv, groups, c, box)
            for _, h, _, dk, dv, groups in SHAPES
            for c in CONFIGS
            for box in args.boxes
            if c.block_dv <= dv and c.threads == 256
        ]
        with compile_pool(min(len(keys), os.cpu_count() or 1)) as pool:
            futures = [pool.submit(precompile_variant, *key, args.dtype, arch) for key in keys]
            for key, future in zip(keys, futures):
                try:
                    future.result()
                    variants[key] = compile_variant(*key, args.dtype, arch)
                except Exception as exc:
                    print(
                        json.dumps({"variant": str(key), "error": f"{type(exc).__name__}: {str(exc)[-300:]}"})
                    )
    for b, h, s, dk, dv, groups in SHAPES:
        shape = dict(shape=f"{b}x{h}x{s}", dk=dk, dv=dv, groups=groups, dtype=args.dtype)
        q, k, v, g = inputs(b, h, s, dk, dv, groups, dtype)
        scale = dk**-0.5
        floor_ms = floor_bytes(b, h, s, dk, dv, groups, dtype) / bandwidth * 1e3
        print(json.dumps(shape | {"impl": "floor", "median_ms": floor_ms}), flush=True)
        gamma = torch.zeros(h, device="cuda")
        h0 = torch.empty(b * h, 1, dk, dv, device="cuda")
        ht = torch.empty(b * h, 1, dk, dv, device="cuda")
        o = torch.empty_like(v)
        for config in CONFIGS:
            if config.block_dv > dv:
                continue
            row = shape | {
                "impl": "ours",
                "config": f"{config.chunk}/{config.block_dv}/{config.num_stages}/{config.threads}",
            }
            try:
                problem = Problem(b, h, s, dk, dv, args.dtype, "token", groups)
                kern = compile_gated(problem, config, Call(scale, final_state=True), arch=arch)
            except Exception as exc:  # a config that fails to compile is a row, not a stop
                print(json.dumps(row | {"error": f"{type(exc).__name__}: {str(exc)[-300:]}"}), flush=True)
                continue
            call = lambda: kern(q, k, v, g, gamma, h0, o, ht)
            o.fill_(math.nan)
            call()
            torch.cuda.synchronize()
            row["rel_l2"] = error(o, ht.view(b, h, dk, dv), q, k, v, g, scale)
            t = time_gpu(call)
            print(json.dumps(row | t.to_dict() | {"x_floor": t.median_ms / floor_ms}), flush=True)
            for box, gate, impl in ((0, g.transpose(1, 2).contiguous(), "ours, gates [B, H, S] by TMA"),
                                    (1, g, "ours, gates by scalar loads"),
                                    (4, g, "ours, gates by TMA boxes of 4 heads")):  # fmt: skip
                variant = variants.get((h, dk, dv, groups, config, box))
                if variant is None:
                    continue
                call = lambda: variant(q, k, v, gate, gamma, h0, o, ht)  # noqa: B023
                o.fill_(math.nan)
                call()
                torch.cuda.synchronize()
                row = row | {"impl": impl, "rel_l2": error(o, ht.view(b, h, dk, dv), q, k, v, g, scale)}
                t = time_gpu(call)
                print(json.dumps(row | t.to_dict() | {"x_floor": t.median_ms / floor_ms}), flush=True)
        if args.no_fla:
            continue
        from fla.ops.simple_gla import chunk_simple_gla

        r = h // groups
        qh, kh = (x.repeat_interleave(r, dim=2) for x in (q, k))
        call = lambda: chunk_simple_gla(qh, kh, v, g=g, scale=scale, output_final_state=True)
        fo, fs = call()
        row = shape | {"impl": "fla chunk_simple_gla", "rel_l2": error(fo, fs, q, k, v, g, scale)}
        t = time_gpu(call)
        print(json.dumps(row | t.to_dict() | {"x_floor": t.median_ms / floor_ms}), flush=True)


if __name__ == "__main__":
    main()
