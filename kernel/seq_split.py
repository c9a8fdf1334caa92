"""Sequence-split variant (issue 5, experimental): the sequence is cut into ``segments``
pieces of ``L`` tokens that run in parallel blocks, with a cheap carry between them.

1. ``segment_states``: grid ``(DV / bDV, B*H, P)``. Each block runs the state recurrence
   over its segment from a zero state and writes the segment's end state (fp32).
2. ``segment_outputs``: same grid. Each block first forms its incoming state
   ``S_in[p] = sum_{j<p} alpha^(L*(p-1-j)) * states[j]`` (every weight <= 1; the states
   are a few MB and sit in L2), then runs the single-pass kernel's chunk loop over its
   segment starting from ``S_in[p]``.

K and V are read twice (once per kernel), so the traffic is 1.5x the single-pass
kernel's: this pays only where B*H is too small to fill the GPU (reports/h200/README.md).
``kernel.scalar_decay`` remains the tuned kernel; the outputs kernel runs the same chunk
step (``kernel.scalar_decay.chunk_step_macro``).
"""

import math
from dataclasses import dataclass
from typing import Any

import tilelang.language as T
import torch

from kernel.build import TORCH_DTYPES, check_tensor
from kernel.config import KernelConfig, Problem
from kernel.scalar_decay import chunk_step_macro, fp32_constant


def segment_length(seqlen: int, chunk: int, segments: int) -> int:
    """Tokens per segment: a multiple of ``chunk``, so only the last segment is ragged."""
    return math.ceil(math.ceil(seqlen / segments) / chunk) * chunk


