"""Experiment, not part of the tool: the sequence split in one persistent kernel with a
chained carry, measured against the three-kernel split (``kernel.seq_split``) by
``reports/h200/chained.py``. It is correct on the H200 and slower at every shape measured
(reports/h200/README.md, "a one-kernel carry"), so the tuner does not offer it.

``workers`` blocks (one per SM, all resident) walk the tiles ``(segment, lane)``, lane =
(batch*head, DV block), in segment-major order: tile ``w * workers + worker`` in wave
``w``. A tile is one ``T.Pipelined`` loop of ``2n`` chunks over its segment:

* chunks ``0 .. n-1``: the state recurrence over the segment's K, V from zero. Q's first
  chunk is loaded again and again (an L2 hit) so that every iteration issues the same
  copies: TileLang 0.1.15 warp-specialises one pipelined loop per kernel, and two
  loops over the same buffers fail its layout inference;
* at chunk ``n``: one elected thread spins (acquire) until ``Flags[lane] >= segment``, a
  named barrier, every thread loads the state entering the segment from
  ``Ring[(segment - 1) % 2, lane]`` and stores ``alpha^L * S_prev + S_local`` into
  ``Ring[segment % 2, lane]``; a barrier, then one release add to ``Flags[lane]``. Two ring
  slots suffice: a slot is rewritten only after its reader has published;
* chunks ``n .. 2n-1``: the outputs from ``S_prev``, as the single-pass kernel's loop.

A tile waits only on a smaller tile, owned by a resident block that reaches it, so the
kernel cannot deadlock while every worker is resident (hence one block per SM, taken from
the device). The wait is a ``for`` loop with ``T.loop_break``: a ``while`` loop inside the
pipelined loop fails TileLang's warp-specialisation pass ("Cannot find role for stmt").
``wait=False`` drops the wait (wrong outputs past the first segment) to time the rest.
"""

import math

import tilelang.language as T

from kernel.config import KernelConfig, Problem
from kernel.scalar_decay import fp32_constant
from tuner.space import H200_SMS


