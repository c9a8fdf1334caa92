"""Experiment (issue 5; not part of the tool): the split's first segment on a second CUDA
stream, beside the states kernel, and what the L2 flush itself costs a timed kernel.

``states_step.py`` found the states kernel at its memory schedule's floor (the same time
with no arithmetic at all), so at 2x16x16384 its 62 us can only shrink with fewer bytes
or be hidden. It launches ``(P - 1) * lanes`` blocks, one per SM, so 36 of the 132 SMs
idle while it runs (96 blocks); the first segment's outputs need no incoming state.
``side`` runs that segment's outputs kernel (grid 1 along the segments) on a second
stream, launched right after the states kernel, then the carry and the other segments'
outputs (grid ``P - 1``) on the caller's stream, which waits for the second stream at the
end. Same chunk loop, same math: only the launch changes.

``kernel.timing.bench`` flushes L2 by writing 256 MB (as Triton's ``do_bench`` does), so
every repetition starts with L2 full of dirty lines that the timed kernel's misses must
write back. The ``flush`` rows time the same calls after a flush that reads 256 MB
(clean lines) instead: the difference is that write-back, which every timed figure in
these reports includes (the copy rate too).

    source .gpu/setup.sh && cd reports/h200 && python3 side_stream.py > $OUT/side_stream.jsonl
"""

import logging
import sys
from functools import partial

import tilelang
import tilelang.language as T
import torch
from modes import B1H8, B2H16, B4H16

from kernel import KernelConfig, Problem
from kernel.build import ScalarDecayKernel, states_buffer
from kernel.scalar_decay import chunk_loop_macro

TIMED = [
    (B2H16, KernelConfig(64, 128, 3, 256, segments=4)),
    (B2H16, KernelConfig(64, 128, 3, 256, segments=8)),
    (B1H8, KernelConfig(64, 128, 3, 256, segments=16)),
    (B4H16, KernelConfig(64, 128, 3, 256, segments=2)),
    (B4H16, KernelConfig(64, 128, 3, 256, segments=4)),
]
CHECKED = [
    (Problem(1, 2, 1000, 128, 128, 0.5, "bfloat16"), KernelConfig(64, 64, 1, 128, segments=4)),
    (Problem(2, 2, 777, 64, 128, 0.8, "bfloat16"), KernelConfig(32, 64, 2, 128, segments=8)),
    (Problem(2, 1, 65, 128, 128, 0.9), KernelConfig(64, 128, 2, 256, segments=2)),
]


