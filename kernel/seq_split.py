"""The sequence-split variant (``KernelConfig.segments > 1``): the sequence is cut into
``P`` segments of ``L`` tokens (whole chunks) that run in parallel blocks, joined by a
carry of their end states. Three kernels, all on the grid's ``(DV / bDV, B*H)`` axes:

1. ``states``: one block per segment but the last (grid ``P - 1``). It computes the end
   state its segment reaches from a zero state (fp32), into ``States[:, p + 1]``, and the
   first segment's block writes ``States[:, 0] = 0``. It walks the chunks last to first,
   so the chunks it reads last, which are still in L2 when the outputs kernel starts, are
   the ones that kernel reads first.
2. ``carry``: an in-place prefix over segments, ``States[p] = alpha^L * States[p-1] +
   States[p]`` for ``p >= 2``; afterwards ``States[p]`` is the state entering segment
   ``p``. One thread per state element loads it for all segments at once and runs the
   prefix in registers. It touches only the states (``B*H*P*DK*DV*4`` bytes). With two
   segments it is the identity and is not launched (``launches_carry``): on the H200 that
   call is 3.5% faster at B=4, H=16, S=8192 (reports/h200/README.md).
3. ``outputs``: one block per segment. It loads its incoming state and runs the
   single-pass kernel's chunk loop (``kernel.scalar_decay.chunk_loop_macro``) over the
   segment.

Every decay weight stays ``<= 1`` (``alpha^L`` included, flushed to 0 below fp32's range).
K and V of all segments but the last are read twice, so the HBM traffic is
``1 + (P - 1) / (2P)`` times the single-pass kernel's: the variant pays where ``B*H`` is too
small to fill the GPU (reports/h200/README.md).

Where it fills most SMs, the states kernel runs at its memory schedule's floor: on the
H200 it takes as long as a kernel with its grid and loads and no arithmetic (62.3 against
62.0 us at B=2, H=16, S=16384 with 4 segments, 44.4 against 43.2 us at 1x8x32768 with
16; with 64 blocks, at 4x16x8192 with 2 segments, 54.4 against 43.5 us). Measured and
not kept: re-cutting it into one piece per SM (3.5% faster at 4x16x8192 with 2 segments,
5.4% slower at 1x8x32768), and the first segment's outputs run beside it on a second
stream (1.6% to 9.1% slower at every config timed).
"""

import math

import tilelang.language as T

from kernel.config import KernelConfig, Problem
from kernel.scalar_decay import chunk_loop_macro, fp32_constant

CARRY_ROWS = 16  # state rows one carry block owns ("rows" carry)
CARRY_THREADS = 128  # state elements one carry block owns, one per thread ("scan" carry)

# Module-level for a same-run comparison on the GPU (reports/h200/split_parts.py).
# STATES_ORDER: "forward" walks each segment's chunks first to last, rescaling the fp32
# state by alpha^C per chunk; "reverse" walks them last to first with absolute weights
# alpha^(distance to the segment's end) on K, so the chunks read last, which stay in L2,
# are the ones the outputs kernel reads first.
# CARRY: "rows" gives each block 16 state rows and walks the segments, a load per step;
# "scan" gives each thread one state element, loads it for every segment at once, then
# runs the prefix in registers: one memory round trip instead of P.
# Measured on the H200 (reports/h200/README.md): "reverse" with "scan" is 2.5% faster at
# 1x8x32768 and 1.5% at 2x16x16384 than "forward" with "rows".
STATES_ORDER = "reverse"
CARRY = "scan"
# STATES_STAGES: the states kernel's pipeline depth; None takes the config's num_stages.
# Measured on the H200: 4 or 6 stages are no faster than the config's 2 or 3.
STATES_STAGES: int | None = None


def launches_carry(problem: Problem, config: KernelConfig) -> bool:
    """Whether the split's call runs its carry kernel: not with two segments, where
    ``States[1]`` is already the state entering segment 1."""
    return config.segment_count(problem.seqlen) > 2


