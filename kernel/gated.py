"""The single-pass forward for a decay that changes per token: fla's log-gate ``g``.

``S_t = exp(g_t) S_{t-1} + k_t^T v_t``, ``o_t = scale q_t S_t`` (``refs.gated``), with
``g [B, S, H]`` fp32 per token and, where the call has one, a per-head ``g_gamma [H]``
added to it (fla's ``chunk_simple_gla(g=..., g_gamma=...)``; Mamba2's ``dt * A``). q and k
may come in groups (Mamba2's ``ngroups``): G heads, v and o H = G r, head h reading group
``h // r``. The grid runs the r heads of a group in adjacent blocks, so a group's q and k
tiles are read from memory once and from L2 by the other heads of the group.

The block is ``kernel.scalar_decay``'s (one ``[DK, block_DV]`` state slice of one (batch,
head), the sequence walked chunk by chunk in a ``T.Pipelined`` loop, the state in
registers), and so are its ordering rules (docs/design.md section 4). What changes is where
the weights come from: per chunk, the gates of its m real tokens (0 on the rows past m) are
scanned in fp32 into ``G_r``, their sum up to row r, in shared memory, and

* the mask ``exp(G_i - G_j)`` is evaluated only where ``j <= i``, fused into the fp32
  scores before their cast (never "compute all, then mask");
* query row r reads the state carried in with ``exp(G_r)``;
* key row r writes the state carried out with ``exp(G_last - G_r)`` (0 past m);
* the state is carried with ``exp(G_last)`` (``G_{C-1}``: the rows past m add nothing).

Every exponent is a sum of gates, so for gates <= 0 every weight lies in [0, 1]: a gate of
-20 per token underflows them to 0, never to inf. Every ``exp`` is ``exp2(x * log2(e))``.

With ``reverse`` the recurrence runs backwards in time (the gated backward's passes):
``S_t = exp(g_{t+1}) S_{t+1} + k_t^T v_t`` from ``S_T = H0`` (the state in enters after
the last token, whose next gate ``g_T`` counts as 0) down to ``S_0``, the state out;
``o_t = scale q_t S_t``. The decay between tokens t and t+1 is token t+1's gate. As
``kernel.scalar_decay.Direction`` runs a constant decay backwards, the chunks keep their
place and are walked last to first. A chunk of m tokens from ``s0`` loads its gates shifted
by one token, ``g'_r = g_{s0+r+1}`` (0 where token ``s0 + r + 1`` is past the sequence, so
for every row past ``m - 1`` too: the next sequence's gates never enter), and scans them
exclusively, ``E_r = sum_{u<r} g'_u`` (``E_0 = 0``), ``E_last = E_C = E_m``. Unrolling the
recurrence over the chunk from the state carried in ``S_in = S_{s0+m}``::

    S_{s0+i} = sum_{i<=j<m} exp(E_j - E_i) k_j^T v_j + exp(E_last - E_i) S_in

so

* query row i sees key rows ``i <= j < m`` with ``exp(E_j - E_i)`` (the rows past m,
  zero or the next sequence's, masked out of the scores), fused as the forward's mask;
* query row i reads the state carried in with ``exp(E_last - E_i)``;
* key row r writes the state carried out (``S_{s0}``) with ``exp(E_r)`` (0 past m);
* the state is carried with ``exp(E_last)`` (query row 0's weight, ``E_0 = 0``).

Every exponent is again a sum of gates: each weight lies in [0, 1] for gates <= 0.

``out_dtype="float32"`` writes O in fp32 (the backward's dq and dk, for the gate's gradient):
the output tile in shared memory and its store follow O's dtype.
"""

import math

import tilelang.language as T

from kernel.arch import get_arch
from kernel.config import Call, KernelConfig, Problem
from kernel.mma import mma_for
from kernel.scalar_decay import ACCUM, staged_tiles, store_macro

LOG2E = math.log2(math.e)


