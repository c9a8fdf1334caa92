"""A prototype: the single-pass kernel with a thread-block cluster per (batch, head), its
CTAs splitting DV and sharing each chunk's Q and K by TMA multicast (issue 30).

Why: at 4x16x8192 (128/128) an unsplit kernel has 64 blocks of block_dv 128 for 132 SMs,
so the rule splits the sequence, and the split reads K and V twice; at block_dv 64 two
blocks per head read Q and K twice. Either way the bytes cap the forward near 2.2x fla's
(``../outofbox/bounds.txt``). A cluster of ``DV / 64`` CTAs reads Q and K once (its first
CTA multicasts them into every CTA's shared memory) and V in slices: 128 blocks, the
floor's bytes.

TileLang 0.1.15 does not warp-specialise a multicast copy (its role scheduler skips it:
"cluster multicast backpressure cannot be expressed yet"), so the pipeline is written by
hand (README.md). The consumer's chunk step is ``kernel.scalar_decay``'s transposed step
(``transposed_chunk_loop_macro``: ``S^T`` in registers) with its ``Direction``, so the
kernel takes what the product's single-pass kernel takes: a state in and out, any S, the
recurrence forward or reversed. ``cluster_fwd`` returns a ``@T.prim_func`` of
``scalar_decay_fwd``'s signature, so the product's ``ScalarDecayKernel`` launches it and
``kernel.validate.check`` checks it against reference C.

    python3 experiments/multicast/cluster_fwd.py 4x16x8192:128x128 4x8x8192:128x256 ...
    python3 experiments/multicast/cluster_fwd.py --cpu   # compile for sm_90a, no GPU
"""

import json
import sys
from pathlib import Path

import tilelang
import tilelang.language as T

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from kernel.config import Call, KernelConfig, Problem, whole_chunks  # noqa: E402
from kernel.scalar_decay import ACCUM, Direction, alpha_power, decay_mask_macro, sizes, tensor_types  # noqa: E402

BLOCK_DV = 64  # each CTA's slice of the state; one consumer warpgroup owns its 64 rows of S^T
CHUNK = 64


def config(stages: int) -> KernelConfig:
    """The product's config of one CTA of the cluster (its knobs: ``kernel.config``)."""
    return KernelConfig(CHUNK, BLOCK_DV, stages, 128, "smem", 1)


