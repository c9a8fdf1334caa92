"""How close to the copy rate can the kernel's own memory schedule get? (issue 5, experiment)

A *stream* kernel has the outputs kernel's grid ``(DV / bDV, B*H, P)``, threads, pipeline
depth and tiles: per chunk it TMA-loads the ``[C, DK]`` tiles of Q and K and the
``[C, bDV]`` tile of V, and stores ``O = Q + K + V`` (the first bDV columns) through
``O_s``, but does none of the chunk step's MMAs. Its time is the floor of this memory
schedule; the outputs kernel's time above it is what the chunk step's math costs.
Same run, same inputs (random, not zeros), L2 flushed before every repetition:

    source .gpu/setup.sh && cd reports/h200 && python3 stream_floor.py > $OUT/stream_floor.jsonl
    python3 reports/h200/stream_floor.py probe      # CPU: compile every stream kernel

Rows, as JSON lines: ``copy`` (the run's copy rate); ``check`` (each stream kernel's
output against ``q + k + v`` in torch, NaN-prefilled); ``time``: for each (shape, config,
segments), the stream kernel and the tool's outputs kernel alone (incoming states
computed once before), both against the problem's floor at the run's copy rate. The
committed run (``issue5/floor/stream_floor.jsonl``) timed the "async" chunk step, before
the "transposed" one became the kernel.
"""

import logging
import sys
from functools import partial

import tilelang
import tilelang.language as T
import torch
from modes import B1H8, B2H16, emit

from kernel import KernelConfig, Problem
from kernel.resources import DEFAULT_ARCH
from kernel.timing import alternating

HEADLINE = Problem(8, 16, 4096, 128, 128, 0.99)
CASES = [
    (HEADLINE, KernelConfig(64, 128, 2, 256)),
    (HEADLINE, KernelConfig(64, 128, 3, 256)),
    (B2H16, KernelConfig(64, 128, 2, 256, segments=4)),
    (B2H16, KernelConfig(64, 128, 2, 256, segments=8)),
    (B1H8, KernelConfig(64, 128, 3, 256, segments=16)),
    (B1H8, KernelConfig(64, 128, 2, 256, segments=32)),
    (B1H8, KernelConfig(64, 64, 2, 256, segments=16)),
]


def stream_func(problem: Problem, config: KernelConfig):
    """The stream kernel ``main(Q, K, V, O)`` of one (problem, config)."""
    batch, heads, seqlen, dk, dv, dtype = (
        problem.batch,
        problem.heads,
        problem.seqlen,
        problem.dk,
        problem.dv,
        problem.dtype,
    )
    C, block_dv = config.chunk, config.block_dv
    L, P = config.segment_length(seqlen), config.segment_count(seqlen)

    @T.prim_func
    def main(
        Q: T.Tensor([batch, seqlen, heads, dk], dtype),
        K: T.Tensor([batch, seqlen, heads, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype),
        O: T.Tensor([batch, seqlen, heads, dv], dtype),
    ):
        with T.Kernel(T.ceildiv(dv, block_dv), batch * heads, P, threads=config.threads) as (bv, bbh, bp):
            bb = bbh // heads
            bh = bbh % heads
            v0 = bv * block_dv
            Q_s = T.alloc_shared([C, dk], dtype)
            K_s = T.alloc_shared([C, dk], dtype)
            V_s = T.alloc_shared([C, block_dv], dtype)
            O_s = T.alloc_shared([C, block_dv], dtype)
            for c in T.Pipelined(T.ceildiv(L, C), num_stages=config.num_stages):
                s0 = bp * L + c * C
                T.copy(Q[bb, s0 : s0 + C, bh, :], Q_s)
                T.copy(K[bb, s0 : s0 + C, bh, :], K_s)
                T.copy(V[bb, s0 : s0 + C, bh, v0 : v0 + block_dv], V_s)
                for i, j in T.Parallel(C, block_dv):
                    O_s[i, j] = Q_s[i, v0 + j] + K_s[i, v0 + j] + V_s[i, j]
                T.copy(O_s, O[bb, s0 : s0 + C, bh, v0 : v0 + block_dv])

    return main


def compile_stream(problem: Problem, config: KernelConfig, arch: str):
    return tilelang.compile(stream_func(problem, config), target={"kind": "cuda", "arch": arch})


logging.getLogger("tilelang").setLevel(logging.WARNING)  # its INFO lines go to stdout


def main(mode: str = "gpu") -> int:
    if mode == "probe":
        for problem, config in CASES:
            kern = compile_stream(problem, config, DEFAULT_ARCH)
            src = kern.get_kernel_source()
            print(config.label, problem.seqlen, "tma" if "tma_load" in src else "no TMA", flush=True)
        return 0

    from kernel import build
    from kernel.build import cuda_arch, states_buffer
    from kernel.validate import random_qkv
    from tuner.bench import copy_bandwidth, traffic_bytes

    copy_rate = copy_bandwidth()
    emit({"kind": "copy", "bytes_per_s": copy_rate})
    calls = {}
    for problem, config in CASES:
        q, k, v = random_qkv(problem, seed=5)
        out = torch.full_like(v, float("nan"))
        stream = compile_stream(problem, config, cuda_arch())
        stream(q, k, v, out)
        ref = q[..., : problem.dv] + k[..., : problem.dv] + v
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        emit(
            {"kind": "check", "shape": f"{problem.batch}x{problem.heads}x{problem.seqlen}"}
            | {"config": config.label, "rel_l2": err, "finite": bool(out.isfinite().all())}
        )
        kern = build(problem, config)
        if config.segments == 1:
            outputs = partial(kern.compiled[0], q, k, v, out)
        else:
            states_kernel, carry_kernel, outputs_kernel = kern.compiled
            states = states_buffer(problem, config)
            states_kernel(k, v, states)
            carry_kernel(states)
            outputs = partial(outputs_kernel, q, k, v, states, out)
        calls[problem, config, "stream"] = partial(stream, q, k, v, out)
        calls[problem, config, "outputs"] = outputs
    for (problem, config, what), ms in alternating(calls).items():
        median = sorted(ms)[1]
        emit(
            {"kind": "time", "what": what, "shape": f"{problem.batch}x{problem.heads}x{problem.seqlen}"}
            | {"config": config.label, "median_ms": median, "all_ms": ms}
            | {"x_floor": median * 1e-3 * copy_rate / traffic_bytes(problem)}
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
