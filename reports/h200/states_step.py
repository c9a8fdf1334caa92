"""Experiment (issue 5; not part of the tool): where the split's states kernel spends its
time, and states kernels that might spend less.

At 2x16x16384 (4 segments) the outputs kernel now runs near its memory schedule's floor,
so the states kernel and the carry (66 us against 49 us for the states pass's bytes at
the copy rate) are the whole gap to issue 5's 1.5x. Re-cutting its work over more SMs
(``states_balanced.py``) did not help there, so this times the states kernel alone in
variants that each change one thing:

* ``tool``: ``kernel.seq_split``'s states kernel, the config's chunk, bDV and threads;
* ``cfg C/bDV/stages/threads``: the same kernel built for another config (the states
  layout does not depend on it): fewer threads or a narrower bDV mean fewer registers, so
  more than one block may fit on an SM;
* ``stream``: the same grid and pipeline with only a sum of the tiles (no weights, no
  MMA; wrong states): the memory schedule's floor;
* ``noweight``: the MMA on K itself (no weights; wrong states): what the weights cost;
* ``transposed``: ``S^T += V^T @ Kw`` with one warpgroup per 64 state rows, as the
  outputs kernel's transposed step updates its state, written back transposed.

    python3 reports/h200/states_step.py cpu      # compile every variant, ptxas registers/spills
    source .gpu/setup.sh && cd reports/h200 && python3 states_step.py > $OUT/states_step.jsonl

Rows: ``copy``; ``check`` (each correct variant's states against the tool's, fp32, on
NaN-prefilled buffers; the timing-only variants are marked); ``states`` (each states
kernel alone, L2 flushed, against the floor of the bytes it reads and writes); ``carry``
(the tool's carry alone); ``whole`` (the correct variants' states kernel with the tool's
carry and outputs kernels, checked against reference C, taking turns over three rounds).
"""

import logging
import math
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import tilelang
import tilelang.language as T
from modes import B1H8, B2H16, B4H16

from kernel import KernelConfig, Problem
from kernel import seq_split as ss
from kernel.build import states_buffer

TIMED = [
    (B2H16, KernelConfig(64, 128, 3, 256, segments=4)),
    (B1H8, KernelConfig(64, 128, 3, 256, segments=16)),
    (B4H16, KernelConfig(64, 128, 3, 256, segments=2)),
]
OTHER_CONFIGS = [(64, 64, 3, 128), (64, 128, 3, 128), (64, 64, 4, 256), (128, 128, 2, 256)]
TIMING_ONLY = ("stream", "noweight")


