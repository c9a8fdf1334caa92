"""Experiment (issue 5; not part of the tool):
the split's states pass cut into equal pieces that may cross segment boundaries.

The tool's states kernel gives each segment but the last one block per (lane, segment):
96 blocks at 2x16x16384 with 4 segments, on 132 SMs that each hold one such block (384
threads at 168 registers), so a quarter of the GPU idles for its 62 us (README, "What the
open goal would take"). Here the ``(P - 1) * L / C`` chunks the states pass reads per lane
are cut into ``W`` equal pieces, ``W`` a divisor chosen so that the grid is nearest one
block per SM with ``P - 1 <= W <= 2 (P - 1)``: each piece is at most a segment long, so it
crosses at most one segment boundary. Each block walks its piece last chunk first with the
absolute weights ``alpha^(distance to its segment's end)``; crossing a boundary it stores
the partial state of the later segment (slot 0) and starts again from zero; at its end it
stores the partial of its first segment (slot 1). The carry then adds, for each segment,
the partials of the pieces that overlap it (at most three) before the prefix
``States[p] = alpha^L * States[p - 1] + E[p - 1]``. The outputs kernel is the tool's.

    python3 reports/h200/states_balanced.py cpu      # plan, fp64 check of the plan, compile
    source .gpu/setup.sh && cd reports/h200 && python3 states_balanced.py > $OUT/states_balanced.jsonl

On the GPU: the whole call with either states pass checked against reference C
(NaN-prefilled output), each states pass (with its carry) timed alone, then the whole
calls taking turns (``modes.time_modes``).
"""

import math
import sys
from dataclasses import dataclass

import tilelang
import tilelang.language as T
import torch
from modes import SPLIT_CHECKED, SPLIT_TIMED

from kernel import KernelConfig, Problem
from kernel.build import ScalarDecayKernel, states_buffer
from kernel.scalar_decay import fp32_constant
from tuner.space import H200_SMS

TIMED, CHECKED = SPLIT_TIMED, SPLIT_CHECKED
CARRY_THREADS = 128


@dataclass(frozen=True)
class Plan:
    segments: int  # P
    chunks_per_segment: int
    pieces: int  # W, per lane
    chunks_per_piece: int  # m
    contributors: tuple[tuple[int, ...], ...]  # per segment 0..P-2: flat slots w * 2 + k


