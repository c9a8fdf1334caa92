"""The backward's dk and dv in one reversed pass.

The dk and dv passes of ``kernel.ops.backward`` each run the forward backwards in time, and
their states are each other's transpose: one reversed pass carries ``dS`` (``[DK, DV]``,
fp32) and writes both gradients. Per chunk of ``m`` tokens, with the reversed weights of
``kernel.scalar_decay.Direction`` (``Gamma[i, j] = scale alpha^(j-i)`` for ``i <= j < m``)::

    dV = (K Q^T * Gamma) dO + diag(scale alpha^(m-i)) K dS
    dK = (V dO^T * Gamma) Q + diag(scale alpha^(m-i)) V dS^T
    dS = alpha^m dS + (diag(alpha^r) Q)^T dO          (rows r < m)

Seven MMAs per chunk where a pass has four; it reads Q, K, V and dO once and writes dK
and dV, 6 tensors where the two passes move 8. One block per (batch, head), or (sequence,
head) for packed sequences, holds the whole ``[DK, DV]`` state, so it serves a problem
only where that fits: ``kernel.rule.dkdv_config``. It is faster than the two passes
(docs/evidence.md#fused-pass).

Where one block per (batch, head) leaves SMs idle, the pass is split along the sequence
as ``kernel.seq_split`` splits the forward (``KernelConfig.segments > 1``, dense batches):
the dv pass's reversed ``states`` and ``carry`` kernels on (K, V) := (Q, dO) give dS
entering each segment from its end, then one block per (batch, head, segment) runs the
pass over its segment from that state, and segment 0's blocks leave dS at the first
token. It reads Q and dO twice: 8 tensor moves where the two split passes make 12, and
it is faster than they are (docs/evidence.md#fused-pass).

The numerical rules of the forward hold, through its decay mask, weights and scores
(``kernel.scalar_decay``): every weight is ``exp2(log2(alpha) * k)`` with ``k >= 0``,
``Gamma`` is evaluated only where ``j >= i``, fp32 accumulation, and key columns past ``m``
(TMA's zero rows, or the next sequence's) are masked out of the scores.
"""

from kernel.config import KernelConfig, Problem, whole_chunks

CHUNK, THREADS = 64, 256
MAX_STATE = 128 * 128  # DK * DV: the fp32 state in 256 threads' registers, 64 each


def smem_bytes(problem: Problem, config: KernelConfig) -> int:
    """The shared memory the kernel declares: per stage Q, K (``[C, DK]``), V and dO
    (``[C, DV]``); once the weighted queries and dK's tile (``[C, DK]``), dV's tile
    (``[C, DV]``), the state's copy (``[DK, DV]``) and the two score tiles (``[C, C]``),
    all 2-byte, plus at most 1,024 B of static shared memory (TileLang's barriers where it
    warp-specialises). What the compiled kernels declare (tests/test_dkdv.py)."""
    c, dk, dv = config.chunk, problem.dk, problem.dv
    staged = config.num_stages * c * (2 * dk + 2 * dv)
    return 2 * (staged + c * (2 * dk + dv) + dk * dv + 2 * c * c) + 1024


