"""A prototype: the forward with a thread-block cluster per (batch, head), its CTAs
splitting DV and sharing each chunk's Q and K by TMA multicast (issue 30).

Why: at 4x16x8192 (128/128) an unsplit kernel has 64 blocks of block_dv 128 for 132 SMs,
so the rule splits the sequence, and the split reads K and V twice; at block_dv 64 two
blocks per head read Q and K twice. Either way the bytes cap the forward near 2.2x fla's
(``../outofbox/bounds.txt``). A cluster of ``DV / block_dv`` CTAs reads Q and K once
(the leader multicasts them into every CTA's shared memory) and V in slices: 128 blocks,
the floor's bytes.

TileLang 0.1.15 does not warp-specialise a multicast copy (its role scheduler skips it:
"cluster multicast backpressure cannot be expressed yet"), so the pipeline is written by
hand: one producer warpgroup, one consumer warpgroup, a full barrier per stage in each CTA
(its producer's expect-tx, the bytes it receives), and an empty barrier per stage in each
CTA that every consumer of the cluster arrives on, so a stage is refilled (multicast into
every CTA) only once all of them have read it. The consumer's chunk step is the
transposed step of ``kernel.scalar_decay`` (state ``S^T`` in registers).

Scope of the prototype: dense, no state in, the final state out (as a model's call), any S,
chunk 64.
Checked against reference C (``refs``) on the GPU; timed beside the served forward.

    python3 experiments/h200/multicast/cluster_fwd.py 4x16x8192:128x128 4x8x8192:128x256 ...
"""

import json
import sys
from pathlib import Path

import tilelang
import tilelang.language as T

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

ACCUM = "float32"