def cluster_fwd(problem: Problem, call: Call, *, stages: int, arch: str = "sm_90a"):
    """``main(Q, K, V, Decay, H0, O, HT)`` as ``kernel.scalar_decay.scalar_decay_fwd``
    declares it, run by clusters of ``DV / 64`` CTAs."""
    heads, dk, dv, dtype = problem.heads, problem.dk, problem.dv, problem.dtype
    C, scale, time = CHUNK, call.scale, Direction(call.reverse)
    cluster = dv // BLOCK_DV
    mask = (1 << cluster) - 1
    aligned = whole_chunks(problem, C)
    decay_mask = decay_mask_macro(chunk=C, scale=scale, time=time, transposed=True)
    rows = T.GemmWarpPolicy.FullRow
    batch, seqlen = sizes(problem, arch)
    qk, vo, decay = tensor_types(batch, seqlen, heads=heads, dk=dk, dv=dv, dtype=dtype)
    state_shape = [batch * heads, 1, dk, dv]

    @T.prim_func
    def main(
        Q: qk(), K: qk(), V: vo(), Decay: decay(), H0: T.Tensor(state_shape, ACCUM), O: vo(),
        HT: T.Tensor(state_shape, ACCUM),
    ):  # fmt: skip
        with T.Kernel(cluster, batch * heads, threads=256, cluster_dims=(cluster, 1, 1)) as (bv, bbh):
            bb = bbh // heads
            bh = bbh % heads
            v0 = bv * BLOCK_DV
            Q_s = T.alloc_shared([stages, C, dk], dtype)
            K_s = T.alloc_shared([stages, C, dk], dtype)
            V_s = T.alloc_shared([stages, C, BLOCK_DV], dtype)
            Kw_s = T.alloc_shared([C, dk], dtype)
            AT_cast = T.alloc_shared([C, C], dtype)
            O_s = T.alloc_shared([C, BLOCK_DV], dtype)
            # Per stage: "full" in each CTA, which all 128 producer threads arrive on (the
            # elected one after its expect-tx of the bytes this CTA receives); "empty" in
            # each CTA, which every CTA's consumer arrives on once done with the stage.
            full = T.alloc_barrier([128] * stages)
            empty = T.alloc_cluster_barrier([cluster] * stages)

            ST_f = T.alloc_fragment([BLOCK_DV, dk], ACCUM)  # S^T, carried across chunks
            ST_h = T.alloc_fragment([BLOCK_DV, dk], dtype)
            OT = T.alloc_fragment([BLOCK_DV, C], ACCUM)
            AT = T.alloc_fragment([C, C], ACCUM)
            GammaT = T.alloc_fragment([C, C], ACCUM)
            lg = T.alloc_local([1], ACCUM)

            tx = T.get_thread_binding()
            n_chunks = T.ceildiv(seqlen, C)
            T.cluster_sync()  # every CTA's barriers are initialised before any remote arrive
            if tx >= 128:  # the producer warpgroup
                for c in T.serial(n_chunks):
                    s = c % stages
                    s0 = time.chunk_start(0, c, n_chunks, C)
                    T.mbarrier_wait_parity(empty[s], ((c // stages) % 2) ^ 1)
                    T.tma_copy(Q[bb, s0 : s0 + C, bh, :], Q_s[s, :, :], barrier=full[s], cluster_mask=mask)
                    T.tma_copy(K[bb, s0 : s0 + C, bh, :], K_s[s, :, :], barrier=full[s], cluster_mask=mask)
                    T.tma_copy(V[bb, s0 : s0 + C, bh, v0 : v0 + BLOCK_DV], V_s[s, :, :], barrier=full[s])
                    T.barrier_arrive(full[s])
            else:  # the consumer warpgroup: transposed_chunk_loop_macro's step
                decay_mask(GammaT, lg, Decay, bh)  # GammaT[j, i]: key j, query i
                if call.initial_state:
                    for v, d in T.Parallel(BLOCK_DV, dk):
                        ST_f[v, d] = H0[bbh, 0, d, v0 + v]
                else:
                    T.clear(ST_f)
                for c in T.serial(n_chunks):
                    s = c % stages
                    s0 = time.chunk_start(0, c, n_chunks, C)
                    m = C if aligned else T.max(T.min(C, seqlen - s0), 0)
                    T.mbarrier_wait_parity(full[s], (c // stages) % 2)
                    T.copy(ST_f, ST_h)
                    T.wgmma_gemm(K_s[s, :, :], Q_s[s, :, :], AT, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(ST_h, Q_s[s, :, :], OT, transpose_B=True, clear_accum=True, policy=rows)
                    T.wait_wgmma(1)
                    for r, d in T.Parallel(C, dk):  # key_weights_macro, on stage s
                        Kw_s[r, d] = T.if_then_else(
                            r < m, K_s[s, r, d] * alpha_power(lg[0], time.key_power(r, m)), T.Cast(dtype, 0)
                        )
                    for j, i in T.Parallel(C, C):
                        AT_cast[j, i] = time.scores(AT[j, i], GammaT[j, i], j, m)
                    T.wait_wgmma(0)
                    for v, i in T.Parallel(BLOCK_DV, C):
                        OT[v, i] *= scale * alpha_power(lg[0], time.query_power(i, m))
                    T.wgmma_gemm(V_s[s, :, :], AT_cast, OT, transpose_A=True, policy=rows)
                    for v, d in T.Parallel(BLOCK_DV, dk):
                        ST_f[v, d] *= alpha_power(lg[0], m)
                    T.wgmma_gemm(V_s[s, :, :], Kw_s, ST_f, transpose_A=True, policy=rows)
                    T.wait_wgmma(1)
                    for i, v in T.Parallel(C, BLOCK_DV):
                        O_s[i, v] = OT[v, i]
                    T.copy(O_s, O[bb, s0 : s0 + C, bh, v0 : v0 + BLOCK_DV])
                    T.wait_wgmma(0)
                    T.sync_threads(5, 128)  # every consumer warp's MMAs on stage s are done
                    if tx == 0:
                        for r in T.serial(cluster):
                            T.mbarrier_arrive(empty[s], r)
                if call.final_state:
                    for v, d in T.Parallel(BLOCK_DV, dk):
                        HT[bbh, 0, d, v0 + v] = ST_f[v, d]
            T.cluster_sync()  # no CTA leaves while a peer may still arrive on its barriers

    return main


def compile_for(
    problem: Problem, call: Call, *, stages: int, arch: str = "sm_90a", run_on: str | None = None
):
    from kernel.arch import target
    from kernel.variants import pass_configs

    return tilelang.compile(
        cluster_fwd(problem, call, stages=stages, arch=arch),
        target=target(arch, run_on=run_on),
        pass_configs=pass_configs(arch) | {"tl.disable_warp_specialized": True},
    )


def cluster_kernel(problem: Problem, call: Call, stages: int):
    """The prototype as the product's ``ScalarDecayKernel`` (its launch, its checks)."""
    from kernel.builder import ScalarDecayKernel, cuda_arch

    return ScalarDecayKernel(
        problem, config(stages), (compile_for(problem, call, stages=stages, arch=cuda_arch()),), call
    )


def reversed_check(problem: Problem, call: Call) -> dict:
    """The reversed recurrence against reference C run forward on the inputs reversed in
    time (as ``tests/test_backward.py`` checks the reversed sweeps): relative L2 of the
    output and of the state at the first token, into NaN-filled buffers."""
    import torch

    import refs
    from kernel.config import retnet_decay
    from kernel.validate import random_qkv

    p = problem
    q, k, v = random_qkv(p, seed=6)
    decay = torch.tensor(retnet_decay(p.heads), dtype=torch.float32, device="cuda")
    h0 = torch.randn(p.batch, p.heads, p.dk, p.dv, device="cuda")
    out, ht = torch.full_like(v, float("nan")), torch.full_like(h0, float("nan"))
    cluster_kernel(p, call, 3)(q, k, v, decay=decay, initial_state=h0, final_state=ht, out=out)
    torch.cuda.synchronize()
    flip = [x.double().flip(1) for x in (q, k, v)]
    ref, ref_state = refs.kernel_mimic(
        *flip, decay.double(), CHUNK, scale=call.scale, initial_state=h0.double(), output_final_state=True
    )
    return {
        "rel_l2": refs.rel_l2(out.double(), ref.flip(1)),
        "state_rel_l2": refs.rel_l2(ht.double(), ref_state),
    }


def main(specs: list[str]) -> None:
    """Per ``BxHxS:DKxDV``: first every call kind checked against reference C at that head
    size and a small ragged shape (``kernel.validate.check``: fresh inputs, NaN-filled
    outputs and state, a random state in); then, at the shape, a model's call (the final
    state out) timed in one process for the served forward (the rule's config), the
    product's kernel of the cluster's CTAs without the cluster (64/64/3/128/smem/1, Q and
    K read per CTA) and the prototype at 2, 3 and 4 stages (``kernel.timing.time_gpu``:
    the host queued ahead, L2 flushed, median), each checked so too."""
    import torch

    from kernel.builder import build
    from kernel.config import model_call, retnet_decay
    from kernel.environment import environment
    from kernel.ops.serve import kernel_for
    from kernel.timing import time_gpu
    from kernel.validate import check, random_qkv
    from tuner.bench_rows import copy_bandwidth

    def row(**fields):
        print(json.dumps(fields), flush=True)

    bandwidth = copy_bandwidth()
    row(kind="env", env=environment(), copy_bandwidth=bandwidth)
    checked: set = set()
    for spec in specs:
        shape, head_sizes = spec.split(":")
        b, h, s = map(int, shape.split("x"))
        dk, dv = map(int, head_sizes.split("x"))
        problem = Problem(b, h, s, dk, dv, "bfloat16")
        scale = model_call(problem).scale
        if (dk, dv) not in checked:
            checked.add((dk, dv))
            for small in (Problem(2, h, 333, dk, dv, "bfloat16"), Problem(1, h, 256, dk, dv, "bfloat16")):
                for call in (Call(scale), Call(scale, initial_state=True, final_state=True)):
                    got = check(cluster_kernel(small, call, 3), seed=5)
                    row(kind="check", problem=small.to_dict(), call=call.to_dict(), **got)
                call = Call(scale, initial_state=True, final_state=True, reverse=True)
                row(kind="check", problem=small.to_dict(), call=call.to_dict(), **reversed_check(small, call))
        call = Call(scale, final_state=True)  # a model's call: the state comes out
        q, k, v = random_qkv(problem, seed=3)
        decay = torch.tensor(retnet_decay(h), dtype=torch.float32, device="cuda")
        state = torch.empty(b, h, dk, dv, device="cuda")
        kernels = {"served": kernel_for(problem, call, b), "unshared": build(problem, config(3), call)}
        kernels |= {f"cluster{stages}": cluster_kernel(problem, call, stages) for stages in (2, 3, 4)}
        # Q, K, V read and O written once, and the final state
        floor_ms = (b * s * h * (2 * dk + 2 * dv) * 2 + b * h * dk * dv * 4) / bandwidth * 1e3
        for name, kern in kernels.items():
            got = check(kern, seed=7)
            t = time_gpu(lambda kern=kern: kern.run(q, k, v, decay, final_state=state), host_ahead=True)
            row(
                kind="time",
                spec=spec,
                impl=name,
                config=kern.config.label,
                **got,
                **t.to_dict(),
                floor_ms=floor_ms,
            )


if __name__ == "__main__":
    if sys.argv[1:] == ["--cpu"]:
        for dv in (128, 256):
            p = Problem(1, 16, 64, 128, dv, "bfloat16")
            for call in (
                Call(0.1, final_state=True),
                Call(0.1, initial_state=True, final_state=True, reverse=True),
            ):
                k = compile_for(p, call, stages=3)
                Path(f"/tmp/cluster_fwd_{dv}_{int(call.reverse)}.cu").write_text(k.get_kernel_source())
                print(f"compiled {p} {call}: /tmp/cluster_fwd_{dv}_{int(call.reverse)}.cu")
    else:
        main(sys.argv[1:])