def plan(problem: Problem, config: KernelConfig, sms: int = H200_SMS) -> Plan:
    """Cut the states pass of one (problem, split config) into pieces (see the module)."""
    L, P = config.segment_length(problem.seqlen), config.segment_count(problem.seqlen)
    cps = L // config.chunk
    n = (P - 1) * cps
    lanes = problem.batch * problem.heads * (problem.dv // config.block_dv)
    fits = [w for w in range(P - 1, 2 * (P - 1) + 1) if n % w == 0]
    pieces = min(fits, key=lambda w: (abs(lanes * w - sms), w))
    m = n // pieces
    contributors: list[list[int]] = [[] for _ in range(P - 1)]
    for w in range(pieces):
        lo, hi = (w * m) // cps, ((w + 1) * m - 1) // cps
        if hi != lo:
            contributors[hi].append(2 * w)  # slot 0: the later segment, stored on crossing
        contributors[lo].append(2 * w + 1)  # slot 1: the first segment, stored at the end
    by_formula = [
        [2 * w + ((w * m) // cps == q) for w in range((q * cps) // m, ((q + 1) * cps - 1) // m + 1)]
        for q in range(P - 1)
    ]
    assert [sorted(c) for c in contributors] == by_formula, (contributors, by_formula)  # = the carry's
    assert all(1 <= len(c) <= 3 for c in contributors), contributors
    return Plan(P, cps, pieces, m, tuple(map(tuple, contributors)))


def _per_lane(x: torch.Tensor) -> torch.Tensor:
    """``[B, S, H, D]`` -> fp64 ``[B*H, S, D]``."""
    b, s, h, d = x.shape
    return x.double().permute(0, 2, 1, 3).reshape(b * h, s, d)


def reference_states(k: torch.Tensor, v: torch.Tensor, alpha: float, L: int, P: int) -> torch.Tensor:
    """fp64 ``[B*H, P, DK, DV]``: the state entering each segment, by the plain recurrence."""
    kk, vv = _per_lane(k), _per_lane(v)
    lanes, s, dk = kk.shape
    out = torch.zeros(lanes, P, dk, vv.shape[-1], dtype=torch.float64)
    state = torch.zeros(lanes, dk, vv.shape[-1], dtype=torch.float64)
    for t in range(min(s, (P - 1) * L)):
        state = alpha * state + kk[:, t, :, None] * vv[:, t, None, :]
        if (t + 1) % L == 0:
            out[:, (t + 1) // L] = state
    return out


def planned_states(k: torch.Tensor, v: torch.Tensor, alpha: float, chunk: int, pl: Plan) -> torch.Tensor:
    """fp64 emulation of the two kernels below: pieces walked last chunk first with
    absolute weights, partials in slots, then the carry over each segment's contributors."""
    kk, vv = _per_lane(k), _per_lane(v)
    lanes, dk, dv = kk.shape[0], kk.shape[-1], vv.shape[-1]
    L, cps, m = pl.chunks_per_segment * chunk, pl.chunks_per_segment, pl.chunks_per_piece
    slots = torch.zeros(lanes, 2 * pl.pieces, dk, dv, dtype=torch.float64)
    for w in range(pl.pieces):
        acc = torch.zeros(lanes, dk, dv, dtype=torch.float64)
        for c in range(m):
            g = (w + 1) * m - 1 - c
            q = g // cps
            rows = torch.arange(g * chunk, (g + 1) * chunk)
            weights = alpha ** ((q + 1) * L - 1 - rows).double()
            acc += torch.einsum("bsd,bse->bde", kk[:, rows] * weights[None, :, None], vv[:, rows])
            if g % cps == 0 and c != m - 1:
                slots[:, 2 * w] = acc
                acc = torch.zeros_like(acc)
        slots[:, 2 * w + 1] = acc
    states = torch.zeros(lanes, pl.segments, dk, dv, dtype=torch.float64)
    for p in range(1, pl.segments):
        states[:, p] = alpha**L * states[:, p - 1] + slots[:, list(pl.contributors[p - 1])].sum(1)
    return states


def prim_funcs(problem: Problem, config: KernelConfig, pl: Plan):
    """``(states(K, V, Partials), carry(Partials, States))`` for one plan."""
    batch, heads, seqlen, dk, dv = problem.batch, problem.heads, problem.seqlen, problem.dk, problem.dv
    dtype, accum, C, block_dv = problem.dtype, "float32", config.chunk, config.block_dv
    P, cps, W, m = pl.segments, pl.chunks_per_segment, pl.pieces, pl.chunks_per_piece
    log2_alpha = math.log2(problem.alpha)
    alpha_pow_l = fp32_constant(problem.alpha ** (cps * C))

    @T.prim_func
    def states(
        K: T.Tensor([batch, seqlen, heads, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype),
        Partials: T.Tensor([batch * heads, 2 * W, dk, dv], accum),
    ):
        with T.Kernel(T.ceildiv(dv, block_dv), batch * heads, W, threads=config.threads) as (bv, bbh, w):
            bb, bh, v0 = bbh // heads, bbh % heads, bv * block_dv
            K_s = T.alloc_shared([C, dk], dtype)
            Kw_s = T.alloc_shared([C, dk], dtype)
            V_s = T.alloc_shared([C, block_dv], dtype)
            S_f = T.alloc_fragment([dk, block_dv], accum)
            T.clear(S_f)
            for c in T.Pipelined(m, num_stages=config.num_stages):
                g = (w + 1) * m - 1 - c  # this chunk; its segment is g // cps
                T.copy(K[bb, g * C : g * C + C, bh, :], K_s)
                T.copy(V[bb, g * C : g * C + C, bh, v0 : v0 + block_dv], V_s)
                for r, d in T.Parallel(C, dk):
                    distance = C * ((g // cps + 1) * cps - g) - 1 - r  # to the segment's end
                    Kw_s[r, d] = K_s[r, d] * T.exp2(log2_alpha * T.Cast(accum, distance))
                T.gemm(Kw_s, V_s, S_f, transpose_A=True)
                if g % cps == 0:
                    if c != m - 1:  # the piece goes on in the segment before: flush
                        T.copy(S_f, Partials[bbh, 2 * w, :, v0 : v0 + block_dv])
                        T.clear(S_f)
            T.copy(S_f, Partials[bbh, 2 * w + 1, :, v0 : v0 + block_dv])

    @T.prim_func
    def carry(
        Partials: T.Tensor([batch * heads, 2 * W, dk, dv], accum),
        States: T.Tensor([batch * heads, P, dk, dv], accum),
    ):
        with T.Kernel(T.ceildiv(dk * dv, CARRY_THREADS), batch * heads, threads=CARRY_THREADS) as (be, bbh):
            e = be * CARRY_THREADS + T.get_thread_binding()
            S_l = T.alloc_local([P], accum)
            if e < dk * dv:
                i, j = e // dv, e % dv
                # every load first (unrolled: the slots are constants), then the prefix
                for p in T.unroll(1, P):
                    S_l[p] = 0
                    for x in T.unroll(3):  # the pieces overlapping segment p - 1 (Plan.slots)
                        w = ((p - 1) * cps) // m + x
                        if w <= (p * cps - 1) // m:
                            first = T.if_then_else((w * m) // cps == p - 1, 1, 0)
                            S_l[p] = S_l[p] + Partials[bbh, 2 * w + first, i, j]
                S_l[0] = 0
                States[bbh, 0, i, j] = S_l[0]
                for p in T.unroll(1, P):
                    S_l[p] = S_l[p - 1] * alpha_pow_l + S_l[p]
                    States[bbh, p, i, j] = S_l[p]

    return states, carry


class BalancedSplit:
    """``kernel(q, k, v, out=None) -> o``: the balanced states pass, its carry, and the
    outputs kernel of ``tool`` (the tool's split kernel), for ``check`` and ``time_modes``."""

    def __init__(self, tool: ScalarDecayKernel, arch: str, sms: int = H200_SMS):
        self.problem, self.config, self.outputs = tool.problem, tool.config, tool.compiled[2]
        self.plan = plan(self.problem, self.config, sms)
        target = {"kind": "cuda", "arch": arch}
        self.states, self.carry = (
            tilelang.compile(f, target=target) for f in prim_funcs(self.problem, self.config, self.plan)
        )

    def states_and_carry(self, k: torch.Tensor, v: torch.Tensor, states: torch.Tensor) -> None:
        """The states entering each segment, into ``states`` (``kernel.build.states_buffer``)."""
        p = self.problem
        partials = torch.empty(p.batch * p.heads, 2 * self.plan.pieces, p.dk, p.dv, device=states.device)
        self.states(k, v, partials)
        self.carry(partials, states)

    def __call__(self, q, k, v, *, out=None):
        if out is None:
            out = torch.empty_like(v)
        states = states_buffer(self.problem, self.config, q.device)
        self.states_and_carry(k, v, states)
        self.outputs(q, k, v, states, out)
        return out


def cpu() -> int:
    """The plans, the plan's math against the plain recurrence in fp64, and a compile."""
    from modes import emit

    for problem, config in TIMED + CHECKED:
        pl = plan(problem, config)
        lanes = problem.batch * problem.heads * (problem.dv // config.block_dv)
        row = {"shape": f"{problem.batch}x{problem.heads}x{problem.seqlen}", "config": config.label}
        row |= {"pieces": pl.pieces, "chunks_per_piece": pl.chunks_per_piece, "blocks": lanes * pl.pieces}
        row |= {"tool_blocks": lanes * (pl.segments - 1), "contributors": pl.contributors}
        # the plan's math on a small problem with this config's segment and piece structure
        seqlen, gen = pl.segments * pl.chunks_per_segment * config.chunk, torch.Generator().manual_seed(0)
        k = torch.randn(1, seqlen, 2, 16, generator=gen, dtype=torch.float64)
        v = torch.randn(1, seqlen, 2, 8, generator=gen, dtype=torch.float64)
        L = pl.chunks_per_segment * config.chunk
        want = reference_states(k, v, problem.alpha, L, pl.segments)
        got = planned_states(k, v, problem.alpha, config.chunk, pl)
        row["plan_rel_err"] = ((got - want).norm() / want.norm()).item()
        funcs = prim_funcs(problem, config, pl)
        compiled = [tilelang.compile(f, target={"kind": "cuda", "arch": "sm_90a"}) for f in funcs]
        row["compiled"] = [len(c.get_kernel_source()) > 0 for c in compiled]
        emit(row)
    return 0


def _states_pass(kern, k: torch.Tensor, v: torch.Tensor, states: torch.Tensor) -> None:
    """The states kernel and the carry of ``kern`` (the tool's split or ``BalancedSplit``)."""
    if isinstance(kern, BalancedSplit):
        kern.states_and_carry(k, v, states)
    else:
        kern.compiled[0](k, v, states)
        kern.compiled[1](states)


def gpu() -> int:
    from functools import partial

    from modes import check_kept, emit, inputs_for, time_modes

    from kernel import build
    from kernel.build import cuda_arch
    from kernel.timing import bench
    from tuner.bench import copy_bandwidth

    copy_rate = copy_bandwidth()
    emit({"kind": "copy", "bytes_per_s": copy_rate})
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kernels = {}
    for problem, config in TIMED + CHECKED:
        tool = build(problem, config)
        for mode, kern in (("tool", tool), ("balanced", BalancedSplit(tool, cuda_arch(), sms))):
            check_kept(kernels, mode, kern, TIMED, seed=51)
    inputs = inputs_for(kernels, seed=52)
    for (mode, p, config), kern in kernels.items():
        _, k, v = inputs[p]
        ms = bench(partial(_states_pass, kern, k, v, states_buffer(p, config))).median_ms
        shape = f"{p.batch}x{p.heads}x{p.seqlen}"
        emit(
            {
                "kind": "states_and_carry",
                "mode": mode,
                "shape": shape,
                "config": config.label,
                "median_ms": ms,
            }
        )
    time_modes(kernels, inputs, kind="whole", copy_rate=copy_rate)
    return 0


if __name__ == "__main__":
    sys.exit(cpu() if sys.argv[1:] == ["cpu"] else gpu())
