"""The sequence-split variant (``KernelConfig.segments > 1``): the sequence is cut into
``P`` segments of ``L`` tokens (whole chunks) that run in parallel blocks, joined by a
carry of their end states. Three kernels, all on the grid's ``(DV / bDV, B*H)`` axes:

1. ``states``: one block per segment but the last (grid ``P - 1``). It computes the end
   state its segment reaches from a zero state (fp32), into ``States[:, p + 1]``, and the
   first segment's block writes the state entering segment 0 (the initial state, or
   zero) into ``States[:, 0]``. It walks the chunks last to first, so the chunks it reads
   last, which are still in L2 when the outputs kernel starts, are the ones that kernel
   reads first.
2. ``carry``: an in-place prefix over segments, ``States[p] = alpha^L * States[p-1] +
   States[p]``; afterwards ``States[p]`` is the state entering segment ``p``. One thread
   per state element loads it for all segments at once and runs the prefix in registers.
   It touches only the states (``B*H*P*DK*DV*4`` bytes). With two segments and no initial
   state it is the identity and is not launched (``kernel.variants.launches_carry``).
3. ``outputs``: one block per segment. It loads its incoming state and runs the
   single-pass kernel's chunk loop (``kernel.scalar_decay.chunk_loop_macro``) over the
   segment; the last segment's blocks write the final state.

Every decay weight stays ``<= 1`` and is computed at run time from the head's alpha
(``alpha^L`` too: ``exp2`` of a large negative number is 0, never inf). K and V of all
segments but the last are read twice, so the HBM traffic is ``1 + (P - 1) / (2P)`` times
the single-pass kernel's: the variant pays where ``B*H`` is too small to fill the GPU. Its
measurements, and the designs measured and not kept, are in experiments/h200/README.md.
"""

import tilelang.language as T

from kernel.config import KernelConfig, Problem
from kernel.scalar_decay import chunk_loop_macro

CARRY_THREADS = 128  # state elements one carry block owns, one per thread


def prim_funcs(
    problem: Problem,
    config: KernelConfig,
    *,
    scale: float = 1.0,
    initial_state: bool = False,
    final_state: bool = False,
    arch: str,
):
    """Return the ``@T.prim_func`` triple ``(states(K, V, Decay, H0, States),
    carry(Decay, States), outputs(Q, K, V, Decay, States, O, HT))`` for a split config;
    States is ``[B*H, P, DK, DV]`` fp32, Decay, H0 and HT as in
    ``kernel.scalar_decay.scalar_decay_fwd``; ``arch`` as there."""
    config.check_fits(problem)
    batch, heads, seqlen, dk, dv = problem.batch, problem.heads, problem.seqlen, problem.dk, problem.dv
    dtype = problem.dtype
    C, block_dv, num_stages, accum = config.chunk, config.block_dv, config.num_stages, "float32"
    L, P = config.segment_length(seqlen), config.segment_count(seqlen)
    chunks_per_segment = L // C
    state_shape = [batch * heads, 1, dk, dv]
    chunk_loop = chunk_loop_macro(
        chunk=C,
        dk=dk,
        block_dv=block_dv,
        scale=scale,
        num_stages=num_stages,
        threads=config.threads,
        scores=config.scores,
        dtype=dtype,
        arch=arch,
    )

    @T.prim_func
    def states(
        K: T.Tensor([batch, seqlen, heads, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype),
        Decay: T.Tensor([heads], accum),
        H0: T.Tensor(state_shape, accum),
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
            lg = T.alloc_local([1], accum)  # log2(alpha) of this head, <= 0
            lg[0] = T.log2(Decay[bh])
            T.clear(S_f)
            for c in T.Pipelined(chunks_per_segment, num_stages=num_stages):
                # chunk c from the end: its token r lies C*c + C-1-r tokens before the
                # segment's end, and is weighted by alpha to that distance.
                s0 = bp * L + (chunks_per_segment - 1 - c) * C
                T.copy(K[bb, s0 : s0 + C, bh, :], K_s)
                T.copy(V[bb, s0 : s0 + C, bh, v0 : v0 + block_dv], V_s)
                for r, d in T.Parallel(C, dk):
                    Kw_s[r, d] = K_s[r, d] * T.exp2(lg[0] * T.Cast(accum, C * c + C - 1 - r))
                T.gemm(Kw_s, V_s, S_f, transpose_A=True)  # [DK, C] @ [C, bDV] -> [DK, bDV]
            T.copy(S_f, States[bbh, bp + 1, :, v0 : v0 + block_dv])
            if bp == 0:  # the state entering segment 0
                if initial_state:
                    T.copy(H0[bbh, 0, :, v0 : v0 + block_dv], S_f)
                else:
                    T.clear(S_f)
                T.copy(S_f, States[bbh, 0, :, v0 : v0 + block_dv])

    @T.prim_func
    def carry(Decay: T.Tensor([heads], accum), States: T.Tensor([batch * heads, P, dk, dv], accum)):
        with T.Kernel(T.ceildiv(dk * dv, CARRY_THREADS), batch * heads, threads=CARRY_THREADS) as (be, bbh):
            e = be * CARRY_THREADS + T.get_thread_binding()
            S_l = T.alloc_local([P], accum)
            decay_l = T.alloc_local([1], accum)  # alpha^L of this head; 0 where it underflows
            decay_l[0] = T.exp2(T.log2(Decay[bbh % heads]) * T.Cast(accum, L))
            if e < dk * dv:
                i, j = e // dv, e % dv
                for p in T.unroll(0 if initial_state else 1, P):
                    S_l[p] = States[bbh, p, i, j]
                if not initial_state:
                    S_l[0] = 0
                for p in T.unroll(1, P):
                    S_l[p] = S_l[p - 1] * decay_l[0] + S_l[p]
                    States[bbh, p, i, j] = S_l[p]

    @T.prim_func
    def outputs(
        Q: T.Tensor([batch, seqlen, heads, dk], dtype),
        K: T.Tensor([batch, seqlen, heads, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype),
        Decay: T.Tensor([heads], accum),
        States: T.Tensor([batch * heads, P, dk, dv], accum),
        O: T.Tensor([batch, seqlen, heads, dv], dtype),
        HT: T.Tensor(state_shape, accum),
    ):
        with T.Kernel(T.ceildiv(dv, block_dv), batch * heads, P, threads=config.threads) as (bv, bbh, bp):
            bb = bbh // heads
            bh = bbh % heads
            v0 = bv * block_dv
            # Each segment starts from the state entering it; the last one leaves the final state.
            end = T.min(bp * L + L, seqlen)
            final = HT if final_state else None
            chunk_loop(
                Q,
                K,
                V,
                O,
                Decay,
                bb,
                bh,
                v0,
                bp * L,
                chunks_per_segment,
                end,
                States,
                final,
                bbh,
                bp,
                bp == P - 1,
            )

    return states, carry, outputs
