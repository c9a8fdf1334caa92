"""Experiment (not part of the tool): the split's states kernel with K's weighted rows kept
in registers as the MMA's A operand (a register-sourced wgmma) instead of written to a
shared buffer ``Kw_s`` that the MMA reads, which costs a shared-memory round trip, a
barrier and a proxy fence per chunk.

    source .gpu/setup.sh && python3 reports/h200/states_rs.py > $OUT/states_rs.jsonl
    python3 reports/h200/states_rs.py cpu      # compile both for sm_90a, print resources

On the GPU: the whole split call with either states kernel is checked against reference C
(NaN-prefilled output); then each states kernel is timed alone (L2 flushed before each
repetition), and the whole calls taking turns over three rounds.
"""

import json
import math
import sys
from functools import partial

import tilelang.language as T
from modes import B1H8, B2H16

from kernel import KernelConfig, Problem
from kernel.resources import _compile, compile_kernel

TIMED = [
    (B2H16, KernelConfig(64, 128, 2, 256, segments=4)),
    (B1H8, KernelConfig(64, 128, 3, 256, segments=16)),
    (B1H8, KernelConfig(64, 128, 2, 256, segments=16)),
]
CHECKED = [
    (Problem(1, 2, 1000, 128, 128, 0.5, "bfloat16"), KernelConfig(64, 64, 1, 256, segments=4)),
    (Problem(2, 2, 777, 64, 128, 0.8, "bfloat16"), KernelConfig(64, 64, 2, 128, segments=8)),
    (Problem(2, 1, 65, 128, 128, 0.9), KernelConfig(64, 128, 2, 256, segments=2)),
]


def states_rs(problem: Problem, config: KernelConfig):
    """The reverse-walk states kernel of ``kernel.seq_split`` with ``Kw`` in registers."""
    batch, heads, seqlen, dk, dv = problem.batch, problem.heads, problem.seqlen, problem.dk, problem.dv
    dtype, accum, C, block_dv = problem.dtype, "float32", config.chunk, config.block_dv
    L, P = config.segment_length(seqlen), config.segment_count(seqlen)
    n_chunks, log2_alpha = L // C, math.log2(problem.alpha)

    @T.prim_func
    def states(
        K: T.Tensor([batch, seqlen, heads, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype),
        States: T.Tensor([batch * heads, P, dk, dv], accum),
    ):
        with T.Kernel(T.ceildiv(dv, block_dv), batch * heads, P - 1, threads=config.threads) as (bv, bbh, bp):
            bb, bh, v0 = bbh // heads, bbh % heads, bv * block_dv
            K_s = T.alloc_shared([C, dk], dtype)
            V_s = T.alloc_shared([C, block_dv], dtype)
            Kw_f = T.alloc_fragment([dk, C], dtype)
            S_f = T.alloc_fragment([dk, block_dv], accum)
            T.clear(S_f)
            for c in T.Pipelined(n_chunks, num_stages=config.num_stages):
                s0 = bp * L + (n_chunks - 1 - c) * C
                T.copy(K[bb, s0 : s0 + C, bh, :], K_s)
                T.copy(V[bb, s0 : s0 + C, bh, v0 : v0 + block_dv], V_s)
                for i, r in T.Parallel(dk, C):
                    Kw_f[i, r] = K_s[r, i] * T.exp2(log2_alpha * T.Cast(accum, C * c + C - 1 - r))
                T.gemm(Kw_f, V_s, S_f)  # [DK, C] @ [C, bDV] -> [DK, bDV], A from registers
            T.copy(S_f, States[bbh, bp + 1, :, v0 : v0 + block_dv])

    return states


def compile_both(problem: Problem, config: KernelConfig, arch: str) -> dict[str, tuple]:
    """``{"smem": the tool's three kernels, "regs": the same with the RS states kernel}``."""
    tool = compile_kernel(problem, config, arch)
    (rs,) = _compile([states_rs(problem, config)], arch)
    return {"smem": tool, "regs": (rs, *tool[1:])}


def cpu() -> int:
    from kernel.resources import _ptxas

    for problem, config in TIMED + CHECKED:
        for mode, kernels in compile_both(problem, config, "sm_90a").items():
            ok, log = _ptxas(kernels[0].get_kernel_source(), "sm_90a")
            print(json.dumps({"mode": mode, "config": config.label, "ptxas_ok": ok, "ptxas": log[-300:]}))
    return 0


def gpu() -> int:
    from modes import check_kept, emit, inputs_for, time_modes

    from kernel.build import ScalarDecayKernel, cuda_arch, states_buffer
    from kernel.timing import bench
    from tuner.bench import copy_bandwidth

    copy_rate = copy_bandwidth()
    emit({"kind": "copy", "bytes_per_s": copy_rate})
    kernels = {}
    for problem, config in TIMED + CHECKED:
        for mode, compiled in compile_both(problem, config, cuda_arch()).items():
            check_kept(kernels, mode, ScalarDecayKernel(problem, config, compiled), TIMED, seed=41)
    inputs = inputs_for(kernels, seed=42)
    for (mode, p, config), kern in kernels.items():
        _, k, v = inputs[p]
        states = states_buffer(p, config)
        emit(
            {
                "kind": "states",
                "mode": mode,
                "shape": f"{p.batch}x{p.heads}x{p.seqlen}",
                "config": config.label,
            }
            | {"median_ms": bench(partial(kern.compiled[0], k, v, states)).median_ms}
        )
    time_modes(kernels, inputs, kind="whole", copy_rate=copy_rate)
    return 0


if __name__ == "__main__":
    sys.exit(cpu() if sys.argv[1:] == ["cpu"] else gpu())
