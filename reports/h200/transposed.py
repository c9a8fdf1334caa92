"""The chunk step with the state transposed and kept in registers (issue 5, experiment;
not part of the tool).

``ablate.py`` found that leaving out only the state's fp32 -> fp16 copy into ``S_s`` (and
the barriers around it) brings the headline kernel from 1.25x to 1.09x the floor. Here the
block keeps ``S^T`` (``[bDV, DK]``) as the accumulator of ``V^T @ Kw``, so its fp16 cast is
the register A operand of the inter-chunk MMA ``O^T = S^T @ Q^T`` (the pattern of
FlashAttention's ``P @ V``), and ``S_s`` is gone. Every MMA then yields transposed
tiles: ``A^T = K @ Q^T``, ``O^T += V^T @ (A^T * Gamma^T)``, and the output tile is written
transposed into ``O_s`` before its TMA store.

    source .gpu/setup.sh && cd reports/h200 && python3 transposed.py > $OUT/transposed.jsonl
    python3 reports/h200/transposed.py probe     # CPU: compile, print shared memory, spills

Rows: ``copy``; ``check`` (against reference C, NaN-prefilled, fresh inputs; both
kernels); ``time`` (the tool's single-pass kernel and this one, taking turns).
"""

import logging
import math
import sys
from functools import partial

import tilelang
import tilelang.language as T
import torch
from modes import emit

from kernel import KernelConfig, Problem
from kernel.resources import DEFAULT_ARCH
from kernel.scalar_decay import fp32_constant
from kernel.timing import alternating

HEADLINE = Problem(8, 16, 4096, 128, 128, 0.99)
CONFIGS = [KernelConfig(64, 128, 2, 256), KernelConfig(64, 128, 3, 256)]
CHECKED = [
    (Problem(2, 3, 300, 128, 128, 0.5, "bfloat16"), KernelConfig(64, 128, 2, 256)),
    (Problem(2, 2, 1000, 64, 128, 0.9), KernelConfig(64, 128, 2, 256)),
]
FULL_ROW = T.GemmWarpPolicy.FullRow


def transposed_func(problem: Problem, config: KernelConfig):
    """The single-pass kernel ``main(Q, K, V, O)`` with the transposed register state."""
    batch, heads, seqlen, dk, dv, alpha, dtype = (
        problem.batch,
        problem.heads,
        problem.seqlen,
        problem.dk,
        problem.dv,
        problem.alpha,
        problem.dtype,
    )
    C, block_dv, accum = config.chunk, config.block_dv, "float32"
    log2_alpha = math.log2(alpha)
    alpha_pow_c = fp32_constant(alpha**C)

    @T.prim_func
    def main(
        Q: T.Tensor([batch, seqlen, heads, dk], dtype),
        K: T.Tensor([batch, seqlen, heads, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype),
        O: T.Tensor([batch, seqlen, heads, dv], dtype),
    ):
        with T.Kernel(T.ceildiv(dv, block_dv), batch * heads, threads=config.threads) as (bv, bbh):
            bb = bbh // heads
            bh = bbh % heads
            v0 = bv * block_dv
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
            # GammaT[j, i] = alpha^(i-j) for key j <= query i, else 0
            for j, i in T.Parallel(C, C):
                GammaT[j, i] = T.if_then_else(
                    j <= i, T.exp2(log2_alpha * T.Cast(accum, i - j)), T.Cast(accum, 0)
                )
            T.clear(ST_f)
            for c in T.Pipelined(T.ceildiv(seqlen, C), num_stages=config.num_stages):
                s0 = c * C
                T.copy(Q[bb, s0 : s0 + C, bh, :], Q_s)
                T.copy(K[bb, s0 : s0 + C, bh, :], K_s)
                T.copy(V[bb, s0 : s0 + C, bh, v0 : v0 + block_dv], V_s)
                T.copy(ST_f, ST_h)  # the state before this chunk, as the MMA's A operand
                T.wgmma_gemm(K_s, Q_s, AT, transpose_B=True, clear_accum=True)  # [C_j, C_i]
                T.wgmma_gemm(ST_h, Q_s, OT, transpose_B=True, clear_accum=True, policy=FULL_ROW)
                T.wait_wgmma(1)  # AT is ready
                for r, d in T.Parallel(C, dk):
                    Kw_s[r, d] = K_s[r, d] * T.exp2(log2_alpha * T.Cast(accum, C - 1 - r))
                for j, i in T.Parallel(C, C):
                    AT_cast[j, i] = AT[j, i] * GammaT[j, i]
                T.wait_wgmma(0)
                touch[0] = Q_s[0, 0]
                for v, i in T.Parallel(block_dv, C):
                    OT[v, i] *= T.exp2(log2_alpha * T.Cast(accum, i + 1))
                T.wgmma_gemm(V_s, AT_cast, OT, transpose_A=True, policy=FULL_ROW)  # [bDV, C_i]
                for v, d in T.Parallel(block_dv, dk):
                    ST_f[v, d] *= alpha_pow_c
                T.wgmma_gemm(V_s, Kw_s, ST_f, transpose_A=True, policy=FULL_ROW)  # [bDV, DK]
                T.wait_wgmma(1)  # the outputs are ready; the state's MMA may still run
                for i, v in T.Parallel(C, block_dv):
                    O_s[i, v] = OT[v, i]
                T.copy(O_s, O[bb, s0 : s0 + C, bh, v0 : v0 + block_dv])
                T.wait_wgmma(0)
                touch[0] = V_s[0, 0]

    return main


def compile_transposed(problem: Problem, config: KernelConfig, arch: str):
    return tilelang.compile(transposed_func(problem, config), target={"kind": "cuda", "arch": arch})


logging.getLogger("tilelang").setLevel(logging.WARNING)  # its INFO lines go to stdout


def main(mode: str = "gpu") -> int:
    if mode == "probe":
        from kernel.resources import _ptxas, parse_ptxas

        for problem, config in [(HEADLINE, c) for c in CONFIGS] + CHECKED:
            kern = compile_transposed(problem, config, DEFAULT_ARCH)
            ok, log = _ptxas(kern.get_kernel_source(), DEFAULT_ARCH)
            print(problem.seqlen, config.label, ok and parse_ptxas(log), flush=True)
        return 0

    from kernel import build
    from kernel.build import ScalarDecayKernel, cuda_arch
    from kernel.validate import check, random_qkv
    from tuner.bench import copy_bandwidth, traffic_bytes

    copy_rate = copy_bandwidth()
    emit({"kind": "copy", "bytes_per_s": copy_rate})
    q, k, v = random_qkv(HEADLINE, seed=41)
    out = torch.empty_like(v)
    calls = {}
    for problem, config in [(HEADLINE, c) for c in CONFIGS] + CHECKED:
        mine = ScalarDecayKernel(problem, config, (compile_transposed(problem, config, cuda_arch()),))
        tool = build(problem, config)
        for name, kern in (("transposed", mine), ("tool", tool)):
            row = check(kern, seed=42)
            emit(
                {"kind": "check", "kernel": name, "problem": problem.to_dict(), "config": config.label} | row
            )
            if problem == HEADLINE:
                calls[config, name] = partial(kern, q, k, v, out=out)
    for (config, name), ms in alternating(calls).items():
        median = sorted(ms)[1]
        emit(
            {"kind": "time", "kernel": name, "shape": "8x16x4096", "config": config.label}
            | {"median_ms": median, "all_ms": ms}
            | {"x_floor": median * 1e-3 * copy_rate / traffic_bytes(HEADLINE)}
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