def prim_func(problem: Problem, config: KernelConfig, workers: int = H200_SMS, wait: bool = True):
    config.check_fits(problem)
    batch, heads, seqlen, dk, dv = problem.batch, problem.heads, problem.seqlen, problem.dk, problem.dv
    alpha, dtype = problem.alpha, problem.dtype
    C, block_dv, num_stages, threads, accum = (
        config.chunk,
        config.block_dv,
        config.num_stages,
        config.threads,
        "float32",
    )
    L, P = config.segment_length(seqlen), config.segment_count(seqlen)
    n = L // C
    n_dv = dv // block_dv
    lanes = batch * heads * n_dv
    tiles = P * lanes
    workers = min(workers, tiles)
    waves = math.ceil(tiles / workers)
    log2_alpha = math.log2(alpha)
    alpha_pow_c, alpha_pow_l = fp32_constant(alpha**C), fp32_constant(alpha**L)

    @T.prim_func
    def main(
        Q: T.Tensor([batch, seqlen, heads, dk], dtype),
        K: T.Tensor([batch, seqlen, heads, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype),
        Ring: T.Tensor([2, lanes, dk, block_dv], accum),
        Flags: T.Tensor([lanes], "int32"),
        O: T.Tensor([batch, seqlen, heads, dv], dtype),
    ):
        with T.Kernel(workers, threads=threads) as wid:
            Q_s = T.alloc_shared([C, dk], dtype)
            K_s = T.alloc_shared([C, dk], dtype)
            Kw_s = T.alloc_shared([C, dk], dtype)
            V_s = T.alloc_shared([C, block_dv], dtype)
            S_s = T.alloc_shared([dk, block_dv], dtype)
            O_s = T.alloc_shared([C, block_dv], dtype)
            S_f = T.alloc_fragment([dk, block_dv], accum)
            acc_o = T.alloc_fragment([C, block_dv], accum)
            A = T.alloc_fragment([C, C], accum)
            A_cast = T.alloc_shared([C, C], dtype)
            Gamma = T.alloc_fragment([C, C], accum)
            for i, j in T.Parallel(C, C):
                Gamma[i, j] = T.if_then_else(
                    j <= i, T.exp2(log2_alpha * T.Cast(accum, i - j)), T.Cast(accum, 0)
                )
            for w in T.serial(waves):
                tile = w * workers + wid
                if tile < tiles:
                    seg = tile // lanes
                    lane = tile % lanes
                    bbh = lane // n_dv
                    bb = bbh // heads
                    bh = bbh % heads
                    v0 = (lane % n_dv) * block_dv
                    T.clear(S_f)
                    for c in T.Pipelined(2 * n, num_stages=num_stages):
                        # chunks 0..n-1: the segment's state from zero; n..2n-1: its outputs.
                        s0 = seg * L + (c % n) * C
                        sq = seg * L + T.max(c - n, 0) * C  # Q's first chunk (an L2 hit) until the outputs
                        T.copy(Q[bb, sq : sq + C, bh, :], Q_s)
                        T.copy(K[bb, s0 : s0 + C, bh, :], K_s)
                        T.copy(V[bb, s0 : s0 + C, bh, v0 : v0 + block_dv], V_s)
                        for r, d in T.Parallel(C, dk):
                            Kw_s[r, d] = K_s[r, d] * T.exp2(log2_alpha * T.Cast(accum, C - 1 - r))
                        if c == n:
                            if wait and seg > 0:
                                if T.shuffle_elect(threads):
                                    for _ in T.serial(1 << 30):
                                        if T.atomic_load(Flags[lane], memory_order="acquire") >= seg:
                                            T.loop_break()
                                T.sync_threads(1, threads)
                            for i, j in T.Parallel(dk, block_dv):
                                prev = T.if_then_else(
                                    seg > 0, Ring[(seg + 1) % 2, lane, i, j], T.Cast(accum, 0)
                                )
                                if seg < P - 1:
                                    Ring[seg % 2, lane, i, j] = prev * alpha_pow_l + S_f[i, j]
                                S_f[i, j] = prev
                            if seg < P - 1:
                                T.sync_threads(1, threads)
                                if T.shuffle_elect(threads):
                                    T.atomic_add(Flags[lane], 1, memory_order="release")
                        if c >= n:
                            T.copy(S_f, S_s)
                            T.gemm(Q_s, S_s, acc_o, clear_accum=True)
                            for i, j in T.Parallel(C, block_dv):
                                acc_o[i, j] *= T.exp2(log2_alpha * T.Cast(accum, i + 1))
                            T.gemm(Q_s, K_s, A, transpose_B=True, clear_accum=True)
                            for i, j in T.Parallel(C, C):
                                A_cast[i, j] = A[i, j] * Gamma[i, j]
                            T.gemm(A_cast, V_s, acc_o)
                            T.copy(acc_o, O_s)
                            T.copy(O_s, O[bb, s0 : s0 + C, bh, v0 : v0 + block_dv])
                        for i, j in T.Parallel(dk, block_dv):
                            S_f[i, j] *= alpha_pow_c
                        T.gemm(Kw_s, V_s, S_f, transpose_A=True)

    return main


class ChainedKernel:
    """``kernel(q, k, v, out=None) -> o``; the flags are zeroed on every call."""

    def __init__(self, problem: Problem, config: KernelConfig, compiled):
        self.problem, self.config, self.compiled = problem, config, compiled
        self.lanes = problem.batch * problem.heads * (problem.dv // config.block_dv)

    def __call__(self, q, k, v, *, out=None):
        import torch

        p = self.problem
        if out is None:
            out = torch.empty(p.batch, p.seqlen, p.heads, p.dv, dtype=q.dtype, device=q.device)
        ring = torch.empty(2, self.lanes, p.dk, self.config.block_dv, dtype=torch.float32, device=q.device)
        flags = torch.zeros(self.lanes, dtype=torch.int32, device=q.device)
        self.compiled(q, k, v, ring, flags, out)
        return out


def build_chained(
    problem: Problem, config: KernelConfig, *, compile_only: bool = False, wait: bool = True
) -> ChainedKernel:
    """Compile for the current GPU (one worker per SM), or only for sm_90a with the
    H200's 132 workers (``compile_only``, no GPU needed)."""
    import tilelang

    if compile_only:
        workers, arch = H200_SMS, "sm_90a"
    else:
        import torch

        from kernel.build import cuda_arch

        workers, arch = torch.cuda.get_device_properties(0).multi_processor_count, cuda_arch()
    func = prim_func(problem, config, workers, wait)
    compiled = tilelang.compile(func, target={"kind": "cuda", "arch": arch})
    return ChainedKernel(problem, config, compiled)
