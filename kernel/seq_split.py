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
measurements, and the designs measured and not kept, are in experiments/notebook/README.md.
"""

import tilelang.language as T

from kernel.config import KernelConfig, Problem, whole_chunks
from kernel.scalar_decay import ACCUM, alpha_power, chunk_loop_macro, loop_knobs, sizes

CARRY_THREADS = 128  # state elements one carry block owns, one per thread


def prim_funcs(
    problem: Problem,
    config: KernelConfig,
    *,
    scale: float = 1.0,
    initial_state: bool = False,
    final_state: bool = False,
    reverse: bool = False,
    arch: str,
):
    """Return the ``@T.prim_func`` triple ``(states(K, V, Decay, H0, States),
    carry(K, Decay, States), outputs(Q, K, V, Decay, States, O, HT))`` for a split config
    and ``problem``'s heads, DK, DV and dtype, for every batch size and sequence length
    where ``arch`` allows (``kernel.scalar_decay.sizes``): ``S`` is cut into ``P``
    segments of ``L`` tokens (``segment_grid``; ``P`` is at most ``config.segments``, and at
    least 2: ``KernelConfig.check_fits``). States is fp32 ``[B*H, config.segments, DK,
    DV]``, of which each (batch, head) uses the first ``P`` rows; the carry reads only K's
    shape; Decay, H0 and HT as in ``kernel.scalar_decay.scalar_decay_fwd``; ``arch`` as
    there.

    With ``reverse`` (the recurrence backwards in time, ``kernel.scalar_decay.Direction``)
    everything mirrors: ``States[p]`` is the state entering segment ``p`` from its end; the
    states kernel computes segments 1 to P-1 (weights ``alpha^(t - start)``, into
    ``States[p - 1]``, the last segment's block writing the initial state into
    ``States[P - 1]``); the carry runs from the last segment down, across the ragged last
    segment with ``alpha`` to its length; the first segment's outputs leave the final state."""
    heads, dk, dv, dtype = problem.heads, problem.dk, problem.dv, problem.dtype
    C, block_dv, num_stages, accum = config.chunk, config.block_dv, config.num_stages, ACCUM
    slots = config.segments  # States' rows per (batch, head): the most segments there are
    batch, seqlen = sizes(problem, arch)
    L, P = segment_grid(seqlen, chunk=C, segments=slots)
    chunks_per_segment = L // C
    state_shape = [batch * heads, 1, dk, dv]
    states_shape = [batch * heads, slots, dk, dv]
    aligned = whole_chunks(problem, C)
    loop = loop_knobs(config) | dict(scale=scale, arch=arch, reverse=reverse, aligned=aligned)
    chunk_loop = chunk_loop_macro(dk=dk, dtype=dtype, **loop)
    last_length = seqlen - (P - 1) * L  # tokens of the last segment, 1 to L
    # The states kernel's block bp computes segment bp into States[bp + 1] (forward), or
    # segment bp + 1 into States[bp] (reversed); ``entry``: the first segment walked.
    entry = P - 1 if reverse else 0
    entry_of_final = 0 if reverse else P - 1  # the segment that leaves the final state

    def segment_of(bp):
        return bp + 1 if reverse else bp

    def slot_of(bp):
        return bp if reverse else bp + 1

    def chunk_start(bp, c):
        """Forward, chunk c from the segment's end; reversed, chunk c from its start."""
        return segment_of(bp) * L + (c if reverse else chunks_per_segment - 1 - c) * C

    def key_weight(weighted, token):
        """Reversed, the last segment reaches past S: its keys there weigh 0 (TMA reads them
        as 0 too; the forward never reads past S here)."""
        return T.if_then_else(token < seqlen, weighted, T.Cast(dtype, 0)) if reverse else weighted

    def distance(c, r):
        """Forward, token r of chunk c lies C*c + C-1-r tokens before the segment's end;
        reversed, C*c + r tokens after its start. Its key is weighted by alpha to that
        distance."""
        return C * c + r if reverse else C * c + C - 1 - r

    @T.prim_func
    def states(
        K: T.Tensor([batch, seqlen, heads, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype),
        Decay: T.Tensor([heads], accum),
        H0: T.Tensor(state_shape, accum),
        States: T.Tensor(states_shape, accum),
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
                s0 = chunk_start(bp, c)
                T.copy(K[bb, s0 : s0 + C, bh, :], K_s)
                T.copy(V[bb, s0 : s0 + C, bh, v0 : v0 + block_dv], V_s)
                for r, d in T.Parallel(C, dk):
                    Kw_s[r, d] = key_weight(K_s[r, d] * alpha_power(lg[0], distance(c, r)), s0 + r)
                T.gemm(Kw_s, V_s, S_f, transpose_A=True)  # [DK, C] @ [C, bDV] -> [DK, bDV]
            T.copy(S_f, States[bbh, slot_of(bp), :, v0 : v0 + block_dv])
            if segment_of(bp) == entry:  # the state entering the first segment walked
                if initial_state:
                    T.copy(H0[bbh, 0, :, v0 : v0 + block_dv], S_f)
                else:
                    T.clear(S_f)
                T.copy(S_f, States[bbh, entry, :, v0 : v0 + block_dv])

    @T.prim_func
    def carry(
        K: T.Tensor([batch, seqlen, heads, dk], dtype),  # only its shape is read: B and S
        Decay: T.Tensor([heads], accum),
        States: T.Tensor(states_shape, accum),
    ):
        with T.Kernel(T.ceildiv(dk * dv, CARRY_THREADS), batch * heads, threads=CARRY_THREADS) as (be, bbh):
            e = be * CARRY_THREADS + T.get_thread_binding()
            S_l = T.alloc_local([slots], accum)
            # alpha^L, and reversed alpha^(last segment's length); 0 where they underflow
            decay_l = T.alloc_local([2 if reverse else 1], accum)
            decay_l[0] = alpha_power(T.log2(Decay[bbh % heads]), L)
            if reverse:
                decay_l[1] = alpha_power(T.log2(Decay[bbh % heads]), last_length)
            if e < dk * dv:
                i, j = e // dv, e % dv
                # The first P of the slots hold segments (the states kernel wrote each).
                for p in T.unroll(0, slots):
                    if p < P:
                        S_l[p] = States[bbh, p, i, j]
                if reverse:  # from the last segment down: States[p] += alpha^len(p+1) States[p+1]
                    for q in T.unroll(0, slots - 1):
                        p = slots - 2 - q
                        if p < P - 1:
                            across = T.if_then_else(p == P - 2, decay_l[1], decay_l[0])  # the ragged last
                            S_l[p] = S_l[p + 1] * across + S_l[p]
                            States[bbh, p, i, j] = S_l[p]
                else:
                    for p in T.unroll(1, slots):
                        if p < P:
                            S_l[p] = S_l[p - 1] * decay_l[0] + S_l[p]
                            States[bbh, p, i, j] = S_l[p]

    @T.prim_func
    def outputs(
        Q: T.Tensor([batch, seqlen, heads, dk], dtype),
        K: T.Tensor([batch, seqlen, heads, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype),
        Decay: T.Tensor([heads], accum),
        States: T.Tensor(states_shape, accum),
        O: T.Tensor([batch, seqlen, heads, dv], dtype),
        HT: T.Tensor(state_shape, accum),
    ):
        with T.Kernel(T.ceildiv(dv, block_dv), batch * heads, P, threads=config.threads) as (bv, bbh, bp):
            bb = bbh // heads
            bh = bbh % heads
            v0 = bv * block_dv
            # Each segment starts from the state entering it; the last one walked leaves the
            # final state.
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
                T.min(chunks_per_segment, T.ceildiv(seqlen, C) - bp * chunks_per_segment)
                if aligned
                else chunks_per_segment,
                end,
                States,
                final,
                bbh,
                bp,
                bp == entry_of_final,
            )

    return states, carry, outputs


def segment_grid(seqlen, *, chunk: int, segments: int) -> tuple:
    """``(L, P)``, symbolic, of ``seqlen`` tokens cut into at most ``segments`` segments of
    whole chunks, as ``kernel.config.segment_length`` and ``KernelConfig.segment_count``
    cut them: ``P`` segments of ``L`` tokens, the last ragged."""
    length = T.ceildiv(T.ceildiv(seqlen, segments), chunk) * chunk
    return length, T.ceildiv(seqlen, length)
