"""The single-pass TileLang kernel of docs/design.md (section 4), corrected on the GPU.

One block owns one ``[DK, block_DV]`` slice of one (batch, head) state and walks the whole
sequence chunk by chunk in a ``T.Pipelined`` loop; the state stays in registers.

Departures from the seed code of docs/design.md, each measured on a GPU
(docs/evidence.md#kernel-departures):

* The seed scales ``Q_s`` and ``K_s`` in place. TileLang 0.1.15 puts those loops inside a
  branch only half of the consumer threads take, around a named barrier that waits for all
  of them: the kernel deadlocks. The weighted K rows go to a separate buffer (``Kw_s``).
* The seed reloads Q into the buffer it just scaled; the pipeliner hoists that copy above
  the scaling, so the intra-chunk term silently used the scaled Q. Q is never scaled here.
* Q's weights ``alpha^(r+1)`` scale the fp32 accumulator rows after the inter-chunk MMA,
  not a weighted copy of Q in shared memory.
* On Hopper the chunk step issues its MMAs with ``T.wgmma_gemm`` without waiting for
  each, and waits only where a result is read, so K's weights, the decay mask and the
  output store overlap the tensor cores. wgmma needs 64-row tiles: 32-token chunks wait
  for each MMA. Elsewhere the same step issues ``T.gemm`` and its waits vanish
  (``kernel.mma``): one source for every architecture of ``kernel.arch``.
* Where a config has 64 state rows per consumer warpgroup and its scores in shared memory
  (``transposes``), the block keeps the state transposed: ``S^T`` is the register
  operand of the inter-chunk MMA, so no shared-memory copy of the state sits between one
  chunk and the next (``transposed_chunk_loop_macro``).

The numerical rules hold: every decay weight is ``exp2(log2(alpha) * k)`` with ``k >= 0``
(``alpha_power``), so it lies in ``(0, 1]``; ``Gamma`` is evaluated only where ``j <= i``;
weights stay fp32 and only the product ``A * Gamma`` is cast for the MMA.
"""

from dataclasses import dataclass

import tilelang.language as T

from kernel.arch import get_arch
from kernel.config import KernelConfig, Problem, whole_chunks
from kernel.mma import Mma, mma_for

ACCUM = "float32"  # the dtype of every accumulator and decay weight


def alpha_power(lg, k):
    """``alpha^k`` (fp32) from ``lg = log2(alpha)``, as every decay weight of the kernels is
    computed: ``exp2(log2(alpha) * k)``, in ``(0, 1]`` for ``k >= 0``."""
    return T.exp2(lg * T.Cast(ACCUM, k))


