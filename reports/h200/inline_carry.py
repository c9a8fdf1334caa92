"""Experiment (issue 5; not part of the tool): the split without its carry kernel. Run on
the H200; results in reports/h200/README.md, "The carry measured, and L2 eviction hints".

The split runs three kernels: states, carry (the prefix ``States[p] = alpha^L *
States[p - 1] + E[p]``), outputs. At 2x16x16384 the call was 3.5% (6.6 us) above issue 5's
1.5x of the floor; the states kernel runs as fast as its loads alone (``states_step.py``),
the carry alone takes 8.6 us with the L2 flush's write-back. Two modes beside the tool's:

* ``nocarry``: states, then outputs, the carry skipped (outputs wrong past the first
  segment; time only): the most any change to the carry can gain;
* ``inline``: no carry kernel; each outputs block starts from the prefix of the end
  states before its segment, ``S = alpha^L * S + E[q]`` for ``q < p``, read from the
  states kernel's output (hot in L2) in its prologue. ``inline_chunk_loop_macro`` is
  ``kernel.scalar_decay.transposed_chunk_loop_macro`` with only that prologue changed
  (copied, not switched, so that the kernel's source and the dispatch table's hash stay).
  Block ``p`` reads ``p`` states of 64 KB, so it suits few segments. Checked on the CPU:
  its CUDA differs from the tool's outputs kernel only in that prologue (loop names aside).

    python3 reports/h200/inline_carry.py cpu     # compile every case
    source .gpu/setup.sh && cd reports/h200 && python3 inline_carry.py > $OUT/inline_carry.jsonl

Rows: ``copy``; ``check`` (the tool and ``inline`` against reference C, NaN-prefilled);
``whole`` (the three modes taking turns over three rounds, ``modes.time_modes``).
"""

import logging
import math
import sys

import tilelang
import tilelang.language as T
from modes import SPLIT_CHECKED, SPLIT_TIMED

from kernel import KernelConfig, Problem
from kernel.scalar_decay import fp32_constant, transposes

TIMED = SPLIT_TIMED
CHECKED = [*SPLIT_CHECKED, (Problem(1, 3, 4096, 128, 128, 0.999), KernelConfig(64, 128, 2, 256, segments=64))]


def inline_chunk_loop_macro(
    *, chunk: int, dk: int, block_dv: int, alpha: float, num_stages: int, dtype: str, seg_len: int
):
    """``transposed_chunk_loop_macro`` whose block ``bp`` starts from the prefix of the end
    states ``States[bbh, 1 : bp + 1]`` (see the module) instead of ``States[bbh, bp]``."""
    C, accum = chunk, "float32"
    log2_alpha = math.log2(alpha)
    alpha_pow_c, alpha_pow_l = fp32_constant(alpha**C), fp32_constant(alpha**seg_len)
    rows = T.GemmWarpPolicy.FullRow

    @T.macro
    def chunk_loop(Q, K, V, O, bb, bh, v0, s_begin, n_chunks, States, bbh, bp):
        Q_s = T.alloc_shared([C, dk], dtype)
        K_s = T.alloc_shared([C, dk], dtype)
        Kw_s = T.alloc_shared([C, dk], dtype)
        V_s = T.alloc_shared([C, block_dv], dtype)
        O_s = T.alloc_shared([C, block_dv], dtype)
        AT_cast = T.alloc_shared([C, C], dtype)

        ST_f = T.alloc_fragment([block_dv, dk], accum)
        ST_h = T.alloc_fragment([block_dv, dk], dtype)
        OT = T.alloc_fragment([block_dv, C], accum)
        AT = T.alloc_fragment([C, C], accum)
        GammaT = T.alloc_fragment([C, C], accum)
        touch = T.alloc_local([1], dtype)

        for j, i in T.Parallel(C, C):
            GammaT[j, i] = T.if_then_else(j <= i, T.exp2(log2_alpha * T.Cast(accum, i - j)), T.Cast(accum, 0))
        T.clear(ST_f)
        for q in T.serial(bp):  # the carry, inline: the end states of segments 0 .. bp - 1
            for v, d in T.Parallel(block_dv, dk):
                ST_f[v, d] = ST_f[v, d] * alpha_pow_l + States[bbh, q + 1, d, v0 + v]

        for c in T.Pipelined(n_chunks, num_stages=num_stages):
            s0 = s_begin + c * C
            T.copy(Q[bb, s0 : s0 + C, bh, :], Q_s)
            T.copy(K[bb, s0 : s0 + C, bh, :], K_s)
            T.copy(V[bb, s0 : s0 + C, bh, v0 : v0 + block_dv], V_s)
            T.copy(ST_f, ST_h)
            T.wgmma_gemm(K_s, Q_s, AT, transpose_B=True, clear_accum=True)
            T.wgmma_gemm(ST_h, Q_s, OT, transpose_B=True, clear_accum=True, policy=rows)
            T.wait_wgmma(1)
            for r, d in T.Parallel(C, dk):
                Kw_s[r, d] = K_s[r, d] * T.exp2(log2_alpha * T.Cast(accum, C - 1 - r))
            for j, i in T.Parallel(C, C):
                AT_cast[j, i] = AT[j, i] * GammaT[j, i]
            T.wait_wgmma(0)
            touch[0] = Q_s[0, 0]
            for v, i in T.Parallel(block_dv, C):
                OT[v, i] *= T.exp2(log2_alpha * T.Cast(accum, i + 1))
            T.wgmma_gemm(V_s, AT_cast, OT, transpose_A=True, policy=rows)
            for v, d in T.Parallel(block_dv, dk):
                ST_f[v, d] *= alpha_pow_c
            T.wgmma_gemm(V_s, Kw_s, ST_f, transpose_A=True, policy=rows)
            T.wait_wgmma(1)
            for i, v in T.Parallel(C, block_dv):
                O_s[i, v] = OT[v, i]
            T.copy(O_s, O[bb, s0 : s0 + C, bh, v0 : v0 + block_dv])
            T.wait_wgmma(0)
            touch[0] = V_s[0, 0]

    return chunk_loop