def sweep_macro(problem: Problem, config: KernelConfig, *, scale: float, packed: bool, arch: str):
    """The reversed pass of one block over ``problem``'s DK and DV in ``config``'s chunks
    and stages, as a ``@T.macro`` ``sweep(Q, K, V, dO, Decay, dK, dV, bb, bh, s_begin,
    s_end, State, Final, bbh, p_in, final)``: tokens ``s_begin`` to
    ``s_end`` of batch ``bb``, head ``bh``, walked chunk by chunk from the last. dS starts
    from ``State[bbh, p_in]`` (``None``: zero) and is left in ``Final[bbh, 0]`` where
    ``Final`` is a tensor and the run-time condition ``final`` holds, as
    ``kernel.scalar_decay.chunk_loop_macro`` takes its states. ``packed``: rows past
    ``s_end`` belong to the next sequence, and only the sequence's rows are written. A dense
    sequence of whole chunks has every chunk whole
    (``kernel.config.whole_chunks``)."""
    import tilelang.language as T  # loaded when a kernel is built, as kernel.variants does

    from kernel.mma import mma_for
    from kernel.scalar_decay import (
        ACCUM,
        Direction,
        alpha_power,
        decay_mask_macro,
        key_weights_macro,
        store_macro,
    )

    C, stages, time = config.chunk, config.num_stages, Direction(reverse=True)
    aligned = not packed and whole_chunks(problem, C)
    accum, dtype, dk, dv = ACCUM, problem.dtype, problem.dk, problem.dv
    mma = mma_for(arch, rows=C)
    store_k = store_macro(chunk=C, block_dv=dk, packed=packed)
    store_v = store_macro(chunk=C, block_dv=dv, packed=packed)
    decay_mask = decay_mask_macro(chunk=C, scale=scale, time=time)  # scale alpha^(j-i), j >= i
    weigh = key_weights_macro(chunk=C, dk=dk, dtype=dtype, time=time)  # Q rows r < m, * alpha^r

    @T.macro
    def sweep(Q, K, V, dO, Decay, dK, dV, bb, bh, s_begin, s_end, State, Final, bbh, p_in, final):
        Q_s = T.alloc_shared([C, dk], dtype)
        K_s = T.alloc_shared([C, dk], dtype)
        Qw_s = T.alloc_shared([C, dk], dtype)  # Q rows r < m, * alpha^r: writes dS
        V_s = T.alloc_shared([C, dv], dtype)
        dO_s = T.alloc_shared([C, dv], dtype)
        dS_s = T.alloc_shared([dk, dv], dtype)
        P1_s = T.alloc_shared([C, C], dtype)
        P2_s = T.alloc_shared([C, C], dtype)
        dK_s = T.alloc_shared([C, dk], dtype)
        dV_s = T.alloc_shared([C, dv], dtype)
        dS_f = T.alloc_fragment([dk, dv], accum)  # carried across chunks
        acc_v = T.alloc_fragment([C, dv], accum)
        acc_k = T.alloc_fragment([C, dk], accum)
        A1 = T.alloc_fragment([C, C], accum)
        A2 = T.alloc_fragment([C, C], accum)
        Gamma = T.alloc_fragment([C, C], accum)
        touch = T.alloc_local([1], dtype)
        lg = T.alloc_local([1], accum)  # log2(alpha) of this head, <= 0
        decay_mask(Gamma, lg, Decay, bh)
        if State is None:
            T.clear(dS_f)
        else:
            T.copy(State[bbh, p_in, :, :], dS_f)
        n_chunks = T.ceildiv(s_end - s_begin, C)
        for c in T.Pipelined(n_chunks, num_stages=stages):
            s0 = s_begin + (n_chunks - 1 - c) * C
            m = C if aligned else T.min(C, s_end - s0)  # tokens of this chunk: C but for the last
            T.copy(Q[bb, s0 : s0 + C, bh, :], Q_s)
            T.copy(K[bb, s0 : s0 + C, bh, :], K_s)
            T.copy(V[bb, s0 : s0 + C, bh, :], V_s)
            T.copy(dO[bb, s0 : s0 + C, bh, :], dO_s)
            T.copy(dS_f, dS_s)  # the state after this chunk, as the MMAs read it
            mma.gemm(K_s, Q_s, A1, transpose_B=True, clear_accum=True)  # k_i . q_j
            mma.gemm(K_s, dS_s, acc_v, clear_accum=True)
            mma.gemm(V_s, dO_s, A2, transpose_B=True, clear_accum=True)  # v_i . do_j
            mma.gemm(V_s, dS_s, acc_k, transpose_B=True, clear_accum=True)
            mma.wait(3)  # A1 is ready
            for i, j in T.Parallel(C, C):
                P1_s[i, j] = time.scores(A1[i, j], Gamma[i, j], j, m)
            weigh(Qw_s, Q_s, lg, m)
            mma.wait(1)  # acc_v and A2 are ready
            for i, j in T.Parallel(C, C):
                P2_s[i, j] = time.scores(A2[i, j], Gamma[i, j], j, m)
            for i, j in T.Parallel(C, dv):
                acc_v[i, j] *= scale * alpha_power(lg[0], time.query_power(i, m))
            mma.wait(0)  # acc_k is ready
            for i, j in T.Parallel(C, dk):
                acc_k[i, j] *= scale * alpha_power(lg[0], time.query_power(i, m))
            mma.gemm(P1_s, dO_s, acc_v)
            mma.gemm(P2_s, Q_s, acc_k)
            for i, j in T.Parallel(dk, dv):
                dS_f[i, j] *= alpha_power(lg[0], m)
            mma.gemm(Qw_s, dO_s, dS_f, transpose_A=True)
            mma.wait(1)  # dV and dK are ready; the state's update may still run
            T.copy(acc_v, dV_s)
            store_v(dV_s, dV, bb, s0, m, bh, 0)
            T.copy(acc_k, dK_s)
            store_k(dK_s, dK, bb, s0, m, bh, 0)
            mma.wait(0)
            # The pipeliner hands a stage's buffer back after the last statement that
            # names it, while an issued wgmma may still read it (kernel.scalar_decay).
            touch[0] = Q_s[0, 0]
            touch[0] = K_s[0, 0]
            touch[0] = V_s[0, 0]
            touch[0] = dO_s[0, 0]
        if Final is not None and final:
            T.copy(dS_f, Final[bbh, 0, :, :])

    return sweep