# TMA's least inner box is 16 bytes: where H is a multiple of 4, a chunk's gates come by TMA
# as a [C, 4] box of fp32 gates of 4 heads, beside Q, K and V (the block reads its own
# head's column); else by a scalar load per row, which the producer waits on first.
GATE_BOX = 4


def gate_box(heads: int) -> int:
    """The heads a chunk's gate load spans: ``GATE_BOX`` where H is a multiple of it, else 1."""
    return GATE_BOX if heads % GATE_BOX == 0 else 1


def gate_weights_macro(*, chunk: int, heads: int, reverse: bool = False):
    """The chunk's gate weights, as a ``@T.macro`` ``gate(Gate, gamma, g_s, G_f, G_s, w_s, bb,
    s0, bh, m, s_end)``: the gates of rows ``s0 : s0 + C`` of batch ``bb`` and of the heads
    ``h0 : h0 + gate_box(heads)`` from ``bh`` rounded down, loaded into ``g_s`` (``[C,
    gate_box(heads)]``); head ``bh``'s (plus ``gamma``, its ``Gamma[bh]`` read once into a
    register before the chunks; 0 on the rows past m) scanned into ``G_s[r] = G_r``, then
    ``w_s[0, r] = exp(G_r)`` (the queries') and ``w_s[1, r] = exp(G_last - G_r)`` (the
    keys', 0 past m), all fp32 in shared memory.

    With ``reverse`` (the module's docstring): the gates shifted by one token, those of rows
    ``s0 + 1 : s0 + C + 1``, 0 from ``s_end`` on (every row past ``m - 1`` reads 0), their
    exclusive scan ``G_s[r] = E_r``, ``w_s[0, r] = exp(E_last - E_r)`` (the queries'; ``w_s[0,
    0] = exp(E_last)``, the carry) and ``w_s[1, r] = exp(E_r)`` (the keys', 0 past m).
    Forward, ``s_end`` is not read.

    The scan is a sum per row over the rows up to it, in the order of the rows, in a
    register fragment ``G_f`` (each thread reads the shared gates and adds; one store to
    ``G_s`` after), not ``T.cumsum``: with two pipeline stages TileLang 0.1.15
    double-buffers ``g_s`` and lowers the cumsum of its ``dim=0`` to a scan along the new
    axis of one row, which leaves the gates unscanned. Summed in ``G_s`` itself, each of the
    C adds was a shared-memory load and store in series. The rows a tile holds past its
    chunk's (past S, zero-filled by TMA, or the next packed sequence's) are masked in the
    scan, never loaded apart."""
    C, box = chunk, gate_box(heads)
    shift = 1 if reverse else 0

    def value(g_s, gamma, bh, t, s0, m, s_end):
        """Head bh's gate of row t, 0 past the chunk (reversed: past the sequence)."""
        kept = (s0 + t + 1 < s_end) if reverse else (t < m)
        return T.if_then_else(kept, g_s[t, bh % box] + gamma, T.Cast(ACCUM, 0))

    @T.macro
    def gate(Gate, gamma, g_s, G_f, G_s, w_s, bb, s0, bh, m, s_end):
        T.copy(Gate[bb, s0 + shift : s0 + shift + C, bh // box * box : bh // box * box + box], g_s)
        T.clear(G_f)
        for r in T.Parallel(C):
            for t in T.serial(C):
                G_f[r] += T.if_then_else(
                    (t < r) if reverse else (t <= r), value(g_s, gamma, bh, t, s0, m, s_end), T.Cast(ACCUM, 0)
                )
        T.copy(G_f, G_s)
        for r in T.Parallel(C):
            if reverse:  # E_last = E_{C-1} + g'_{C-1}
                w_s[0, r] = T.exp2((G_s[C - 1] + value(g_s, gamma, bh, C - 1, s0, m, s_end) - G_s[r]) * LOG2E)
                w_s[1, r] = T.if_then_else(r < m, T.exp2(G_s[r] * LOG2E), T.Cast(ACCUM, 0))
            else:
                w_s[0, r] = T.exp2(G_s[r] * LOG2E)
                w_s[1, r] = T.if_then_else(r < m, T.exp2((G_s[C - 1] - G_s[r]) * LOG2E), T.Cast(ACCUM, 0))

    return gate


def gated_chunk_loop_macro(
    *,
    chunk: int,
    heads: int,
    group_size: int,
    dk: int,
    block_dv: int,
    scale: float,
    num_stages: int,
    dtype: str,
    arch: str,
    packed: bool = False,
    reverse: bool = False,
    out_dtype: str | None = None,
):
    """The chunk loop of one block, as a ``@T.macro`` ``chunk_loop(Q, K, V, O, Gate, Gamma,
    bb, bh, v0, s_begin, n_chunks, s_end, State, Final, bbh, start=None, final=None)``:
    ``n_chunks`` chunks from row ``s_begin`` (tokens up to ``s_end``) of batch ``bb``, head
    ``bh`` (q and k of group ``bh // group_size``), value columns ``v0 : v0 + block_dv``.
    ``State``/``Final``: None, or the fp32 ``[N*H, 1, DK, DV]`` states in and out, row
    ``bbh``. ``start``/``final``: None (always), or functions of no arguments returning the
    run-time condition under which the state is read (else zero) and written
    (``packed_gated_fwd``'s pool): the read a masked load, as ``kernel.scalar_decay``'s.
    ``reverse``: the recurrence runs backwards in time (the module's docstring), the state
    read is the one after ``s_end``, the state written the one at ``s_begin``.
    ``out_dtype``: O's dtype and its tile's (default ``dtype``)."""
    mma = mma_for(arch, rows=chunk)
    C, accum = chunk, ACCUM
    o_dtype = dtype if out_dtype is None else out_dtype
    store = store_macro(chunk=C, block_dv=block_dv, packed=packed)
    gate = gate_weights_macro(chunk=C, heads=heads, reverse=reverse)
    carry = 0 if reverse else C - 1  # the query weight that is the carry's

    def chunk_start(s_begin, c, n_chunks):
        """The first token of the ``c``-th chunk walked: reversed, the chunks last to first."""
        return s_begin + ((n_chunks - 1 - c) if reverse else c) * C

    @T.macro
    def chunk_loop(
        Q, K, V, O, Gate, Gamma, bb, bh, v0, s_begin, n_chunks, s_end, State, Final, bbh,
        start=None, final=None,
    ):  # fmt: skip
        Q_s, K_s, Kw_s, V_s = staged_tiles(chunk=C, dk=dk, block_dv=block_dv, dtype=dtype)
        S_s = T.alloc_shared([dk, block_dv], dtype)
        O_s = T.alloc_shared([C, block_dv], o_dtype)
        A_cast = T.alloc_shared([C, C], dtype)
        g_s = T.alloc_shared([C, gate_box(heads)], accum)  # the chunk's gates (gate_weights_macro)
        G_f = T.alloc_fragment([C], accum)  # their scan G, summed in registers
        G_s = T.alloc_shared([C], accum)  # and shared
        w_s = T.alloc_shared([2, C], accum)  # exp(G_r); exp(G_last - G_r) (reversed: see gate)
        gamma = T.alloc_local([1], accum)  # the head's log-decay, added to each of its gates

        S_f = T.alloc_fragment([dk, block_dv], accum)  # carried across chunks
        acc_o = T.alloc_fragment([C, block_dv], accum)
        A = T.alloc_fragment([C, C], accum)
        touch = T.alloc_local([1], dtype) if mma.asynchronous else None  # see the MMAs' waits
        bg = bh // group_size  # the group whose q and k this head reads
        gamma[0] = Gamma[bh]
        if State is None:
            T.clear(S_f)
        elif start is not None:  # a run-time condition: a masked load, no branch
            for i, j in T.Parallel(dk, block_dv):
                S_f[i, j] = T.if_then_else(start(), State[bbh, 0, i, v0 + j], T.Cast(accum, 0))
        else:
            T.copy(State[bbh, 0, :, v0 : v0 + block_dv], S_f)

        for c in T.Pipelined(n_chunks, num_stages=num_stages):
            s0 = chunk_start(s_begin, c, n_chunks)
            m = T.max(T.min(C, s_end - s0), 0)  # tokens of this chunk: C but at the end
            T.copy(Q[bb, s0 : s0 + C, bg, :], Q_s)
            T.copy(K[bb, s0 : s0 + C, bg, :], K_s)
            T.copy(V[bb, s0 : s0 + C, bh, v0 : v0 + block_dv], V_s)
            gate(Gate, gamma[0], g_s, G_f, G_s, w_s, bb, s0, bh, m, s_end)
            T.copy(S_f, S_s)  # the state before this chunk
            mma.gemm(Q_s, K_s, A, transpose_B=True, clear_accum=True)  # [C, DK] @ [DK, C]
            mma.gemm(Q_s, S_s, acc_o, clear_accum=True)  # [C, DK] @ [DK, bDV]
            mma.wait(1)  # A is ready and K_s free; Q @ S may still run
            for r, d in T.Parallel(C, dk):
                Kw_s[r, d] = K_s[r, d] * w_s[1, r]
            if reverse:  # only where i <= j < m: the other exponents are > 0, the rows past m not ours
                for i, j in T.Parallel(C, C):
                    A_cast[i, j] = T.if_then_else(
                        (j >= i) & (j < m),
                        A[i, j] * (scale * T.exp2((G_s[j] - G_s[i]) * LOG2E)),
                        T.Cast(accum, 0),
                    )
            else:
                for i, j in T.Parallel(C, C):  # the mask only where j <= i: its other exponents are > 0
                    A_cast[i, j] = T.if_then_else(
                        j <= i, A[i, j] * (scale * T.exp2((G_s[i] - G_s[j]) * LOG2E)), T.Cast(accum, 0)
                    )
            mma.wait(0)
            if mma.asynchronous:
                touch[0] = Q_s[0, 0]
            for i, j in T.Parallel(C, block_dv):
                acc_o[i, j] *= scale * w_s[0, i]
            mma.gemm(A_cast, V_s, acc_o)  # [C, C] @ [C, bDV]
            for i, j in T.Parallel(dk, block_dv):
                S_f[i, j] *= w_s[0, carry]  # exp(G_last); reversed, exp(E_last)
            mma.gemm(Kw_s, V_s, S_f, transpose_A=True)  # [DK, C] @ [C, bDV]
            mma.wait(1)  # the outputs are ready; the state update may still run
            T.copy(acc_o, O_s)
            store(O_s, O, bb, s0, m, bh, v0)
            mma.wait(0)
            if mma.asynchronous:
                touch[0] = V_s[0, 0]
        if Final is not None and final is not None:  # a run-time condition, evaluated here
            if final():
                T.copy(S_f, Final[bbh, 0, :, v0 : v0 + block_dv])
        elif Final is not None:
            T.copy(S_f, Final[bbh, 0, :, v0 : v0 + block_dv])

    return chunk_loop


def gated_loop_knobs(*, heads: int, groups: int, dk: int, block_dv: int, **knobs) -> dict:
    """The knobs ``gated_chunk_loop_macro`` takes from a prim func's, H a multiple of G."""
    if heads % groups:
        raise ValueError(f"heads: expected a multiple of groups = {groups}, got {heads}")
    return dict(heads=heads, group_size=heads // groups, dk=dk, block_dv=block_dv, **knobs)


def gated_fwd(
    *,
    heads: int,
    groups: int,
    dk: int,
    dv: int,
    dtype: str,
    chunk: int,
    block_dv: int,
    num_stages: int,
    threads: int,
    arch: str,
    scale: float = 1.0,
    initial_state: bool = False,
    final_state: bool = False,
    batch: int | None = None,
    seqlen: int | None = None,
    reverse: bool = False,
    out_dtype: str | None = None,
):
    """Return the ``@T.prim_func`` ``main(Q, K, V, Gate, Gamma, H0, O, HT)`` of the gated
    forward for one config: one kernel for every B and S where ``arch`` has symbolic shapes,
    else for the ``batch`` and ``seqlen`` given.

    Q, K: ``[B, S, G, DK]``; V, O: ``[B, S, H, DV]``, H = ``heads`` a multiple of G =
    ``groups``; all of ``dtype``. Gate: fp32 ``[B, S, H]``, the log-gates (<= 0). Gamma: fp32
    ``[H]``, each head's log-decay added to its gates (zeros where the call has none). H0, HT:
    fp32 ``[B*H, 1, DK, DV]``, the state before the first token (read only with
    ``initial_state``) and after the last (written only with ``final_state``).

    ``reverse``: the recurrence runs backwards in time (the module's docstring), H0 the
    state after the last token, HT the state at the first. ``out_dtype``: O's dtype
    (default ``dtype``; ``"float32"`` for the backward's dq and dk).
    """
    chunk_loop = gated_chunk_loop_macro(
        **gated_loop_knobs(
            heads=heads, groups=groups, dk=dk, block_dv=block_dv, chunk=chunk, scale=scale,
            num_stages=num_stages, dtype=dtype, arch=arch, reverse=reverse, out_dtype=out_dtype,
        )
    )  # fmt: skip
    o_dtype = dtype if out_dtype is None else out_dtype
    if get_arch(arch).symbolic_shapes:
        batch, seqlen = T.dynamic("batch, seqlen")
    elif batch is None or seqlen is None:
        raise ValueError(f"{arch} compiles per shape: batch and seqlen are needed")
    state_shape = [batch * heads, 1, dk, dv]

    @T.prim_func
    def main(
        Q: T.Tensor([batch, seqlen, groups, dk], dtype), K: T.Tensor([batch, seqlen, groups, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype), Gate: T.Tensor([batch, seqlen, heads], ACCUM),
        Gamma: T.Tensor([heads], ACCUM), H0: T.Tensor(state_shape, ACCUM),
        O: T.Tensor([batch, seqlen, heads, dv], o_dtype), HT: T.Tensor(state_shape, ACCUM),
    ):  # fmt: skip
        # bbh = b * H + h: the r heads of a group run in adjacent blocks (their q and k from L2)
        with T.Kernel(T.ceildiv(dv, block_dv), batch * heads, threads=threads) as (bv, bbh):
            bb = bbh // heads
            bh = bbh % heads
            start, end = H0 if initial_state else None, HT if final_state else None
            chunk_loop(
                Q,
                K,
                V,
                O,
                Gate,
                Gamma,
                bb,
                bh,
                bv * block_dv,
                0,
                T.ceildiv(seqlen, chunk),
                seqlen,
                start,
                end,
                bbh,
            )

    return main


def packed_gated_fwd(
    *,
    heads: int,
    groups: int,
    dk: int,
    dv: int,
    dtype: str,
    chunk: int,
    block_dv: int,
    num_stages: int,
    threads: int,
    arch: str,
    scale: float = 1.0,
    initial_state: bool = False,
    final_state: bool = False,
    slots: str | None = None,
    reverse: bool = False,
    out_dtype: str | None = None,
):
    """Return the ``@T.prim_func`` ``main(Q, K, V, Gate, Gamma, H0, O, HT, CuSeqlens)`` of
    the gated forward over packed sequences (fla's ``cu_seqlens``), as
    ``kernel.scalar_decay.packed_fwd`` runs a constant decay: one kernel for every token
    count T and sequence count N, both read from the tensors at launch.

    Q, K: ``[1, T, G, DK]``; V, O: ``[1, T, H, DV]``; Gate: fp32 ``[1, T, H]``; Gamma: fp32
    ``[H]`` (zeros where the call has none). CuSeqlens: int32 ``[N + 1]``, offsets from 0 to T,
    strictly increasing. H0, HT: fp32 ``[N*H, 1, DK, DV]`` (any rows where the call has no
    state in, or out). One block per (value slice, sequence, head) walks its sequence from
    its first token; a chunk's tile reaches into the next sequence, whose rows are kept out
    of the gates' scan (their gate reads as 0, never loaded), of the state (their key
    weight is 0) and of the output (only the first m rows are stored).

    With ``slots`` (the dtype of the slot indices), ``main(Q, K, V, Gate, Gamma, Pool, O,
    CuSeqlens, Slots, FromPool)``: each sequence's states in a server's pool, read and
    written in place, as ``kernel.scalar_decay.pool_fwd`` serves a constant decay. Pool: fp32
    ``[P*H, 1, DK, DV]`` (a pool ``[P, H, DK, DV]`` viewed so, P symbolic); Slots: ``[N]``,
    the pool row of each sequence; FromPool: int8 ``[N]``. Sequence n, head h starts from
    ``Pool[Slots[n]*H + h]`` where ``FromPool[n]`` is nonzero and its slot lies in ``[0,
    P)``, else from zero, and its final state is written there where the slot lies in ``[0,
    P)``: a slot outside (-1, padding) touches no state, its outputs still computed. Each
    block reads its own ``[DK, block_dv]`` slice before the chunk loop and writes it after:
    distinct slots never race (a slot repeated within a call does).

    ``reverse``: each sequence's recurrence runs backwards in time (the module's
    docstring): H0 (or the pool's slot) is the state after its last token, HT (or the slot)
    the state at its first; a chunk's gates, shifted by one token, stop at the sequence's
    end, so no gate of the next sequence enters. ``out_dtype``: O's dtype (default
    ``dtype``).
    """
    if not get_arch(arch).symbolic_shapes:
        raise ValueError(f"{arch} compiles per shape: the packed gated forward needs symbolic shapes")
    if slots is not None and (initial_state or final_state):
        raise ValueError("a pool call's states are the pool's: no initial_state or final_state")
    chunk_loop = gated_chunk_loop_macro(
        **gated_loop_knobs(
            heads=heads, groups=groups, dk=dk, block_dv=block_dv, chunk=chunk, scale=scale,
            num_stages=num_stages, dtype=dtype, arch=arch, packed=True, reverse=reverse,
            out_dtype=out_dtype,
        )
    )  # fmt: skip
    tokens, offsets = T.dynamic("tokens, offsets")
    # Each parameter its own buffer: an annotation shared by two parameters makes them one.
    qk = lambda: T.Tensor([1, tokens, groups, dk], dtype)  # noqa: E731
    vo = lambda: T.Tensor([1, tokens, heads, dv], dtype)  # noqa: E731
    out = lambda: T.Tensor([1, tokens, heads, dv], dtype if out_dtype is None else out_dtype)  # noqa: E731

    @T.macro
    def sequence(Q, K, V, O, Gate, Gamma, CuSeqlens, bv, bnh, State, Final, row, start=None, final=None):
        """Block (bv, bnh)'s walk of sequence ``bnh // H``, head ``bnh % H``."""
        bos = CuSeqlens[bnh // heads]
        eos = CuSeqlens[bnh // heads + 1]
        n_chunks = T.ceildiv(eos - bos, chunk)
        chunk_loop(
            Q, K, V, O, Gate, Gamma, 0, bnh % heads, bv * block_dv, bos, n_chunks, eos, State, Final, row,
            start, final,
        )  # fmt: skip

    if slots is None:
        h0_rows, ht_rows = T.dynamic("h0_rows, ht_rows")

        @T.prim_func
        def main(
            Q: qk(), K: qk(), V: vo(), Gate: T.Tensor([1, tokens, heads], ACCUM),
            Gamma: T.Tensor([heads], ACCUM), H0: T.Tensor([h0_rows, 1, dk, dv], ACCUM), O: out(),
            HT: T.Tensor([ht_rows, 1, dk, dv], ACCUM), CuSeqlens: T.Tensor([offsets], "int32"),
        ):  # fmt: skip
            # bnh = n * H + h: the r heads of a group run in adjacent blocks (their q and k from L2)
            with T.Kernel(T.ceildiv(dv, block_dv), (offsets - 1) * heads, threads=threads) as (bv, bnh):
                start, end = H0 if initial_state else None, HT if final_state else None
                sequence(Q, K, V, O, Gate, Gamma, CuSeqlens, bv, bnh, start, end, bnh)

        return main

    sequences, rows = T.dynamic("sequences, pool_rows")

    def kept(slot):
        """Whether ``slot`` lies in the pool: else no state is read or written."""
        return (slot >= 0) & (slot < T.Cast("int64", rows // heads))

    @T.prim_func
    def main(
        Q: qk(), K: qk(), V: vo(), Gate: T.Tensor([1, tokens, heads], ACCUM),
        Gamma: T.Tensor([heads], ACCUM), Pool: T.Tensor([rows, 1, dk, dv], ACCUM), O: out(),
        CuSeqlens: T.Tensor([offsets], "int32"), Slots: T.Tensor([sequences], slots),
        FromPool: T.Tensor([sequences], "int8"),
    ):  # fmt: skip
        with T.Kernel(T.ceildiv(dv, block_dv), (offsets - 1) * heads, threads=threads) as (bv, bnh):
            n = bnh // heads
            slot = T.Cast("int64", Slots[n])
            row = T.Cast("int32", slot) * heads + bnh % heads  # used only where kept
            sequence(
                Q, K, V, O, Gate, Gamma, CuSeqlens, bv, bnh, Pool, Pool, row,
                lambda: kept(slot) & (FromPool[n] != 0), lambda: kept(slot),
            )  # fmt: skip

    return main


def prim_func(problem: Problem, config: KernelConfig, call: Call, *, arch: str):
    """The ``@T.prim_func`` of ``kernel.gated`` for a per-token gate's ``problem`` (its
    heads and groups, head sizes and dtype; its batch and sequence length where ``arch``
    compiles per shape), ``config``'s knobs and ``call``'s scale, states and packing
    (``packed_gated_fwd``, a pool's slots too). Every kernel adds a
    per-head log-decay ``Gamma`` (zeros where a call has none) to the gates, so that one
    compiled kernel serves calls with a decay beside ``g`` and without (``warmup``'s).
    A call of the backward's passes (``kernel.gated_build.PassCall``) runs backwards in time
    where it asks and writes float32. ``ValueError`` for the constant decay's fused dk and
    dv pass (``Call.dkdv``), which the gated kernel does not run."""
    if call.dkdv:
        raise ValueError("the gated kernel has no fused dk and dv pass: Call.dkdv")
    p, c = problem, config
    knobs = dict(
        heads=p.heads, groups=p.qk_heads, dk=p.dk, dv=p.dv, dtype=p.dtype, chunk=c.chunk, block_dv=c.block_dv,
        num_stages=c.num_stages, threads=c.threads, arch=arch, scale=call.scale,
        initial_state=call.initial_state, final_state=call.final_state, reverse=call.reverse,
        out_dtype=getattr(call, "out_dtype", None),
    )  # fmt: skip
    if call.packed:  # a pool's slots too
        return packed_gated_fwd(**knobs, slots=call.slots)
    return gated_fwd(**knobs, batch=p.batch, seqlen=p.seqlen)