def transposes(*, chunk: int, block_dv: int, threads: int, scores: str) -> bool:
    """Whether a config runs the transposed chunk step (``transposed_chunk_loop_macro``):
    it needs 64 state rows per consumer warpgroup and the scores in shared memory."""
    warpgroups = max(threads // 128, 1)  # TileLang's consumer warpgroups
    return chunk % 64 == 0 and block_dv % (64 * warpgroups) == 0 and scores == "smem"


@dataclass(frozen=True)
class Direction:
    """Where the recurrence runs: forward in time, or backwards (``reverse``: each token's
    state gathers the tokens from it to its sequence's end, ``S_t = alpha S_{t+1} + k_t^T
    v_t``; the backward's dk and dv passes, ``kernel.ops.backward``). Reversed, the chunks keep
    their place and are walked last to first, and within a chunk of ``m`` tokens every
    weight mirrors the forward's: query row i sees key rows j >= i, weighted
    ``alpha^(j-i)``; it reads the state carried in with ``alpha^(m-i)``; key row r writes
    the state carried out with ``alpha^r``; the carry is ``alpha^m`` both ways. Every
    exponent stays >= 0. Key rows past ``m`` (zero, or the next sequence's) are masked out
    of the scores, which forward only the causal mask does."""

    reverse: bool

    def chunk_start(self, s_begin, c, n_chunks, chunk: int):
        """The first token of the ``c``-th chunk walked."""
        return s_begin + ((n_chunks - 1 - c) if self.reverse else c) * chunk

    def sees(self, i, j):
        """Whether query row ``i`` sees key row ``j`` of its chunk."""
        return j >= i if self.reverse else j <= i

    def distance(self, i, j):
        """The tokens between query row ``i`` and a key row ``j`` it sees."""
        return j - i if self.reverse else i - j

    def query_power(self, i, m):
        """The exponent of the state carried in, as query row ``i`` reads it."""
        return T.max(m - i, 0) if self.reverse else i + 1

    def key_power(self, r, m):
        """The exponent of key row ``r < m`` as it writes the state carried out."""
        return r if self.reverse else m - 1 - r

    def gamma(self, i, j, lg, scale):
        """``Gamma[i, j]``: ``scale * alpha^distance`` where query row ``i`` sees key row
        ``j``, else 0, from ``lg = log2(alpha)``. Never "compute all, then mask": the weight
        of a row not seen has a negative exponent, may overflow, and inf * 0 = NaN."""
        return T.if_then_else(self.sees(i, j), scale * alpha_power(lg, self.distance(i, j)), T.Cast(ACCUM, 0))

    def scores(self, a, gamma, j, m):
        """A score times its decay mask (fp32), with key rows past ``m`` out where reversed."""
        return T.if_then_else(j < m, a * gamma, T.Cast(ACCUM, 0)) if self.reverse else a * gamma


def decay_mask_macro(*, chunk: int, scale: float, time: Direction, transposed: bool = False):
    """The decay mask, as a ``@T.macro`` ``decay_mask(Gamma, lg, Decay, bh)``: ``lg[0] =
    log2(alpha)`` of head ``bh`` (``Decay[bh]``; <= 0), then the fp32 ``[C, C]`` tile
    ``Gamma[i, j] = time.gamma(i, j)`` for query row ``i`` and key row ``j``, or its
    transpose ``Gamma[j, i]`` where ``transposed``. Every chunk step's, and the fused
    backward pass's (``kernel.dkdv``)."""

    @T.macro
    def decay_mask(Gamma, lg, Decay, bh):
        lg[0] = T.log2(Decay[bh])
        if transposed:
            for j, i in T.Parallel(chunk, chunk):
                Gamma[j, i] = time.gamma(i, j, lg[0], scale)
        else:
            for i, j in T.Parallel(chunk, chunk):
                Gamma[i, j] = time.gamma(i, j, lg[0], scale)

    return decay_mask


def key_weights_macro(*, chunk: int, dk: int, dtype: str, time: Direction):
    """The weighted keys, as a ``@T.macro`` ``weigh(Kw_s, K_s, lg, m)``: row ``r < m`` of
    the ``[C, DK]`` tile ``K_s`` times ``alpha^time.key_power(r, m)`` into ``Kw_s``, the
    rows past ``m`` zero: the rows that write the state carried out (the fused backward
    pass weighs its queries so, ``kernel.dkdv``)."""

    @T.macro
    def weigh(Kw_s, K_s, lg, m):
        for r, d in T.Parallel(chunk, dk):
            Kw_s[r, d] = T.if_then_else(
                r < m, K_s[r, d] * alpha_power(lg[0], time.key_power(r, m)), T.Cast(dtype, 0)
            )

    return weigh


def sizes(problem: Problem, arch: str) -> tuple:
    """``(B, S)`` as a dense kernel declares them for ``arch``: symbolic, read from the
    tensors at launch, where the architecture has ``symbolic_shapes``; else the problem's
    (``kernel.variants.shape_generic``)."""
    return T.dynamic("batch, seqlen") if get_arch(arch).symbolic_shapes else (problem.batch, problem.seqlen)


def tensor_types(batch, seqlen, *, heads: int, dk: int, dv: int, dtype: str) -> tuple:
    """Factories of the kernels' tensor types over ``[batch, seqlen]`` tokens, ``(qk, vo,
    decay)``: Q and K's ``[B, S, H, DK]``, V and O's ``[B, S, H, DV]`` (both of ``dtype``),
    Decay's fp32 ``[H]``. A ``@T.prim_func`` parameter annotated with a call declares a
    tensor of its own (one shared ``T.Tensor`` would alias the parameters)."""
    return (
        lambda: T.Tensor([batch, seqlen, heads, dk], dtype),
        lambda: T.Tensor([batch, seqlen, heads, dv], dtype),
        lambda: T.Tensor([heads], ACCUM),
    )


def staged_tiles(*, chunk: int, dk: int, block_dv: int, dtype: str) -> tuple:
    """Allocate the shared tiles of one chunk, ``(Q_s, K_s, Kw_s, V_s)``: Q and K ``[C, DK]``,
    the weighted K (``key_weights_macro``), V ``[C, block_dv]``. Called in a chunk loop's
    ``@T.macro`` body, which names them."""
    return tuple(T.alloc_shared(shape, dtype) for shape in ([chunk, dk],) * 3 + ([chunk, block_dv],))


def load_macro(*, chunk: int, block_dv: int):
    """The loads of one chunk, as a ``@T.macro`` ``load(Q, K, V, Q_s, K_s, V_s, bb, s0, bh,
    v0)``: rows ``s0 : s0 + C`` of batch ``bb``, head ``bh`` (V's columns ``v0 : v0 +
    block_dv``) into their tiles (``staged_tiles``); TMA zero-fills the rows past S."""

    @T.macro
    def load(Q, K, V, Q_s, K_s, V_s, bb, s0, bh, v0):
        T.copy(Q[bb, s0 : s0 + chunk, bh, :], Q_s)
        T.copy(K[bb, s0 : s0 + chunk, bh, :], K_s)
        T.copy(V[bb, s0 : s0 + chunk, bh, v0 : v0 + block_dv], V_s)

    return load


def chunk_loop_macro(
    *,
    chunk: int,
    dk: int,
    block_dv: int,
    scale: float = 1.0,
    num_stages: int,
    threads: int,
    scores: str,
    dtype: str,
    arch: str,
    packed: bool = False,
    reverse: bool = False,
    aligned: bool = False,
):
    """The chunk loop of one block, as a ``@T.macro``: its buffers, the decay mask, the
    starting state, then ``n_chunks`` chunks from row ``s_begin`` (tokens up to ``s_end``)
    of batch ``bb``, head ``bh``, value columns ``v0 : v0 + block_dv``, each chunk's outputs from the state
    carried in, then the state carried out. ``Decay[bh]`` is the head's alpha in (0, 1],
    read at run time; ``scale`` multiplies the queries. ``State`` is ``None`` (start from
    zero) or an fp32 ``[B*H, P, DK, DV]`` tensor whose ``[bbh, p_in]`` slice is the state
    to start from where ``start`` holds (default: always; else zero); ``Final`` is ``None``
    or the fp32 ``[B*H, 1, DK, DV]`` tensor that receives the state after ``s_end`` where
    ``final`` holds. Each condition is a bool, or a function of no arguments returning the
    run-time condition, called where the state is read or written (``pool_fwd``): the state
    read is then a masked load, not a branch around a copy. A
    ragged last chunk (``m < C`` tokens) weights its keys by their distance to its last
    token and decays the state by ``alpha^m``, so the state carried out is exact. Shared by
    the single-pass kernel and the sequence-split variant (``kernel.seq_split``). ``arch``
    (``kernel.arch.ARCHS``) picks the MMA statements (``kernel.mma``). With ``reverse``
    the recurrence runs backwards in time (``Direction``): the state carried in is the one
    after ``s_end``, the state carried out the one at ``s_begin``. ``aligned``: every chunk
    walked is whole (``whole_chunks``), so its token count is the constant C and the
    weights that depend on it fold as they do for a static length."""
    mma = mma_for(arch, rows=chunk)
    time = Direction(reverse)
    knobs = dict(
        chunk=chunk,
        dk=dk,
        block_dv=block_dv,
        scale=scale,
        num_stages=num_stages,
        dtype=dtype,
        packed=packed,
        time=time,
        aligned=aligned,
    )
    if transposes(chunk=chunk, block_dv=block_dv, threads=threads, scores=scores):
        return transposed_chunk_loop_macro(**knobs, mma=mma)
    C, accum = chunk, ACCUM
    load, store = (
        load_macro(chunk=C, block_dv=block_dv),
        store_macro(chunk=C, block_dv=block_dv, packed=packed),
    )
    decay_mask = decay_mask_macro(chunk=C, scale=scale, time=time)
    weigh = key_weights_macro(chunk=C, dk=dk, dtype=dtype, time=time)
    # wgmma needs 64-row tiles: chunks of 32 wait for each MMA (T.gemm, ``mma_for``).
    async_step = C % 64 == 0
    touches = mma.asynchronous  # see the async step

    @T.macro
    def chunk_loop(
        Q, K, V, O, Decay, bb, bh, v0, s_begin, n_chunks, s_end, State, Final, bbh, p_in, final, start=True
    ):  # fmt: skip
        Q_s, K_s, Kw_s, V_s = staged_tiles(chunk=C, dk=dk, block_dv=block_dv, dtype=dtype)
        S_s = T.alloc_shared([dk, block_dv], dtype)
        O_s = T.alloc_shared([C, block_dv], dtype)

        S_f = T.alloc_fragment([dk, block_dv], accum)  # carried across chunks
        acc_o = T.alloc_fragment([C, block_dv], accum)
        A = T.alloc_fragment([C, C], accum)
        if scores == "smem":
            A_cast = T.alloc_shared([C, C], dtype)
        else:
            A_cast = T.alloc_fragment([C, C], dtype)
        Gamma = T.alloc_fragment([C, C], accum)
        touch = T.alloc_local([1], dtype) if touches else None  # see the async step
        lg = T.alloc_local([1], accum)  # log2(alpha) of this head, <= 0
        decay_mask(Gamma, lg, Decay, bh)
        if State is None:
            T.clear(S_f)
        elif callable(start):  # a run-time condition (``pool_fwd``): a masked load, no branch
            for i, j in T.Parallel(dk, block_dv):
                S_f[i, j] = T.if_then_else(start(), State[bbh, p_in, i, v0 + j], T.Cast(accum, 0))
        elif start:
            T.copy(State[bbh, p_in, :, v0 : v0 + block_dv], S_f)
        else:
            T.clear(S_f)

        for c in T.Pipelined(n_chunks, num_stages=num_stages):
            s0 = time.chunk_start(s_begin, c, n_chunks, C)
            m = C if aligned else T.max(T.min(C, s_end - s0), 0)  # tokens of this chunk: C but at the end
            load(Q, K, V, Q_s, K_s, V_s, bb, s0, bh, v0)
            if not async_step:
                weigh(Kw_s, K_s, lg, m)

            if async_step:
                # The pipeliner hands a stage's buffer back to the producer after the last
                # statement that names it, while an issued wgmma may still read it: each
                # stage buffer is named once more after the wait that covers its MMAs.
                T.copy(S_f, S_s)  # the state before this chunk
                mma.gemm(Q_s, K_s, A, transpose_B=True, clear_accum=True)
                mma.gemm(Q_s, S_s, acc_o, clear_accum=True)
                mma.wait(1)  # A is ready and K_s free; Q @ S may still run
                weigh(Kw_s, K_s, lg, m)
                for i, j in T.Parallel(C, C):
                    A_cast[i, j] = time.scores(A[i, j], Gamma[i, j], j, m)
                mma.wait(0)
                if touches:
                    touch[0] = Q_s[0, 0]
                for i, j in T.Parallel(C, block_dv):
                    acc_o[i, j] *= scale * alpha_power(lg[0], time.query_power(i, m))
                mma.gemm(A_cast, V_s, acc_o)
                for i, j in T.Parallel(dk, block_dv):
                    S_f[i, j] *= alpha_power(lg[0], m)
                mma.gemm(Kw_s, V_s, S_f, transpose_A=True)
                mma.wait(1)  # the outputs are ready; the state update may still run
                T.copy(acc_o, O_s)
                store(O_s, O, bb, s0, m, bh, v0)
                mma.wait(0)
                if touches:
                    touch[0] = V_s[0, 0]
            else:
                # Inter-chunk term; S_f still holds the state before this chunk.
                T.copy(S_f, S_s)
                T.gemm(Q_s, S_s, acc_o, clear_accum=True)  # [C, DK] @ [DK, bDV] -> [C, bDV]
                for i, j in T.Parallel(C, block_dv):
                    acc_o[i, j] *= scale * alpha_power(lg[0], time.query_power(i, m))
                # Intra-chunk term with the unweighted Q.
                T.gemm(Q_s, K_s, A, transpose_B=True, clear_accum=True)  # [C, DK] @ [DK, C]
                for i, j in T.Parallel(C, C):
                    A_cast[i, j] = time.scores(A[i, j], Gamma[i, j], j, m)
                T.gemm(A_cast, V_s, acc_o)  # [C, C] @ [C, bDV] -> [C, bDV]
                T.copy(acc_o, O_s)
                store(O_s, O, bb, s0, m, bh, v0)

                # State update after the output (the output reads the state before this
                # chunk), decaying the old state before adding this chunk's keys.
                for i, j in T.Parallel(dk, block_dv):
                    S_f[i, j] *= alpha_power(lg[0], m)
                T.gemm(Kw_s, V_s, S_f, transpose_A=True)  # [DK, C] @ [C, bDV] -> [DK, bDV]
        if Final is not None and callable(final):  # a run-time condition, evaluated here
            if final():
                T.copy(S_f, Final[bbh, 0, :, v0 : v0 + block_dv])
        elif Final is not None and final:
            T.copy(S_f, Final[bbh, 0, :, v0 : v0 + block_dv])

    return chunk_loop


def store_macro(*, chunk: int, block_dv: int, packed: bool):
    """The store of one chunk's output tile ``O_s`` (``[C, block_dv]``) to rows ``s0 :
    s0 + C``. Dense, one TMA store (TMA drops the rows past S). Packed, the rows past ``m``
    belong to the next sequence: only the first ``m`` rows are written."""

    @T.macro
    def store(O_s, O, bb, s0, m, bh, v0):
        if packed:
            for i, v in T.Parallel(chunk, block_dv):
                if i < m:
                    O[bb, s0 + i, bh, v0 + v] = O_s[i, v]
        else:
            T.copy(O_s, O[bb, s0 : s0 + chunk, bh, v0 : v0 + block_dv])

    return store


def transposed_chunk_loop_macro(
    *,
    chunk: int,
    dk: int,
    block_dv: int,
    scale: float,
    num_stages: int,
    dtype: str,
    packed: bool,
    time: Direction,
    aligned: bool,
    mma: Mma,
):
    """``chunk_loop_macro``'s loop with the state transposed: the block keeps ``S^T``
    (``[block_dv, DK]``, fp32) as the accumulator of ``V^T @ Kw``, so its fp16 cast is the
    register A operand of the inter-chunk MMA ``O^T = S^T @ Q^T``, as FlashAttention's
    ``P @ V`` is, and no ``S_s`` copy in shared memory (with the barriers around it) sits
    between one chunk's state and the next chunk's outputs. Every tile of the step comes
    out transposed: the scores ``A^T = K @ Q^T`` with the mask ``Gamma^T``, ``O^T += V^T @
    (A^T * Gamma^T)``, and the output tile is written transposed into ``O_s`` for its TMA
    store. Each consumer warpgroup owns 64 rows of ``S^T`` and ``O^T``
    (``GemmWarpPolicy.FullRow``), so a warpgroup's state never leaves its registers. The
    MMAs are ``mma``'s (``kernel.mma``): async on Hopper, ``T.gemm`` elsewhere."""
    C, accum = chunk, ACCUM
    load, store = (
        load_macro(chunk=C, block_dv=block_dv),
        store_macro(chunk=C, block_dv=block_dv, packed=packed),
    )
    decay_mask = decay_mask_macro(chunk=C, scale=scale, time=time, transposed=True)
    weigh = key_weights_macro(chunk=C, dk=dk, dtype=dtype, time=time)
    rows = T.GemmWarpPolicy.FullRow

    @T.macro
    def chunk_loop(
        Q, K, V, O, Decay, bb, bh, v0, s_begin, n_chunks, s_end, State, Final, bbh, p_in, final, start=True
    ):  # fmt: skip
        Q_s, K_s, Kw_s, V_s = staged_tiles(chunk=C, dk=dk, block_dv=block_dv, dtype=dtype)
        O_s = T.alloc_shared([C, block_dv], dtype)
        AT_cast = T.alloc_shared([C, C], dtype)

        ST_f = T.alloc_fragment([block_dv, dk], accum)  # S^T, carried across chunks
        ST_h = T.alloc_fragment([block_dv, dk], dtype)  # its cast: the MMA's A operand
        OT = T.alloc_fragment([block_dv, C], accum)
        AT = T.alloc_fragment([C, C], accum)
        GammaT = T.alloc_fragment([C, C], accum)
        touch = T.alloc_local([1], dtype) if mma.asynchronous else None  # see chunk_loop_macro's async step
        lg = T.alloc_local([1], accum)  # log2(alpha) of this head, <= 0
        decay_mask(GammaT, lg, Decay, bh)  # GammaT[j, i]: key j, query i
        if State is None:
            T.clear(ST_f)
        elif callable(start):  # a run-time condition (``pool_fwd``): a masked load, no branch
            for v, d in T.Parallel(block_dv, dk):
                ST_f[v, d] = T.if_then_else(start(), State[bbh, p_in, d, v0 + v], T.Cast(accum, 0))
        elif start:
            for v, d in T.Parallel(block_dv, dk):
                ST_f[v, d] = State[bbh, p_in, d, v0 + v]
        else:
            T.clear(ST_f)

        for c in T.Pipelined(n_chunks, num_stages=num_stages):
            s0 = time.chunk_start(s_begin, c, n_chunks, C)
            m = C if aligned else T.max(T.min(C, s_end - s0), 0)  # tokens of this chunk: C but at the end
            load(Q, K, V, Q_s, K_s, V_s, bb, s0, bh, v0)
            T.copy(ST_f, ST_h)  # the state before this chunk
            mma.gemm(K_s, Q_s, AT, transpose_B=True, clear_accum=True)  # [C_j, C_i]
            mma.gemm(ST_h, Q_s, OT, transpose_B=True, clear_accum=True, policy=rows)
            mma.wait(1)  # A^T is ready and K_s free; S^T @ Q^T may still run
            weigh(Kw_s, K_s, lg, m)
            for j, i in T.Parallel(C, C):
                AT_cast[j, i] = time.scores(AT[j, i], GammaT[j, i], j, m)
            mma.wait(0)
            if mma.asynchronous:
                touch[0] = Q_s[0, 0]
            for v, i in T.Parallel(block_dv, C):
                OT[v, i] *= scale * alpha_power(lg[0], time.query_power(i, m))
            mma.gemm(V_s, AT_cast, OT, transpose_A=True, policy=rows)  # [bDV, C_i]
            for v, d in T.Parallel(block_dv, dk):
                ST_f[v, d] *= alpha_power(lg[0], m)
            mma.gemm(V_s, Kw_s, ST_f, transpose_A=True, policy=rows)  # [bDV, DK]
            mma.wait(1)  # the outputs are ready; the state update may still run
            for i, v in T.Parallel(C, block_dv):
                O_s[i, v] = OT[v, i]
            store(O_s, O, bb, s0, m, bh, v0)
            mma.wait(0)
            if mma.asynchronous:
                touch[0] = V_s[0, 0]
        if Final is not None and callable(final):  # a run-time condition, evaluated here
            if final():
                for v, d in T.Parallel(block_dv, dk):
                    Final[bbh, 0, d, v0 + v] = ST_f[v, d]
        elif Final is not None and final:
            for v, d in T.Parallel(block_dv, dk):
                Final[bbh, 0, d, v0 + v] = ST_f[v, d]

    return chunk_loop


def scalar_decay_fwd(problem: Problem, *, initial_state: bool = False, final_state: bool = False, **loop):
    """Return the ``@T.prim_func`` ``main(Q, K, V, Decay, H0, O, HT)`` for one config and
    ``problem``'s heads, DK, DV and dtype: one kernel for every batch size ``B`` and
    sequence length ``S`` where ``arch`` allows (``sizes``).
    ``loop``: the config's knobs (``loop_knobs``), ``scale``, ``reverse`` and the ``arch``,
    for ``chunk_loop_macro``.

    Q, K: ``[B, S, H, DK]``; V, O: ``[B, S, H, DV]``; all of ``dtype``. Decay: fp32 ``[H]``,
    each head's alpha in (0, 1]. H0, HT: fp32 ``[B*H, 1, DK, DV]``, the state before the
    first token (read only with ``initial_state``) and after the last (written only with
    ``final_state``); with ``reverse`` the recurrence runs backwards in time (``Direction``),
    from H0 after the last token to HT at the first. Accumulation is fp32. ``seqlen`` need
    not be a multiple of ``chunk``: the tile copies of the last chunk are bounds-checked
    (TMA zero-fills reads past S and drops writes past S), and the zero-filled rows add
    nothing.

    ``scores="smem"`` stages the fp16 scores ``A * Gamma`` in shared memory; ``"regs"``
    keeps them in registers as the seed code of docs/design.md does. With TileLang 0.1.15
    the register version fails layout inference ("Layout infer conflict between A and
    A_cast") for every ``chunk=32`` and ``threads=256`` config; the shared version lowers
    for them and frees registers (64/128/2/256 does not spill). It costs ``2 * C * C``
    bytes of shared memory.
    """
    heads, dk, dv = problem.heads, problem.dk, problem.dv
    chunk, block_dv, threads = loop["chunk"], loop["block_dv"], loop["threads"]
    aligned = whole_chunks(problem, chunk)
    chunk_loop = chunk_loop_macro(dk=dk, dtype=problem.dtype, aligned=aligned, **loop)
    batch, seqlen = sizes(problem, loop["arch"])
    qk, vo, decay = tensor_types(batch, seqlen, heads=heads, dk=dk, dv=dv, dtype=problem.dtype)
    state_shape = [batch * heads, 1, dk, dv]

    @T.prim_func
    def main(
        Q: qk(), K: qk(), V: vo(), Decay: decay(), H0: T.Tensor(state_shape, ACCUM), O: vo(),
        HT: T.Tensor(state_shape, ACCUM),
    ):  # fmt: skip
        with T.Kernel(T.ceildiv(dv, block_dv), batch * heads, threads=threads) as (bv, bbh):
            bb = bbh // heads
            bh = bbh % heads
            v0 = bv * block_dv
            # One block walks the whole sequence.
            start, end = H0 if initial_state else None, HT if final_state else None
            chunk_loop(
                Q, K, V, O, Decay, bb, bh, v0, 0, T.ceildiv(seqlen, chunk), seqlen, start, end, bbh, 0, True
            )

    return main


def prim_func(
    problem: Problem,
    config: KernelConfig,
    *,
    arch: str,
    packed: bool = False,
    slots: str | None = None,
    **call,
):
    """``scalar_decay_fwd`` (or, ``packed``, ``packed_fwd``; with ``slots``, ``pool_fwd``)
    for a validated problem and a single-pass config, lowered later for ``arch``;
    ``call``: ``scale``, ``initial_state``, ``final_state``, ``reverse``, ``slots``."""
    if config.segments != 1:
        raise ValueError(f"the single-pass kernel runs one segment, got segments={config.segments}")
    if slots is not None:
        return pool_fwd(problem, slots=slots, **loop_knobs(config), **call, arch=arch)
    return (packed_fwd if packed else scalar_decay_fwd)(problem, **loop_knobs(config), **call, arch=arch)


def loop_knobs(config: KernelConfig) -> dict:
    """The knobs of ``config`` that ``chunk_loop_macro`` takes: all but ``segments``."""
    knobs = config.to_dict()
    del knobs["segments"]
    return knobs


def packed_fwd(problem: Problem, *, initial_state: bool = False, final_state: bool = False, **loop):
    """Return the ``@T.prim_func`` ``main(Q, K, V, Decay, H0, O, HT, CuSeqlens)`` for
    packed sequences of ``problem``'s heads, DK, DV and dtype: one kernel for every token
    count ``T`` and sequence count ``N`` (both symbolic, read from the tensors at launch,
    as ``scalar_decay_fwd``'s B and S are). ``loop`` as ``scalar_decay_fwd`` takes it.

    Q, K: ``[1, T, H, DK]``; V, O: ``[1, T, H, DV]``. CuSeqlens: int32 ``[N + 1]``, the
    offsets of the sequences, from 0 to T. H0, HT: fp32 ``[N*H, 1, DK, DV]`` (``[1, 1, DK,
    DV]`` placeholders where the call has no state in, or out). One block per (value slice,
    sequence, head) walks its sequence from its first token; a chunk's tile reaches into
    the next sequence, whose rows are kept out of the state (their key weight is 0) and out
    of the output (``store_macro``)."""
    heads, dk, dv = problem.heads, problem.dk, problem.dv
    chunk, block_dv, threads = loop["chunk"], loop["block_dv"], loop["threads"]
    chunk_loop = chunk_loop_macro(dk=dk, dtype=problem.dtype, packed=True, **loop)
    tokens, offsets, h0_rows, ht_rows = (T.dynamic(n) for n in ("tokens", "offsets", "h0_rows", "ht_rows"))
    qk, vo, decay = tensor_types(1, tokens, heads=heads, dk=dk, dv=dv, dtype=problem.dtype)

    @T.prim_func
    def main(
        Q: qk(), K: qk(), V: vo(), Decay: decay(), H0: T.Tensor([h0_rows, 1, dk, dv], ACCUM), O: vo(),
        HT: T.Tensor([ht_rows, 1, dk, dv], ACCUM), CuSeqlens: T.Tensor([offsets], "int32"),
    ):  # fmt: skip
        with T.Kernel(T.ceildiv(dv, block_dv), (offsets - 1) * heads, threads=threads) as (bv, bnh):
            n = bnh // heads
            bh = bnh % heads
            bos = CuSeqlens[n]
            eos = CuSeqlens[n + 1]
            start, end = H0 if initial_state else None, HT if final_state else None
            chunk_loop(
                Q,
                K,
                V,
                O,
                Decay,
                0,
                bh,
                bv * block_dv,
                bos,
                T.ceildiv(eos - bos, chunk),
                eos,
                start,
                end,
                bnh,
                0,
                True,
            )

    return main


def pool_fwd(problem: Problem, *, slots: str, initial_state=False, final_state=False, **loop):
    """Return the ``@T.prim_func`` ``main(Q, K, V, Decay, Pool, O, CuSeqlens, Slots,
    FromPool)``: ``packed_fwd`` with each sequence's states in a pool of slots, read and
    written in place. ``slots``: the dtype of the slot indices (``kernel.config.SLOT_DTYPES``).

    Pool: fp32 ``[P*H, 1, DK, DV]`` (a pool ``[P, H, DK, DV]`` viewed so, P symbolic).
    Slots: ``[N]``, the pool row of each sequence; FromPool: int8 ``[N]`` (a bool tensor
    viewed so). Sequence n, head h starts from ``Pool[Slots[n]*H + h]`` where ``FromPool[n]``
    is nonzero and its slot lies in ``[0, P)``, else from zero, and its final state is
    written there where the slot lies in ``[0, P)``: a slot outside (-1, padding) touches
    no state, its outputs still computed. Each block reads its own ``[DK, block_dv]`` slice
    before the chunk loop and writes it after: in place, distinct slots never race (a slot
    repeated within a call does)."""
    if initial_state or final_state:
        raise ValueError("a pool call's states are the pool's: no initial_state or final_state")
    heads, dk, dv = problem.heads, problem.dk, problem.dv
    chunk, block_dv, threads = loop["chunk"], loop["block_dv"], loop["threads"]
    chunk_loop = chunk_loop_macro(dk=dk, dtype=problem.dtype, packed=True, **loop)
    tokens, offsets, sequences, rows = (T.dynamic(n) for n in ("tokens", "offsets", "sequences", "pool_rows"))
    qk, vo, decay = tensor_types(1, tokens, heads=heads, dk=dk, dv=dv, dtype=problem.dtype)

    # The conditions go to the chunk loop as functions, expanded where the state is read and
    # written. A condition passed as an expression is bound to a variable above TileLang's
    # producer/consumer split; where the state is written under it, TileLang 0.1.15's
    # ThreadSync refuses the consumer branch's barriers ("not warp-uniform. Condition: not
    # tx < 128", sm_90a, 256 threads with the state not transposed).
    def kept(slot):
        """Whether ``slot`` lies in the pool: else no state is read or written."""
        return (slot >= 0) & (slot < T.Cast("int64", rows // heads))

    @T.prim_func
    def main(
        Q: qk(), K: qk(), V: vo(), Decay: decay(), Pool: T.Tensor([rows, 1, dk, dv], ACCUM), O: vo(),
        CuSeqlens: T.Tensor([offsets], "int32"), Slots: T.Tensor([sequences], slots),
        FromPool: T.Tensor([sequences], "int8"),
    ):  # fmt: skip
        with T.Kernel(T.ceildiv(dv, block_dv), (offsets - 1) * heads, threads=threads) as (bv, bnh):
            n = bnh // heads
            bh = bnh % heads
            bos = CuSeqlens[n]
            eos = CuSeqlens[n + 1]
            slot = T.Cast("int64", Slots[n])
            row = T.Cast("int32", slot) * heads + bh  # used only where kept
            chunk_loop(
                Q,
                K,
                V,
                O,
                Decay,
                0,
                bh,
                bv * block_dv,
                bos,
                T.ceildiv(eos - bos, chunk),
                eos,
                Pool,
                Pool,
                row,
                0,
                lambda: kept(slot),
                lambda: kept(slot) & (FromPool[n] != 0),
            )

    return main
