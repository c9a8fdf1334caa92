"""The backward pass (issue 18), first kernel: each chunk's gradients from its states.

Not yet run on a GPU, and not yet behind ``decay_attention``: it compiles for every
architecture of ``kernel.arch`` (``tests/test_backward.py``), and its GPU test checks it
against reference E (``refs.chunked_backward``) when a device runs it.

Given, for chunk ``c`` of one (batch, head), the state before it ``S_prev`` and the
gradient ``dS`` of the state after it (both fp32 ``[DK, DV]``, from a states pass and a
reverse states pass), the chunk's gradients need nothing from any other chunk, so one
block per (chunk, batch * head) computes them (docs/design.md, section 6), with
``dPs = scale * (dO V^T) * Gamma`` and ``As = scale * (q K^T) * Gamma``::

    dq = scale * (dO S_prev^T) * w_query + dPs K
    dk = dPs^T q + (V dS^T) * w_decay
    dv = As^T dO + (K * w_decay) dS

Every weight is ``exp2(log2(alpha) * k)`` with ``k >= 0``, evaluated only where it is
used, as in the forward; accumulation is fp32, the MMA operands fp16 or bf16.
"""

import tilelang.language as T

from kernel.mma import mma_for


def chunk_grads(
    *,
    batch: int,
    heads: int,
    seqlen: int,
    dk: int,
    dv: int,
    chunk: int,
    threads: int,
    dtype: str = "float16",
    scale: float = 1.0,
    arch: str,
):
    """The ``@T.prim_func`` ``main(Q, K, V, DO, Decay, States, DStates, DQ, DK, DV)``.

    Q, K, DQ, DK: ``[B, S, H, DK]``; V, DO, DV: ``[B, S, H, DV]``; of ``dtype``. Decay:
    fp32 ``[H]``. States, DStates: fp32 ``[B*H, N, DK, DV]``, N = ceil(S / chunk): the
    state before chunk n and the gradient of the state after it. Rows past S are read as
    zero and not written (the tile copies are bounds-checked).
    """
    C, accum = chunk, "float32"
    n_chunks = (seqlen + C - 1) // C
    mma = mma_for(arch)

    @T.prim_func
    def main(
        Q: T.Tensor([batch, seqlen, heads, dk], dtype),
        K: T.Tensor([batch, seqlen, heads, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype),
        DO: T.Tensor([batch, seqlen, heads, dv], dtype),
        Decay: T.Tensor([heads], accum),
        States: T.Tensor([batch * heads, n_chunks, dk, dv], accum),
        DStates: T.Tensor([batch * heads, n_chunks, dk, dv], accum),
        DQ: T.Tensor([batch, seqlen, heads, dk], dtype),
        DK: T.Tensor([batch, seqlen, heads, dk], dtype),
        DV: T.Tensor([batch, seqlen, heads, dv], dtype),
    ):
        with T.Kernel(n_chunks, batch * heads, threads=threads) as (c, bbh):
            bb, bh, s0 = bbh // heads, bbh % heads, c * C
            Q_s = T.alloc_shared([C, dk], dtype)
            K_s = T.alloc_shared([C, dk], dtype)
            Kw_s = T.alloc_shared([C, dk], dtype)  # K rows r < m, * alpha^(m-1-r)
            V_s = T.alloc_shared([C, dv], dtype)
            DO_s = T.alloc_shared([C, dv], dtype)
            S_s = T.alloc_shared([dk, dv], dtype)
            dS_s = T.alloc_shared([dk, dv], dtype)
            dP_s = T.alloc_shared([C, C], dtype)  # scale * (dO V^T) * Gamma
            A_s = T.alloc_shared([C, C], dtype)  # scale * (q K^T) * Gamma
            dP = T.alloc_fragment([C, C], accum)
            A = T.alloc_fragment([C, C], accum)
            dQ = T.alloc_fragment([C, dk], accum)
            dK = T.alloc_fragment([C, dk], accum)
            dV = T.alloc_fragment([C, dv], accum)
            lg = T.alloc_local([1], accum)  # log2(alpha) of this head, <= 0
            lg[0] = T.log2(Decay[bh])
            m = T.min(C, seqlen - s0)  # the chunk's real rows

            T.copy(Q[bb, s0 : s0 + C, bh, :], Q_s)
            T.copy(K[bb, s0 : s0 + C, bh, :], K_s)
            T.copy(V[bb, s0 : s0 + C, bh, :], V_s)
            T.copy(DO[bb, s0 : s0 + C, bh, :], DO_s)
            for i, j in T.Parallel(dk, dv):
                S_s[i, j] = States[bbh, c, i, j]
                dS_s[i, j] = DStates[bbh, c, i, j]
            for r, d in T.Parallel(C, dk):
                Kw_s[r, d] = T.if_then_else(
                    r < m, K_s[r, d] * T.exp2(lg[0] * T.Cast(accum, m - 1 - r)), T.Cast(dtype, 0)
                )

            # The scores and their gradient, masked by scale * Gamma where j <= i.
            mma.gemm(DO_s, V_s, dP, transpose_B=True, clear_accum=True)
            mma.gemm(Q_s, K_s, A, transpose_B=True, clear_accum=True)
            mma.wait(0)
            for i, j in T.Parallel(C, C):
                weight = T.if_then_else(
                    j <= i, scale * T.exp2(lg[0] * T.Cast(accum, i - j)), T.Cast(accum, 0)
                )
                dP_s[i, j] = dP[i, j] * weight
                A_s[i, j] = A[i, j] * weight

            # dq = scale * (dO S_prev^T) * w_query + dPs K
            mma.gemm(DO_s, S_s, dQ, transpose_B=True, clear_accum=True)
            mma.wait(0)
            for i, d in T.Parallel(C, dk):
                dQ[i, d] *= scale * T.exp2(lg[0] * T.Cast(accum, i + 1))
            mma.gemm(dP_s, K_s, dQ)
            # dk = (V dS^T) * w_decay + dPs^T q
            mma.gemm(V_s, dS_s, dK, transpose_B=True, clear_accum=True)
            mma.wait(0)
            for r, d in T.Parallel(C, dk):
                dK[r, d] *= T.if_then_else(r < m, T.exp2(lg[0] * T.Cast(accum, m - 1 - r)), T.Cast(accum, 0))
            mma.gemm(dP_s, Q_s, dK, transpose_A=True)
            # dv = (K * w_decay) dS + As^T dO
            mma.gemm(Kw_s, dS_s, dV, clear_accum=True)
            mma.gemm(A_s, DO_s, dV, transpose_A=True)
            mma.wait(0)
            T.copy(dQ, DQ[bb, s0 : s0 + C, bh, :])
            T.copy(dK, DK[bb, s0 : s0 + C, bh, :])
            T.copy(dV, DV[bb, s0 : s0 + C, bh, :])

    return main