def split_fwd(
    *,
    batch: int,
    heads: int,
    seqlen: int,
    dk: int,
    dv: int,
    alpha: float,
    chunk: int,
    block_dv: int,
    num_stages: int,
    threads: int,
    segments: int,
    dtype: str = "float16",
    scores: str = "smem",
):
    """Return ``(states_func, outputs_func)``: the two ``@T.prim_func`` of the variant.

    ``states_func(K, V, States)``: States ``[B*H, P, DK, DV]`` fp32, the end state of each
    segment from a zero start. ``outputs_func(Q, K, V, States, O)``.
    """
    if scores != "smem":
        raise ValueError(
            f"the sequence-split variant keeps its scores in shared memory, got scores={scores!r}"
        )
    C, accum = chunk, "float32"
    L = segment_length(seqlen, C, segments)
    P = math.ceil(seqlen / L)
    chunks_per_segment = L // C
    log2_alpha = math.log2(alpha)
    alpha_pow_c, alpha_pow_l = fp32_constant(alpha**C), fp32_constant(alpha**L)
    chunk_step = chunk_step_macro(chunk=C, dk=dk, block_dv=block_dv, alpha=alpha)

    @T.prim_func
    def states_func(
        K: T.Tensor([batch, seqlen, heads, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype),
        States: T.Tensor([batch * heads, P, dk, dv], accum),
    ):
        with T.Kernel(T.ceildiv(dv, block_dv), batch * heads, P, threads=threads) as (bv, bbh, bp):
            bb = bbh // heads
            bh = bbh % heads
            v0 = bv * block_dv
            K_s = T.alloc_shared([C, dk], dtype)
            Kw_s = T.alloc_shared([C, dk], dtype)
            V_s = T.alloc_shared([C, block_dv], dtype)
            S_f = T.alloc_fragment([dk, block_dv], accum)
            T.clear(S_f)
            for c in T.Pipelined(chunks_per_segment, num_stages=num_stages):
                s0 = bp * L + c * C
                T.copy(K[bb, s0 : s0 + C, bh, :], K_s)
                T.copy(V[bb, s0 : s0 + C, bh, v0 : v0 + block_dv], V_s)
                for r, d in T.Parallel(C, dk):
                    Kw_s[r, d] = K_s[r, d] * T.exp2(log2_alpha * T.Cast(accum, C - 1 - r))
                for i, j in T.Parallel(dk, block_dv):
                    S_f[i, j] *= alpha_pow_c
                T.gemm(Kw_s, V_s, S_f, transpose_A=True)  # [DK, C] @ [C, bDV] -> [DK, bDV]
            T.copy(S_f, States[bbh, bp, :, v0 : v0 + block_dv])

    @T.prim_func
    def outputs_func(
        Q: T.Tensor([batch, seqlen, heads, dk], dtype),
        K: T.Tensor([batch, seqlen, heads, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype),
        States: T.Tensor([batch * heads, P, dk, dv], accum),
        O: T.Tensor([batch, seqlen, heads, dv], dtype),
    ):
        with T.Kernel(T.ceildiv(dv, block_dv), batch * heads, P, threads=threads) as (bv, bbh, bp):
            bb = bbh // heads
            bh = bbh % heads
            v0 = bv * block_dv
            Q_s = T.alloc_shared([C, dk], dtype)
            K_s = T.alloc_shared([C, dk], dtype)
            Qw_s = T.alloc_shared([C, dk], dtype)
            Kw_s = T.alloc_shared([C, dk], dtype)
            V_s = T.alloc_shared([C, block_dv], dtype)
            S_s = T.alloc_shared([dk, block_dv], dtype)
            O_s = T.alloc_shared([C, block_dv], dtype)
            A_cast = T.alloc_shared([C, C], dtype)
            S_f = T.alloc_fragment([dk, block_dv], accum)
            acc_o = T.alloc_fragment([C, block_dv], accum)
            A = T.alloc_fragment([C, C], accum)
            Gamma = T.alloc_fragment([C, C], accum)
            for i, j in T.Parallel(C, C):
                Gamma[i, j] = T.if_then_else(
                    j <= i, T.exp2(log2_alpha * T.Cast(accum, i - j)), T.Cast(accum, 0)
                )
            # Carry in: S_in[p] = alpha^L * S_in[p-1] + states[p-1], from S_in[0] = 0.
            T.clear(S_f)
            for j in T.serial(bp):
                for i, d in T.Parallel(dk, block_dv):
                    S_f[i, d] = S_f[i, d] * alpha_pow_l + States[bbh, j, i, v0 + d]
            for c in T.Pipelined(chunks_per_segment, num_stages=num_stages):
                chunk_step(
                    Q,
                    K,
                    V,
                    O,
                    bb,
                    bh,
                    v0,
                    bp * L + c * C,
                    Q_s,
                    K_s,
                    Qw_s,
                    Kw_s,
                    V_s,
                    S_s,
                    O_s,
                    S_f,
                    acc_o,
                    A,
                    A_cast,
                    Gamma,
                )

    return states_func, outputs_func


@dataclass(frozen=True)
class SplitKernel:
    """``kernel(q, k, v) -> o`` for the sequence-split variant (shapes as ``ScalarDecayKernel``)."""

    problem: Problem
    config: KernelConfig
    segments: int
    states_kernel: Any
    outputs_kernel: Any

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, out: torch.Tensor | None = None):
        p = self.problem
        dtype = TORCH_DTYPES[p.dtype]
        qk, vo = (p.batch, p.seqlen, p.heads, p.dk), (p.batch, p.seqlen, p.heads, p.dv)
        for name, tensor, shape in (("q", q, qk), ("k", k, qk), ("v", v, vo)):
            check_tensor(name, tensor, shape, dtype)
        out = torch.empty(vo, dtype=dtype, device=q.device) if out is None else out
        check_tensor("out", out, vo, dtype)
        L = segment_length(p.seqlen, self.config.chunk, self.segments)
        states = torch.empty(p.batch * p.heads, math.ceil(p.seqlen / L), p.dk, p.dv, device=q.device)
        self.states_kernel(k, v, states)
        self.outputs_kernel(q, k, v, states, out)
        return out


def build_split(
    problem: Problem, config: KernelConfig, segments: int, *, arch: str | None = None
) -> SplitKernel:
    """Compile both kernels of the variant (for ``arch``, default: the current GPU's)."""
    import tilelang

    from kernel.build import cuda_arch

    config.check_fits(problem)
    if segments < 1:
        raise ValueError(f"segments must be >= 1, got {segments}")
    funcs = split_fwd(**problem.to_dict(), **config.to_dict(), segments=segments)
    target = {"kind": "cuda", "arch": arch or cuda_arch()}
    states_kernel, outputs_kernel = (tilelang.compile(f, target=target) for f in funcs)
    return SplitKernel(problem, config, segments, states_kernel, outputs_kernel)


# (problem, config, segments) cases of the first GPU check, and the single-pass configs
# they are compared with in the same run.
CHECKS = [
    (Problem(2, 3, 300, 64, 64, 0.9), KernelConfig(64, 32, 2, 128), 3),
    (Problem(1, 2, 1000, 128, 128, 0.5, "bfloat16"), KernelConfig(64, 64, 1, 256), 4),
    *[
        (Problem(1, 8, 32768, 128, 128, 0.99), KernelConfig(64, b, s, 256), n)
        for b, s in ((32, 1), (64, 1), (128, 2))
        for n in (8, 16)
    ],
    *[
        (Problem(2, 16, 16384, 128, 128, 0.99), KernelConfig(64, b, 1, 256), n)
        for b in (64, 128)
        for n in (4, 8)
    ],
]
SINGLE_PASS = [KernelConfig(64, 32, 1, 256), KernelConfig(64, 128, 2, 256)]


def _compile(case: tuple[Problem, KernelConfig, int, str]) -> str | None:
    problem, config, segments, arch = case
    try:
        if segments:
            build_split(problem, config, segments, arch=arch)
        else:
            from kernel.resources import compile_kernel

            compile_kernel(problem, config, arch)
    except Exception as exc:  # reported per case
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    return None


def main() -> int:
    """Compile the checks in parallel, then check each against reference C and time it."""
    import json
    import multiprocessing
    import os
    import sys
    from concurrent.futures import ProcessPoolExecutor

    import refs
    from kernel.build import build, cuda_arch
    from kernel.timing import bench
    from kernel.validate import random_qkv

    if not torch.cuda.is_available():
        print("kernel.seq_split's check needs a CUDA device; none is visible", file=sys.stderr)
        return 2
    arch = cuda_arch()
    singles = {(p, c, 0) for p, _, _ in CHECKS[2:] for c in SINGLE_PASS}
    cases = [*CHECKS, *sorted(singles, key=str)]
    with ProcessPoolExecutor(os.cpu_count(), mp_context=multiprocessing.get_context("spawn")) as pool:
        errors = list(pool.map(_compile, [(*case, arch) for case in cases]))
    for (problem, config, segments), error in zip(cases, errors):
        row = {
            "shape": [problem.batch, problem.heads, problem.seqlen, problem.dk],
            "alpha": problem.alpha,
            "dtype": problem.dtype,
            "config": config.to_dict(),
            "segments": segments,
        }
        if error:
            print(json.dumps(row | {"error": error}), flush=True)
            continue
        kern = build_split(problem, config, segments) if segments else build(problem, config)
        q, k, v = random_qkv(problem, seed=1)
        out = torch.full_like(v, float("nan"))
        kern(q, k, v, out=out)
        torch.cuda.synchronize()
        ref = refs.kernel_mimic(q, k, v, problem.alpha, config.chunk)
        row |= {"rel_l2": refs.rel_l2(out, ref), "nan_count": int(out.isnan().sum())}
        if row["rel_l2"] < 2e-2:
            row |= bench(lambda: kern(q, k, v, out=out)).to_dict()
        print(json.dumps(row), flush=True)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