def outputs_funcs(problem: Problem, config: KernelConfig):
    """``(first(Q, K, V, O), rest(Q, K, V, States, O))``: the split's outputs kernel for
    segment 0 (from a zero state) and for segments 1 to P - 1."""
    batch, heads, seqlen, dk, dv = problem.batch, problem.heads, problem.seqlen, problem.dk, problem.dv
    dtype, block_dv = problem.dtype, config.block_dv
    L, P = config.segment_length(seqlen), config.segment_count(seqlen)
    chunk_loop = chunk_loop_macro(
        chunk=config.chunk,
        dk=dk,
        block_dv=block_dv,
        alpha=problem.alpha,
        num_stages=config.num_stages,
        threads=config.threads,
        scores=config.scores,
        dtype=dtype,
    )

    @T.prim_func
    def first(
        Q: T.Tensor([batch, seqlen, heads, dk], dtype),
        K: T.Tensor([batch, seqlen, heads, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype),
        O: T.Tensor([batch, seqlen, heads, dv], dtype),
    ):
        with T.Kernel(T.ceildiv(dv, block_dv), batch * heads, threads=config.threads) as (bv, bbh):
            chunk_loop(Q, K, V, O, bbh // heads, bbh % heads, bv * block_dv, 0, L // config.chunk, None, 0, 0)

    @T.prim_func
    def rest(
        Q: T.Tensor([batch, seqlen, heads, dk], dtype),
        K: T.Tensor([batch, seqlen, heads, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype),
        States: T.Tensor([batch * heads, P, dk, dv], "float32"),
        O: T.Tensor([batch, seqlen, heads, dv], dtype),
    ):
        with T.Kernel(T.ceildiv(dv, block_dv), batch * heads, P - 1, threads=config.threads) as (bv, bbh, bp):
            bb, bh, v0 = bbh // heads, bbh % heads, bv * block_dv
            chunk_loop(Q, K, V, O, bb, bh, v0, (bp + 1) * L, L // config.chunk, States, bbh, bp + 1)

    return first, rest


class SideSplit:
    """The tool's split with the first segment's outputs on a second stream."""

    def __init__(self, tool: ScalarDecayKernel, arch: str):
        self.problem, self.config = tool.problem, tool.config
        self.states, self.carry = tool.compiled[:2]
        target = {"kind": "cuda", "arch": arch}
        self.first, self.rest = (
            tilelang.compile(f, target=target) for f in outputs_funcs(tool.problem, tool.config)
        )
        self.side = torch.cuda.Stream()

    def __call__(self, q, k, v, *, out=None):
        out = torch.empty_like(v) if out is None else out
        main = torch.cuda.current_stream()
        states = states_buffer(self.problem, self.config, q.device)
        self.side.wait_stream(main)  # the inputs and ``out`` are ready
        self.states(k, v, states)
        with torch.cuda.stream(self.side):
            self.first(q, k, v, out)
        self.carry(states)
        self.rest(q, k, v, states, out)
        main.wait_stream(self.side)
        return out


def bench_read_flush(fn, reps: int = 50) -> float:
    """Median ms of ``fn()`` after an L2 flush that reads 256 MB (clean lines), CUDA events."""
    flush = torch.ones(64 * 1024 * 1024, device="cuda")
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        flush.sum()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _compile_outputs(case: tuple[Problem, KernelConfig], arch: str) -> None:
    for f in outputs_funcs(*case):
        tilelang.compile(f, target={"kind": "cuda", "arch": arch})


def gpu() -> int:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from modes import check_kept, emit, inputs_for, time_modes

    from kernel import build
    from kernel.build import cuda_arch, precompile
    from kernel.timing import bench
    from tuner.bench import COPY_BYTES, copy_bandwidth

    # Fill TileLang's disk cache in parallel: the builds below are then cache hits.
    precompile(TIMED + CHECKED, arch=cuda_arch())
    with ProcessPoolExecutor(mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(partial(_compile_outputs, arch=cuda_arch()), TIMED + CHECKED))
    copy_rate = copy_bandwidth()
    emit({"kind": "copy", "bytes_per_s": copy_rate})
    kernels = {}
    for problem, config in TIMED + CHECKED:
        tool = build(problem, config)
        for mode, kern in (("tool", tool), ("side", SideSplit(tool, cuda_arch()))):
            check_kept(kernels, mode, kern, TIMED, seed=71)
    inputs = inputs_for(kernels, seed=72)
    time_modes(kernels, inputs, kind="whole", copy_rate=copy_rate)

    # What the write flush costs: the same calls after a write flush and after a read flush.
    src = torch.randn(COPY_BYTES // 4, device="cuda")
    dst = torch.empty_like(src)
    calls = {"copy": lambda: dst.copy_(src)}
    for (mode, p, config), kern in kernels.items():
        if mode == "tool" and config.segments in (4, 16):
            q, k, v = inputs[p]
            states = states_buffer(p, config)
            name = f"{p.batch}x{p.heads}x{p.seqlen} {config.label}"
            calls[f"whole {name}"] = partial(kern, q, k, v, out=torch.empty_like(v))
            calls[f"states {name}"] = partial(kern.compiled[0], k, v, states)
    for name, fn in calls.items():
        emit(
            {
                "kind": "flush",
                "what": name,
                "write_flush_ms": bench(fn).median_ms,
                "read_flush_ms": bench_read_flush(fn),
            }
        )
    return 0


logging.getLogger("tilelang").setLevel(logging.WARNING)  # its INFO lines go to stdout

if __name__ == "__main__":
    sys.exit(gpu())
