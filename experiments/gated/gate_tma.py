"""A variant of ``kernel.gated``'s dense forward that takes the gates transposed, ``GateT [B, H,
S]`` fp32, so that a chunk's 64 gates are one contiguous row that ``T.copy`` can load by TMA
with Q, K and V, where the product's ``Gate [B, S, H]`` is read by 64 scalar loads of
stride H that the producer waits on before it issues the TMAs (experiments/gated/README.md,
"Where a chunk waits"). The rows past S come zero-filled by TMA; the scan masks rows past
``m`` as the product does. Everything else is ``kernel.gated.gated_chunk_loop_macro``'s.

    python3 experiments/gated/gate_tma.py > /tmp/gate_tma.cu   # the CUDA, compiled for sm_90a on a CPU
    python3 experiments/gated/gate_tma.py 4 > /tmp/gate_box.cu   # with box=4: g [B, S, H] as the op has it

``bench.py --variants`` times it beside the product's kernel (the op would pay one transpose
of g, ``B x S x H x 4`` bytes, per call).
"""

import tilelang.language as T

from kernel.gated import LOG2E
from kernel.mma import mma_for
from kernel.scalar_decay import ACCUM, staged_tiles, store_macro


def gated_fwd_t(
    *, heads, groups, dk, dv, dtype, chunk, block_dv, num_stages, threads, arch, scale=1.0, final_state=False,
    box: int = 0,
):  # fmt: skip
    """``kernel.gated.gated_fwd``'s ``main(Q, K, V, GateT, Gamma, H0, O, HT)``, GateT ``[B, H, S]``;
    with ``box`` (4: 16 bytes, TMA's least inner box), the product's gate ``[B, S, H]`` instead,
    loaded by TMA as a ``[C, box]`` box of heads ``box * (h // box)`` onwards (H a multiple of
    ``box``), of which the scan reads head h's column."""
    C, accum, r = chunk, ACCUM, heads // groups
    mma = mma_for(arch, rows=C)
    store = store_macro(chunk=C, block_dv=block_dv, packed=False)
    batch, seqlen = T.dynamic("batch, seqlen")
    state_shape = [batch * heads, 1, dk, dv]
    gate_shape = [batch, seqlen, heads] if box else [batch, heads, seqlen]

    @T.prim_func
    def main(
        Q: T.Tensor([batch, seqlen, groups, dk], dtype), K: T.Tensor([batch, seqlen, groups, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype), GateT: T.Tensor(gate_shape, ACCUM),
        Gamma: T.Tensor([heads], ACCUM), H0: T.Tensor(state_shape, ACCUM),
        O: T.Tensor([batch, seqlen, heads, dv], dtype), HT: T.Tensor(state_shape, ACCUM),
    ):  # fmt: skip
        with T.Kernel(T.ceildiv(dv, block_dv), batch * heads, threads=threads) as (bv, bbh):
            bb = bbh // heads
            bh = bbh % heads
            bg = bh // r
            v0 = bv * block_dv
            Q_s, K_s, Kw_s, V_s = staged_tiles(chunk=C, dk=dk, block_dv=block_dv, dtype=dtype)
            S_s = T.alloc_shared([dk, block_dv], dtype)
            O_s = T.alloc_shared([C, block_dv], dtype)
            A_cast = T.alloc_shared([C, C], dtype)
            g_s = T.alloc_shared([C, box] if box else [C], accum)
            G_f = T.alloc_fragment([C], accum)
            G_s = T.alloc_shared([C], accum)
            w_s = T.alloc_shared([2, C], accum)
            S_f = T.alloc_fragment([dk, block_dv], accum)
            acc_o = T.alloc_fragment([C, block_dv], accum)
            A = T.alloc_fragment([C, C], accum)
            touch = T.alloc_local([1], dtype) if mma.asynchronous else None
            T.clear(S_f)
            for c in T.Pipelined(T.ceildiv(seqlen, C), num_stages=num_stages):
                s0 = c * C
                m = T.min(C, seqlen - s0)
                T.copy(Q[bb, s0 : s0 + C, bg, :], Q_s)
                T.copy(K[bb, s0 : s0 + C, bg, :], K_s)
                T.copy(V[bb, s0 : s0 + C, bh, v0 : v0 + block_dv], V_s)
                if box:
                    T.copy(GateT[bb, s0 : s0 + C, bh // box * box : bh // box * box + box], g_s)
                else:
                    T.copy(GateT[bb, bh, s0 : s0 + C], g_s)
                T.clear(G_f)
                for i in T.Parallel(C):
                    for t in T.serial(C):
                        gate = g_s[t, bh % box] if box else g_s[t]
                        G_f[i] += T.if_then_else((t <= i) & (t < m), gate + Gamma[bh], T.Cast(accum, 0))
                T.copy(G_f, G_s)
                for i in T.Parallel(C):
                    w_s[0, i] = T.exp2(G_s[i] * LOG2E)
                    w_s[1, i] = T.if_then_else(i < m, T.exp2((G_s[C - 1] - G_s[i]) * LOG2E), T.Cast(accum, 0))
                T.copy(S_f, S_s)
                mma.gemm(Q_s, K_s, A, transpose_B=True, clear_accum=True)
                mma.gemm(Q_s, S_s, acc_o, clear_accum=True)
                mma.wait(1)
                for i, d in T.Parallel(C, dk):
                    Kw_s[i, d] = K_s[i, d] * w_s[1, i]
                for i, j in T.Parallel(C, C):
                    A_cast[i, j] = T.if_then_else(
                        j <= i, A[i, j] * (scale * T.exp2((G_s[i] - G_s[j]) * LOG2E)), T.Cast(accum, 0)
                    )
                mma.wait(0)
                if mma.asynchronous:
                    touch[0] = Q_s[0, 0]
                for i, j in T.Parallel(C, block_dv):
                    acc_o[i, j] *= scale * w_s[0, i]
                mma.gemm(A_cast, V_s, acc_o)
                for i, j in T.Parallel(dk, block_dv):
                    S_f[i, j] *= w_s[0, C - 1]
                mma.gemm(Kw_s, V_s, S_f, transpose_A=True)
                mma.wait(1)
                T.copy(acc_o, O_s)
                store(O_s, O, bb, s0, m, bh, v0)
                mma.wait(0)
                if mma.asynchronous:
                    touch[0] = V_s[0, 0]
            if final_state:
                T.copy(S_f, HT[bbh, 0, :, v0 : v0 + block_dv])

    return main


def main() -> None:
    import sys

    from kernel.probe import compile_funcs

    box = int(sys.argv[1]) if sys.argv[1:] else 0
    func = gated_fwd_t(
        heads=16, groups=16, dk=128, dv=128, dtype="float16", chunk=64, block_dv=128, num_stages=1,
        threads=256, arch="sm_90a", scale=128**-0.5, final_state=True, box=box,
    )  # fmt: skip
    (kernel,) = compile_funcs([func], "sm_90a")
    print(kernel.get_kernel_source())


if __name__ == "__main__":
    main()