def custom_states(problem: Problem, config: KernelConfig, variant: str):
    """The ``stream``, ``noweight`` and ``transposed`` states kernels (see the module)."""
    batch, heads, seqlen, dk, dv = problem.batch, problem.heads, problem.seqlen, problem.dk, problem.dv
    dtype, accum, C, block_dv = problem.dtype, "float32", config.chunk, config.block_dv
    L, P = config.segment_length(seqlen), config.segment_count(seqlen)
    cps = L // C
    log2_alpha = math.log2(problem.alpha)
    rows = T.GemmWarpPolicy.FullRow

    @T.prim_func
    def states(
        K: T.Tensor([batch, seqlen, heads, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype),
        States: T.Tensor([batch * heads, P, dk, dv], accum),
    ):
        with T.Kernel(T.ceildiv(dv, block_dv), batch * heads, P - 1, threads=config.threads) as (bv, bbh, bp):
            bb, bh, v0 = bbh // heads, bbh % heads, bv * block_dv
            K_s = T.alloc_shared([C, dk], dtype)
            Kw_s = T.alloc_shared([C, dk], dtype)
            V_s = T.alloc_shared([C, block_dv], dtype)
            if variant == "stream":
                acc_k = T.alloc_fragment([C, dk], accum)
                acc_v = T.alloc_fragment([C, block_dv], accum)
                T.clear(acc_k)
                T.clear(acc_v)
            elif variant == "transposed":
                ST_f = T.alloc_fragment([block_dv, dk], accum)
                touch = T.alloc_local([1], dtype)
                T.clear(ST_f)
            else:
                S_f = T.alloc_fragment([dk, block_dv], accum)
                T.clear(S_f)
            for c in T.Pipelined(cps, num_stages=config.num_stages):
                s0 = bp * L + (cps - 1 - c) * C
                T.copy(K[bb, s0 : s0 + C, bh, :], K_s)
                T.copy(V[bb, s0 : s0 + C, bh, v0 : v0 + block_dv], V_s)
                if variant == "stream":
                    for r, d in T.Parallel(C, dk):
                        acc_k[r, d] += K_s[r, d]
                    for r, j in T.Parallel(C, block_dv):
                        acc_v[r, j] += V_s[r, j]
                elif variant == "noweight":
                    T.gemm(K_s, V_s, S_f, transpose_A=True)
                else:
                    for r, d in T.Parallel(C, dk):
                        Kw_s[r, d] = K_s[r, d] * T.exp2(log2_alpha * T.Cast(accum, C * c + C - 1 - r))
                    T.wgmma_gemm(V_s, Kw_s, ST_f, transpose_A=True, policy=rows)  # [bDV, DK]
                    T.wait_wgmma(0)
                    touch[0] = V_s[0, 0]  # hand V_s back after the wait (chunk_loop_macro)
            if variant == "stream":
                for r, j in T.Parallel(C, block_dv):
                    States[bbh, bp + 1, r, v0 + j] = acc_v[r, j] + acc_k[r, j % dk]
            elif variant == "transposed":
                for j, d in T.Parallel(block_dv, dk):
                    States[bbh, bp + 1, d, v0 + j] = ST_f[j, d]
            else:
                T.copy(S_f, States[bbh, bp + 1, :, v0 : v0 + block_dv])

    return states


def _tool_states(problem: Problem, config: KernelConfig):
    return ss.prim_funcs(problem, config)[0]


def variants(problem: Problem, config: KernelConfig) -> dict[str, Callable[[], Any]]:
    """``{name: builder of its states prim_func}`` for one timed case."""
    out = {"tool": partial(_tool_states, problem, config)}
    for chunk, block_dv, stages, threads in OTHER_CONFIGS:
        other = KernelConfig(chunk, block_dv, stages, threads, segments=config.segments)
        if other.segment_length(problem.seqlen) == config.segment_length(problem.seqlen):
            out[f"cfg {other.label}"] = partial(_tool_states, problem, other)
    for name in ("stream", "noweight", "transposed"):
        out[name] = partial(custom_states, problem, config, name)
    return out


def _compile(case_index: int, name: str, arch: str):
    problem, config = TIMED[case_index]
    return tilelang.compile(variants(problem, config)[name](), target={"kind": "cuda", "arch": arch})


def _ptxas(case_index: int, name: str, arch: str) -> dict:
    """Compile in a child process (fills TileLang's disk cache); the kernel's ptxas figures."""
    from kernel.resources import _ptxas, parse_ptxas

    ok, log = _ptxas(_compile(case_index, name, arch).get_kernel_source(), arch)
    return {"case": case_index, "name": name} | (parse_ptxas(log) if ok else {"error": log[-300:]})


def compile_all(arch: str) -> list[tuple[int, str]]:
    """Every (case, variant), compiled in spawned processes so the parent's compiles hit
    the cache."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    from modes import emit

    jobs = [(i, name) for i, case in enumerate(TIMED) for name in variants(*case)]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(os.cpu_count(), mp_context=ctx) as pool:
        for row in pool.map(partial(_ptxas, arch=arch), *zip(*jobs)):
            emit({"kind": "compiled", "shape": _shape(TIMED[row["case"]][0])} | row)
    return jobs


def _shape(p: Problem) -> str:
    return f"{p.batch}x{p.heads}x{p.seqlen}"


def gpu() -> int:
    from modes import SplitCall, check_kept, emit, inputs_for, time_modes

    from kernel import build
    from kernel.build import cuda_arch
    from kernel.timing import bench
    from kernel.validate import random_qkv
    from tuner.bench import copy_bandwidth

    arch = cuda_arch()
    jobs = compile_all(arch)
    copy_rate = copy_bandwidth()
    emit({"kind": "copy", "bytes_per_s": copy_rate})
    kernels = {}
    for i, (problem, config) in enumerate(TIMED):
        tool = build(problem, config)
        k, v = random_qkv(problem, seed=61)[1:]
        want = states_buffer(problem, config).fill_(float("nan"))
        tool.compiled[0](k, v, want)
        floor_ms = (
            1e3
            * (k.numel() + v.numel())
            * k.element_size()
            * (1 - 1 / config.segment_count(problem.seqlen))
            / copy_rate
        )
        for name in [n for j, n in jobs if j == i]:
            kern = _compile(i, name, arch)
            got = states_buffer(problem, config).fill_(float("nan"))
            kern(k, v, got)
            rel = ((got[:, 1:] - want[:, 1:]).norm() / want[:, 1:].norm()).item()
            row = {"kind": "check", "mode": name, "shape": _shape(problem), "config": config.label}
            emit(row | {"states_rel": rel, "timing_only": name in TIMING_ONLY})
            ms = bench(partial(kern, k, v, got)).median_ms
            emit(row | {"kind": "states", "median_ms": ms, "x_kv_floor": ms / floor_ms})
            if name not in TIMING_ONLY and rel < 1e-4:
                check_kept(kernels, name, SplitCall(tool, states=kern), TIMED, seed=62)
        carry_ms = bench(partial(tool.compiled[1], want)).median_ms
        emit({"kind": "carry", "shape": _shape(problem), "config": config.label, "median_ms": carry_ms})
    time_modes(kernels, inputs_for(kernels, seed=63), kind="whole", copy_rate=copy_rate)
    return 0


def cpu() -> int:
    compile_all("sm_90a")
    return 0


logging.getLogger("tilelang").setLevel(logging.WARNING)  # its INFO lines go to stdout

if __name__ == "__main__":
    sys.exit(cpu() if sys.argv[1:] == ["cpu"] else gpu())