def prim_funcs(problem: Problem, config: KernelConfig):
    """Return the ``@T.prim_func`` triple ``(states(K, V, States), carry(States),
    outputs(Q, K, V, States, O))`` for a split config; States is ``[B*H, P, DK, DV]`` fp32."""
    config.check_fits(problem)
    batch, heads, seqlen, dk, dv = problem.batch, problem.heads, problem.seqlen, problem.dk, problem.dv
    alpha, dtype = problem.alpha, problem.dtype
    C, block_dv, num_stages, accum = config.chunk, config.block_dv, config.num_stages, "float32"
    L, P = config.segment_length(seqlen), config.segment_count(seqlen)
    chunks_per_segment = L // C
    log2_alpha = math.log2(alpha)
    reverse = STATES_ORDER == "reverse"
    states_stages = STATES_STAGES or num_stages
    alpha_pow_c, alpha_pow_l = fp32_constant(alpha**C), fp32_constant(alpha**L)
    chunk_loop = chunk_loop_macro(
        chunk=C,
        dk=dk,
        block_dv=block_dv,
        alpha=alpha,
        num_stages=num_stages,
        threads=config.threads,
        scores=config.scores,
        dtype=dtype,
    )

    @T.prim_func
    def states(
        K: T.Tensor([batch, seqlen, heads, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype),
        States: T.Tensor([batch * heads, P, dk, dv], accum),
    ):
        with T.Kernel(T.ceildiv(dv, block_dv), batch * heads, P - 1, threads=config.threads) as (bv, bbh, bp):
            bb = bbh // heads
            bh = bbh % heads
            v0 = bv * block_dv
            K_s = T.alloc_shared([C, dk], dtype)
            Kw_s = T.alloc_shared([C, dk], dtype)
            V_s = T.alloc_shared([C, block_dv], dtype)
            S_f = T.alloc_fragment([dk, block_dv], accum)
            T.clear(S_f)
            for c in T.Pipelined(chunks_per_segment, num_stages=states_stages):
                # reverse: chunk c from the end; its token r lies C*c + C-1-r tokens before
                # the segment's end. forward: the state is rescaled by alpha^C per chunk.
                s0 = bp * L + ((chunks_per_segment - 1 - c) if reverse else c) * C
                T.copy(K[bb, s0 : s0 + C, bh, :], K_s)
                T.copy(V[bb, s0 : s0 + C, bh, v0 : v0 + block_dv], V_s)
                for r, d in T.Parallel(C, dk):
                    distance = (C * c + C - 1 - r) if reverse else (C - 1 - r)
                    Kw_s[r, d] = K_s[r, d] * T.exp2(log2_alpha * T.Cast(accum, distance))
                if not reverse:
                    for i, j in T.Parallel(dk, block_dv):
                        S_f[i, j] *= alpha_pow_c
                T.gemm(Kw_s, V_s, S_f, transpose_A=True)  # [DK, C] @ [C, bDV] -> [DK, bDV]
            T.copy(S_f, States[bbh, bp + 1, :, v0 : v0 + block_dv])
            if bp == 0:  # the state entering segment 0
                T.clear(S_f)
                T.copy(S_f, States[bbh, 0, :, v0 : v0 + block_dv])

    @T.prim_func
    def carry(States: T.Tensor([batch * heads, P, dk, dv], accum)):
        with T.Kernel(T.ceildiv(dk, CARRY_ROWS), batch * heads, threads=128) as (br, bbh):
            r0 = br * CARRY_ROWS
            S_f = T.alloc_fragment([CARRY_ROWS, dv], accum)
            T.clear(S_f)
            for p in T.serial(1, P):
                for i, j in T.Parallel(CARRY_ROWS, dv):
                    S_f[i, j] = S_f[i, j] * alpha_pow_l + States[bbh, p, r0 + i, j]
                T.copy(S_f, States[bbh, p, r0 : r0 + CARRY_ROWS, :])

    @T.prim_func
    def carry_scan(States: T.Tensor([batch * heads, P, dk, dv], accum)):
        with T.Kernel(T.ceildiv(dk * dv, CARRY_THREADS), batch * heads, threads=CARRY_THREADS) as (be, bbh):
            e = be * CARRY_THREADS + T.get_thread_binding()
            S_l = T.alloc_local([P], accum)
            if e < dk * dv:
                i, j = e // dv, e % dv
                for p in T.unroll(1, P):
                    S_l[p] = States[bbh, p, i, j]
                S_l[0] = 0
                for p in T.unroll(1, P):
                    S_l[p] = S_l[p - 1] * alpha_pow_l + S_l[p]
                    States[bbh, p, i, j] = S_l[p]

    @T.prim_func
    def outputs(
        Q: T.Tensor([batch, seqlen, heads, dk], dtype),
        K: T.Tensor([batch, seqlen, heads, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype),
        States: T.Tensor([batch * heads, P, dk, dv], accum),
        O: T.Tensor([batch, seqlen, heads, dv], dtype),
    ):
        with T.Kernel(T.ceildiv(dv, block_dv), batch * heads, P, threads=config.threads) as (bv, bbh, bp):
            bb = bbh // heads
            bh = bbh % heads
            v0 = bv * block_dv
            # Each segment starts from the state entering it.
            chunk_loop(Q, K, V, O, bb, bh, v0, bp * L, chunks_per_segment, States, bbh, bp)

    return states, carry_scan if CARRY == "scan" else carry, outputs