def prim_funcs(
    problem: Problem,
    config: KernelConfig,
    *,
    arch: str,
    scale: float,
    initial_state: bool,
    final_state: bool,
    packed: bool,
) -> list:
    """The ``@T.prim_func`` kernels, in launch order: one pass, ``[main(Q, K, V, dO, Decay,
    H0, HT, dK, dV)]`` (``CuSeqlens`` last where ``packed``); split (``config.segments >
    1``), ``[states(Q, dO, Decay, H0, States), carry(Q, Decay, States), outputs(Q, K, V,
    dO, Decay, States, HT, dK, dV)]`` with ``States`` fp32 ``[B*H, config.segments, DK,
    DV]``, the dv pass's reversed kernels of ``kernel.seq_split``.

    Q, K, dK: ``[B, S, H, DK]``; V, dO, dV: ``[B, S, H, DV]``, for every B and S where
    ``arch`` allows (``kernel.scalar_decay.sizes``); packed, ``B = 1`` and ``S`` the
    symbolic token count T, with the int32 offsets ``[N + 1]``. Decay: fp32 ``[H]``.
    H0: fp32 ``[B*H or N*H, 1, DK, DV]``, the state dS starts from after each sequence's
    last token, read only with ``initial_state`` (else zero); HT receives dS at its first
    token, written only with ``final_state``. ``kernel.ops.backward`` says what they hold.
    """
    import tilelang.language as T

    from kernel import seq_split
    from kernel.scalar_decay import ACCUM, sizes, tensor_types

    if config.block_dv != problem.dv or config.scores != "smem" or (packed and config.segments != 1):
        raise ValueError(
            f"the fused sweep holds the whole DV in one block, in one pass for packed sequences: "
            f"got {config.label}"
        )
    accum, dk, dv, heads = ACCUM, problem.dk, problem.dv, problem.heads
    shape = dict(heads=heads, dk=dk, dv=dv, dtype=problem.dtype)
    sweep = sweep_macro(problem, config, scale=scale, packed=packed, arch=arch)

    if packed:
        tokens, offsets, h0_rows, ht_rows = (
            T.dynamic(n) for n in ("tokens", "offsets", "h0_rows", "ht_rows")
        )
        qk, vo, decay = tensor_types(1, tokens, **shape)

        @T.prim_func
        def main_packed(
            Q: qk(), K: qk(), V: vo(), dO: vo(), Decay: decay(),
            H0: T.Tensor([h0_rows, 1, dk, dv], accum), HT: T.Tensor([ht_rows, 1, dk, dv], accum),
            dK: qk(), dV: vo(), CuSeqlens: T.Tensor([offsets], "int32"),
        ):  # fmt: skip
            with T.Kernel((offsets - 1) * heads, threads=config.threads) as bnh:
                n, bh = bnh // heads, bnh % heads
                sweep(
                    Q, K, V, dO, Decay, dK, dV, 0, bh, CuSeqlens[n], CuSeqlens[n + 1],
                    H0 if initial_state else None, HT if final_state else None, bnh, 0, True,
                )  # fmt: skip

        return [main_packed]

    b, s = sizes(problem, arch)
    qk, vo, decay = tensor_types(b, s, **shape)

    def state(rows: int = 1):
        return T.Tensor([b * heads, rows, dk, dv], accum)

    if config.segments == 1:

        @T.prim_func
        def main(
            Q: qk(), K: qk(), V: vo(), dO: vo(), Decay: decay(), H0: state(), HT: state(), dK: qk(), dV: vo()
        ):
            with T.Kernel(b * heads, threads=config.threads) as bbh:
                bb, bh = bbh // heads, bbh % heads
                sweep(
                    Q, K, V, dO, Decay, dK, dV, bb, bh, 0, s,
                    H0 if initial_state else None, HT if final_state else None, bbh, 0, True,
                )  # fmt: skip

        return [main]

    states, carry, _ = seq_split.prim_funcs(
        problem, config, initial_state=initial_state, reverse=True, arch=arch
    )
    L, P = seq_split.segment_grid(s, chunk=config.chunk, segments=config.segments)

    @T.prim_func
    def outputs(
        Q: qk(), K: qk(), V: vo(), dO: vo(), Decay: decay(), States: state(config.segments), HT: state(),
        dK: qk(), dV: vo(),
    ):  # fmt: skip
        with T.Kernel(b * heads, P, threads=config.threads) as (bbh, bp):
            bb, bh = bbh // heads, bbh % heads
            sweep(
                Q, K, V, dO, Decay, dK, dV, bb, bh, bp * L, T.min(bp * L + L, s),
                States, HT if final_state else None, bbh, bp, bp == 0,
            )  # fmt: skip

    return [states, carry, outputs]