def cluster_fwd(
    *, heads: int, dk: int, dv: int, dtype: str, scale: float, block_dv: int = 64, stages: int = 3
):
    C = 64
    cluster = dv // block_dv
    mask = (1 << cluster) - 1
    batch, seqlen = T.dynamic("batch, seqlen")
    rows = T.GemmWarpPolicy.FullRow

    @T.prim_func
    def main(
        Q: T.Tensor([batch, seqlen, heads, dk], dtype),
        K: T.Tensor([batch, seqlen, heads, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype),
        Decay: T.Tensor([heads], ACCUM),
        O: T.Tensor([batch, seqlen, heads, dv], dtype),
        HT: T.Tensor([batch * heads, dk, dv], ACCUM),
    ):
        with T.Kernel(cluster, batch * heads, threads=256, cluster_dims=(cluster, 1, 1)) as (bv, bbh):
            bb = bbh // heads
            bh = bbh % heads
            v0 = bv * block_dv
            Q_s = T.alloc_shared([stages, C, dk], dtype)
            K_s = T.alloc_shared([stages, C, dk], dtype)
            V_s = T.alloc_shared([stages, C, block_dv], dtype)
            Kw_s = T.alloc_shared([C, dk], dtype)
            AT_cast = T.alloc_shared([C, C], dtype)
            O_s = T.alloc_shared([C, block_dv], dtype)
            full = T.alloc_barrier([128] * stages)  # all producer threads arrive, one after its expect-tx
            empty = T.alloc_cluster_barrier([cluster] * stages)

            ST_f = T.alloc_fragment([block_dv, dk], ACCUM)
            ST_h = T.alloc_fragment([block_dv, dk], dtype)
            OT = T.alloc_fragment([block_dv, C], ACCUM)
            AT = T.alloc_fragment([C, C], ACCUM)
            GammaT = T.alloc_fragment([C, C], ACCUM)
            lg = T.alloc_local([1], ACCUM)

            tx = T.get_thread_binding()
            n_chunks = T.ceildiv(seqlen, C)
            T.cluster_sync()  # every CTA's barriers are initialised before any remote arrive
            if tx >= 128:  # the producer warpgroup
                for c in T.serial(n_chunks):
                    s = c % stages
                    T.mbarrier_wait_parity(empty[s], ((c // stages) % 2) ^ 1)
                    T.tma_copy(
                        Q[bb, c * C : (c + 1) * C, bh, :], Q_s[s, :, :], barrier=full[s], cluster_mask=mask
                    )
                    T.tma_copy(
                        K[bb, c * C : (c + 1) * C, bh, :], K_s[s, :, :], barrier=full[s], cluster_mask=mask
                    )
                    T.tma_copy(
                        V[bb, c * C : (c + 1) * C, bh, v0 : v0 + block_dv], V_s[s, :, :], barrier=full[s]
                    )
                    T.barrier_arrive(full[s])
            else:  # the consumer warpgroup
                lg[0] = T.log2(Decay[bh])
                for j, i in T.Parallel(C, C):
                    GammaT[j, i] = T.if_then_else(
                        j <= i, scale * T.exp2(lg[0] * T.Cast(ACCUM, i - j)), T.Cast(ACCUM, 0)
                    )
                T.clear(ST_f)
                for c in T.serial(n_chunks):
                    s = c % stages
                    T.mbarrier_wait_parity(full[s], (c // stages) % 2)
                    T.copy(ST_f, ST_h)
                    T.wgmma_gemm(K_s[s, :, :], Q_s[s, :, :], AT, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(ST_h, Q_s[s, :, :], OT, transpose_B=True, clear_accum=True, policy=rows)
                    T.wait_wgmma(1)
                    m = T.min(C, seqlen - c * C)  # tokens of this chunk: C but at a ragged end
                    for r, d in T.Parallel(C, dk):  # rows past m: 0, never alpha^(negative)
                        Kw_s[r, d] = T.if_then_else(
                            r < m, K_s[s, r, d] * T.exp2(lg[0] * T.Cast(ACCUM, m - 1 - r)), T.Cast(dtype, 0)
                        )
                    for j, i in T.Parallel(C, C):
                        AT_cast[j, i] = AT[j, i] * GammaT[j, i]
                    T.wait_wgmma(0)
                    for v, i in T.Parallel(block_dv, C):
                        OT[v, i] *= scale * T.exp2(lg[0] * T.Cast(ACCUM, i + 1))
                    T.wgmma_gemm(V_s[s, :, :], AT_cast, OT, transpose_A=True, policy=rows)
                    for v, d in T.Parallel(block_dv, dk):
                        ST_f[v, d] *= T.exp2(lg[0] * T.Cast(ACCUM, m))
                    T.wgmma_gemm(V_s[s, :, :], Kw_s, ST_f, transpose_A=True, policy=rows)
                    T.wait_wgmma(1)
                    for i, v in T.Parallel(C, block_dv):
                        O_s[i, v] = OT[v, i]
                    T.copy(O_s, O[bb, c * C : (c + 1) * C, bh, v0 : v0 + block_dv])
                    T.wait_wgmma(0)
                    T.sync_threads(5, 128)  # every consumer warp's MMAs on stage s are done
                    if tx == 0:
                        for r in T.serial(cluster):
                            T.mbarrier_arrive(empty[s], r)
                for v, d in T.Parallel(block_dv, dk):
                    HT[bbh, d, v0 + v] = ST_f[v, d]
            T.cluster_sync()  # no CTA leaves while a peer may still arrive on its barriers

    return main


def compile_for(arch: str = "sm_90a", **problem):
    target = {"kind": "cuda", "arch": arch}
    return tilelang.compile(
        cluster_fwd(**problem),
        target=target,
        pass_configs={"tl.disable_shared_memory_reuse": True, "tl.disable_warp_specialized": True},
    )


def main(specs: list[str]) -> None:
    """Per ``BxHxS:DKxDV``: the prototype at each stage count beside the served forward
    (the rule's config, ``kernel.ops.serve.kernel_for``) and the product's kernel of the
    prototype's CTAs without the cluster (64/64/3/128/smem/1: Q and K read per CTA), all
    checked against reference C into NaN-filled outputs and timed in one process
    (``kernel.timing.time_gpu``, the host queued ahead, L2 flushed, median)."""
    import torch

    import refs
    from kernel.builder import build
    from kernel.config import Call, KernelConfig, Problem, model_call, retnet_decay
    from kernel.environment import environment
    from kernel.ops.serve import kernel_for
    from kernel.timing import time_gpu
    from kernel.validate import random_qkv

    print(json.dumps({"kind": "env", "env": environment()}), flush=True)
    for spec in specs:
        shape, heads_dims = spec.split(":")
        b, h, s = map(int, shape.split("x"))
        dk, dv = map(int, heads_dims.split("x"))
        problem = Problem(b, h, s, dk, dv, "bfloat16")
        q, k, v = random_qkv(problem, seed=3)
        decay = torch.tensor(retnet_decay(h), dtype=torch.float32, device="cuda")
        scale = model_call(problem).scale
        ref, ref_state = refs.kernel_mimic(
            q.double(), k.double(), v.double(), decay.double(), 64, scale=scale, output_final_state=True
        )
        call = Call(scale, final_state=True)  # a model's call: the state comes out
        served = kernel_for(problem, call, b)
        unshared = build(problem, KernelConfig(64, 64, 3, 128, "smem", 1), call)
        state = torch.full((b, h, dk, dv), float("nan"), device="cuda")  # NaN until written
        runs = {
            "served " + served.config.label(): lambda: served.run(q, k, v, decay, final_state=state)[0],
            "unshared " + unshared.config.label(): lambda: unshared.run(q, k, v, decay, final_state=state)[0],
        }
        for stages in (2, 3, 4):
            try:
                kern = compile_for(heads=h, dk=dk, dv=dv, dtype="bfloat16", stages=stages, scale=scale)
            except Exception as e:  # noqa: BLE001 - a prototype's compile failure is a row
                failed = {"kind": "compile_failed", "spec": spec, "stages": stages, "error": str(e)[-300:]}
                print(json.dumps(failed))
                continue
            nan_out = torch.full_like(v, float("nan"))  # NaN until the first call writes it

            def cluster(kern=kern, out=nan_out):
                kern(q, k, v, decay, out, state.view(b * h, dk, dv))
                return out

            runs[f"cluster 64/64/{stages}"] = cluster
        bytes_moved = b * s * h * (2 * dk + 2 * dv) * 2 + b * h * dk * dv * 4  # and the state
        for name, run in runs.items():
            state.fill_(float("nan"))
            out = run()
            torch.cuda.synchronize()
            err = refs.rel_l2(out.double(), ref)
            state_err = refs.rel_l2(state.double(), ref_state)
            t = time_gpu(run, host_ahead=True)
            print(json.dumps({
                "kind": "time", "spec": spec, "impl": name, "rel_l2_ref_c": err, "state_rel_l2": state_err,
                "nan": int(out.isnan().sum()), **t.to_dict(),
                "floor_ms": bytes_moved / 4.24e9,
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:] == ["--cpu"]:  # compile for sm_90a here and write the CUDA
        k = compile_for(heads=16, dk=128, dv=128, dtype="bfloat16", scale=128**-0.5)
        Path("/tmp/cluster_fwd.cu").write_text(k.get_kernel_source())
        print("compiled: /tmp/cluster_fwd.cu")
    else:
        main(sys.argv[1:])