def inline_outputs(problem: Problem, config: KernelConfig):
    """The split's outputs kernel ``(Q, K, V, States, O)`` with the carry inline."""
    assert transposes(
        chunk=config.chunk, block_dv=config.block_dv, threads=config.threads, scores=config.scores
    )
    batch, heads, seqlen, dk, dv = problem.batch, problem.heads, problem.seqlen, problem.dk, problem.dv
    dtype, block_dv = problem.dtype, config.block_dv
    L, P = config.segment_length(seqlen), config.segment_count(seqlen)
    chunk_loop = inline_chunk_loop_macro(
        chunk=config.chunk,
        dk=dk,
        block_dv=block_dv,
        alpha=problem.alpha,
        num_stages=config.num_stages,
        dtype=dtype,
        seg_len=L,
    )

    @T.prim_func
    def outputs(
        Q: T.Tensor([batch, seqlen, heads, dk], dtype),
        K: T.Tensor([batch, seqlen, heads, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype),
        States: T.Tensor([batch * heads, P, dk, dv], "float32"),
        O: T.Tensor([batch, seqlen, heads, dv], dtype),
    ):
        with T.Kernel(T.ceildiv(dv, block_dv), batch * heads, P, threads=config.threads) as (bv, bbh, bp):
            chunk_loop(
                Q,
                K,
                V,
                O,
                bbh // heads,
                bbh % heads,
                bv * block_dv,
                bp * L,
                L // config.chunk,
                States,
                bbh,
                bp,
            )

    return outputs


def _compile(case: tuple[Problem, KernelConfig], arch: str) -> bool:
    return (
        len(
            tilelang.compile(inline_outputs(*case), target={"kind": "cuda", "arch": arch}).get_kernel_source()
        )
        > 0
    )


def compile_all(arch: str) -> list[bool]:
    """Every case's inline outputs kernel, in spawned processes (fills the disk cache)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from functools import partial

    with ProcessPoolExecutor(mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(partial(_compile, arch=arch), TIMED + CHECKED))


def gpu() -> int:
    from modes import SplitCall, check_kept, emit, inputs_for, time_modes

    from kernel import build
    from kernel.build import cuda_arch, precompile
    from tuner.bench import copy_bandwidth

    arch = cuda_arch()
    precompile(TIMED + CHECKED, arch=arch)
    compile_all(arch)
    copy_rate = copy_bandwidth()
    emit({"kind": "copy", "bytes_per_s": copy_rate})
    kernels = {}
    for problem, config in TIMED + CHECKED:
        tool = build(problem, config)
        check_kept(kernels, "tool", tool, TIMED, seed=81)
        inline = tilelang.compile(inline_outputs(problem, config), target={"kind": "cuda", "arch": arch})
        check_kept(kernels, "inline", SplitCall(tool, outputs=inline, carry=False), TIMED, seed=81)
        if (problem, config) in TIMED:
            kernels["nocarry", problem, config] = SplitCall(tool, carry=False)  # time only
    time_modes(kernels, inputs_for(kernels, seed=82), kind="whole", copy_rate=copy_rate)
    return 0


def cpu() -> int:
    print(
        dict(
            zip(
                (f"{p.batch}x{p.heads}x{p.seqlen} {c.label}" for p, c in TIMED + CHECKED),
                compile_all("sm_90a"),
            )
        )
    )
    return 0


logging.getLogger("tilelang").setLevel(logging.WARNING)  # its INFO lines go to stdout

if __name__ == "__main__":
    sys.exit(cpu() if sys.argv[1:] == ["cpu"] else gpu())
