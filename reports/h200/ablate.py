"""Where the chunk step's time goes: the single-pass kernel with parts of its chunk step
left out (issue 5, experiment; not part of the tool).

``stream_floor.py`` measured that the kernel's memory schedule alone (its loads and
stores, no math) runs at 1.06x the floor at the headline shape, where the kernel takes
1.24x: the chunk step's math is not hidden under the loads. This script times the async
chunk step of ``kernel.scalar_decay`` (copied here, with switches) with one part left out
at a time. Outputs of every variant but ``full`` are wrong by design; only ``full`` is
checked against reference C. Same run, variants taking turns, L2 flushed:

    source .gpu/setup.sh && cd reports/h200 && python3 ablate.py > $OUT/ablate.jsonl
    python3 reports/h200/ablate.py probe       # CPU: compile every variant, print smem

Parts (``VARIANTS`` names what each leaves out):
* ``inter``: the state's copy to ``S_s`` and the ``Q @ S`` MMA (the inter-chunk term);
* ``intra``: ``Q @ K^T``, the decay mask and ``(A * Gamma) @ V``;
* ``update``: K's weights, the state's decay and the ``Kw^T @ V`` MMA;
* ``elementwise``: every elementwise weight (K's, the mask, the rows', the state's decay);
* ``s_copy``: only the state's fp32 -> fp16 copy to ``S_s`` (the MMA reads a stale state);
* ``math``: everything but the loads and the output store.
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
CONFIGS = [KernelConfig(64, 128, 2, 256), KernelConfig(64, 64, 2, 256)]
VARIANTS = {
    "full": set(),
    "no_inter": {"inter"},
    "no_intra": {"intra"},
    "no_update": {"update"},
    "no_elementwise": {"elementwise"},
    "no_s_copy": {"s_copy"},
    "no_math": {"inter", "intra", "update", "elementwise", "s_copy"},
}


def ablated_func(problem: Problem, config: KernelConfig, skip: set[str]):
    """The single-pass kernel ``main(Q, K, V, O)`` with the async chunk step minus ``skip``."""
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
    inter, intra, update = "inter" not in skip, "intra" not in skip, "update" not in skip
    weights, s_copy = "elementwise" not in skip, "s_copy" not in skip

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
            S_s = T.alloc_shared([dk, block_dv], dtype)
            O_s = T.alloc_shared([C, block_dv], dtype)
            A_cast = T.alloc_shared([C, C], dtype)
            S_f = T.alloc_fragment([dk, block_dv], accum) if update or (inter and s_copy) else None
            acc_o = T.alloc_fragment([C, block_dv], accum)
            A = T.alloc_fragment([C, C], accum) if intra else None
            Gamma = T.alloc_fragment([C, C], accum) if intra and weights else None
            touch = T.alloc_local([1], dtype)
            if intra and weights:
                for i, j in T.Parallel(C, C):
                    Gamma[i, j] = T.if_then_else(
                        j <= i, T.exp2(log2_alpha * T.Cast(accum, i - j)), T.Cast(accum, 0)
                    )
            if S_f is not None:
                T.clear(S_f)
            for c in T.Pipelined(T.ceildiv(seqlen, C), num_stages=config.num_stages):
                s0 = c * C
                T.copy(Q[bb, s0 : s0 + C, bh, :], Q_s)
                T.copy(K[bb, s0 : s0 + C, bh, :], K_s)
                T.copy(V[bb, s0 : s0 + C, bh, v0 : v0 + block_dv], V_s)
                if inter and s_copy:
                    T.copy(S_f, S_s)
                if intra:
                    T.wgmma_gemm(Q_s, K_s, A, transpose_B=True, clear_accum=True)
                if inter:
                    T.wgmma_gemm(Q_s, S_s, acc_o, clear_accum=True)
                else:
                    T.clear(acc_o)
                T.wait_wgmma(1 if inter and intra else 0)
                if update:
                    if weights:
                        for r, d in T.Parallel(C, dk):
                            Kw_s[r, d] = K_s[r, d] * T.exp2(log2_alpha * T.Cast(accum, C - 1 - r))
                    else:
                        T.copy(K_s, Kw_s)
                else:
                    touch[0] = K_s[0, 0]  # K_s's last reader is the QK^T MMA just waited for
                if intra:
                    if weights:
                        for i, j in T.Parallel(C, C):
                            A_cast[i, j] = A[i, j] * Gamma[i, j]
                    else:
                        T.copy(A, A_cast)
                T.wait_wgmma(0)
                touch[0] = Q_s[0, 0]
                if inter and weights:
                    for i, j in T.Parallel(C, block_dv):
                        acc_o[i, j] *= T.exp2(log2_alpha * T.Cast(accum, i + 1))
                if intra:
                    T.wgmma_gemm(A_cast, V_s, acc_o)
                if update:
                    if weights:
                        for i, j in T.Parallel(dk, block_dv):
                            S_f[i, j] *= alpha_pow_c
                    T.wgmma_gemm(Kw_s, V_s, S_f, transpose_A=True)
                T.wait_wgmma(1 if intra and update else 0)
                T.copy(acc_o, O_s)
                T.copy(O_s, O[bb, s0 : s0 + C, bh, v0 : v0 + block_dv])
                T.wait_wgmma(0)
                touch[0] = V_s[0, 0]

    return main


def compile_variant(problem: Problem, config: KernelConfig, skip: set[str], arch: str):
    return tilelang.compile(ablated_func(problem, config, skip), target={"kind": "cuda", "arch": arch})


logging.getLogger("tilelang").setLevel(logging.WARNING)  # its INFO lines go to stdout


def main(mode: str = "gpu") -> int:
    if mode == "probe":
        for config in CONFIGS:
            for name, skip in VARIANTS.items():
                src = compile_variant(HEADLINE, config, skip, DEFAULT_ARCH).get_kernel_source()
                print(config.label, name, "wgmma" in src, flush=True)
        return 0

    from kernel.build import ScalarDecayKernel, cuda_arch
    from kernel.validate import check, random_qkv
    from tuner.bench import copy_bandwidth, traffic_bytes

    copy_rate = copy_bandwidth()
    emit({"kind": "copy", "bytes_per_s": copy_rate})
    p = HEADLINE
    q, k, v = random_qkv(p, seed=7)
    out = torch.empty_like(v)
    calls = {}
    for config in CONFIGS:
        for name, skip in VARIANTS.items():
            kern = compile_variant(p, config, skip, cuda_arch())
            if name == "full":
                row = check(ScalarDecayKernel(p, config, (kern,)), seed=8)
                emit({"kind": "check", "config": config.label} | row)
            calls[config, name] = partial(kern, q, k, v, out)
    for (config, name), ms in alternating(calls).items():
        median = sorted(ms)[1]
        emit(
            {"kind": "time", "shape": "8x16x4096", "config": config.label, "variant": name}
            | {"median_ms": median, "all_ms": ms}
            | {"x_floor": median * 1e-3 * copy_rate / traffic_bytes(p)}
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
