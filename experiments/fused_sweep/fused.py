"""Issue 18: a fused dk+dv sweep, prototyped outside the product.

The backward's dk and dv sweeps (``kernel.backward``) each run the forward backwards in
time, and their states are each other's transpose: one reversed sweep can carry ``dS``
(``[DK, DV]``, fp32) and write both gradients. Per chunk of ``m`` tokens, with the
reversed weights of ``kernel.scalar_decay.Direction`` (``Gamma[i, j] = scale alpha^(j-i)``
for ``i <= j < m``)::

    dV = (K Q^T * Gamma) dO + diag(scale alpha^(m-i)) K dS
    dK = (V dO^T * Gamma) Q + diag(scale alpha^(m-i)) V dS^T
    dS = alpha^m dS + (diag(alpha^r) Q)^T dO          (rows r < m)

Seven MMAs per chunk where a sweep has four; it reads Q, K, V, dO once and writes dK, dV
(6 tensors where the two sweeps move 8), and one block holds the whole DV. From FLOPs and
bytes it could take 0.22 to 0.24 ms at 8x16x4096 against the two sweeps' 0.286
(experiments/backward/README.md). This prototype is dense (no packed sequences), any
S (a ragged last chunk), one alpha per head read at run time, and with ``states`` it
starts from ``H0`` (``dHT / (scale alpha)``, as ``kernel.backward`` starts its reversed
sweeps) and writes the state at the first token to ``HT`` (``dH0 = scale alpha HT``, the dv
sweep's final state). The async variants issue the MMAs as the forward's Hopper step does
(``kernel.mma``: wgmma, waited only where a result is read).

    python3 experiments/fused_sweep/fused.py --compile-only   # CPU: ptxas's figures
    python3 experiments/fused_sweep/fused.py --out DIR        # GPU: check, then time

On the GPU: dK, dV (and dH0, with states) against ``refs.chunked_backward`` in fp64
(NaN-filled outputs, odd shapes), then at 8x16x4096 fp16 the fused sweep against the two
sweeps ``decay_attention`` runs, in one run (``kernel.timing.alternating``). Writes
DIR/fused.json.
"""

import argparse
import itertools
import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import tilelang
import tilelang.language as T

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from kernel.arch import target  # noqa: E402
from kernel.mma import mma_for  # noqa: E402
from kernel.variants import pass_configs  # noqa: E402

VARIANTS = {  # name -> (threads, num_stages, async)
    "sync/1": (256, 1, False),
    "sync/2": (256, 2, False),
    "async/1": (256, 1, True),
    "async/2": (256, 2, True),
}


def fused_dkdv(
    batch: int,
    heads: int,
    seqlen: int,
    dk: int,
    dv: int,
    *,
    scale: float,
    dtype: str = "float16",
    chunk: int = 64,
    threads: int = 256,
    num_stages: int = 1,
    asynchronous: bool = False,
    states: bool = False,
    arch: str = "sm_90a",
):
    """The ``@T.prim_func`` ``main(Q, K, V, dO, Decay, H0, HT, dK, dV)``: one block per
    (batch, head) walks the chunks last to first. H0, HT: fp32 ``[B*H, 1, DK, DV]``, read
    and written only with ``states``."""
    C, accum = chunk, "float32"
    n_chunks = (seqlen + C - 1) // C
    mma = mma_for(arch) if asynchronous else mma_for("sm_80")  # sm_80: T.gemm, waits vanish

    @T.prim_func
    def main(
        Q: T.Tensor([batch, seqlen, heads, dk], dtype),
        K: T.Tensor([batch, seqlen, heads, dk], dtype),
        V: T.Tensor([batch, seqlen, heads, dv], dtype),
        dO: T.Tensor([batch, seqlen, heads, dv], dtype),
        Decay: T.Tensor([heads], accum),
        H0: T.Tensor([batch * heads, 1, dk, dv], accum),
        HT: T.Tensor([batch * heads, 1, dk, dv], accum),
        dK: T.Tensor([batch, seqlen, heads, dk], dtype),
        dV: T.Tensor([batch, seqlen, heads, dv], dtype),
    ):
        with T.Kernel(batch * heads, threads=threads) as bbh:
            bb, bh = bbh // heads, bbh % heads
            Q_s = T.alloc_shared([C, dk], dtype)
            K_s = T.alloc_shared([C, dk], dtype)
            Qw_s = T.alloc_shared([C, dk], dtype)  # Q rows r < m, * alpha^r: writes dS
            V_s = T.alloc_shared([C, dv], dtype)
            dO_s = T.alloc_shared([C, dv], dtype)
            dS_s = T.alloc_shared([dk, dv], dtype)
            P1_s = T.alloc_shared([C, C], dtype)
            P2_s = T.alloc_shared([C, C], dtype)
            dK_s = T.alloc_shared([C, dk], dtype)
            dV_s = T.alloc_shared([C, dv], dtype)
            dS_f = T.alloc_fragment([dk, dv], accum)  # carried across chunks
            acc_v = T.alloc_fragment([C, dv], accum)
            acc_k = T.alloc_fragment([C, dk], accum)
            A1 = T.alloc_fragment([C, C], accum)
            A2 = T.alloc_fragment([C, C], accum)
            Gamma = T.alloc_fragment([C, C], accum)
            touch = T.alloc_local([1], dtype)
            lg = T.alloc_local([1], accum)  # log2(alpha) of this head, <= 0
            lg[0] = T.log2(Decay[bh])
            # Gamma[i, j] = scale alpha^(j-i) for j >= i, else 0: never computed where j < i.
            for i, j in T.Parallel(C, C):
                Gamma[i, j] = T.if_then_else(
                    j >= i, scale * T.exp2(lg[0] * T.Cast(accum, j - i)), T.Cast(accum, 0)
                )
            if states:
                T.copy(H0[bbh, 0, :, :], dS_f)
            else:
                T.clear(dS_f)
            for c in T.Pipelined(n_chunks, num_stages=num_stages):
                s0 = (n_chunks - 1 - c) * C
                m = T.min(C, seqlen - s0)  # tokens of this chunk: C but for the last
                T.copy(Q[bb, s0 : s0 + C, bh, :], Q_s)
                T.copy(K[bb, s0 : s0 + C, bh, :], K_s)
                T.copy(V[bb, s0 : s0 + C, bh, :], V_s)
                T.copy(dO[bb, s0 : s0 + C, bh, :], dO_s)
                T.copy(dS_f, dS_s)  # the state after this chunk, as the MMAs read it
                mma.gemm(K_s, Q_s, A1, transpose_B=True, clear_accum=True)  # k_i . q_j
                mma.gemm(K_s, dS_s, acc_v, clear_accum=True)
                mma.gemm(V_s, dO_s, A2, transpose_B=True, clear_accum=True)  # v_i . do_j
                mma.gemm(V_s, dS_s, acc_k, transpose_B=True, clear_accum=True)
                mma.wait(3)  # A1 is ready
                for i, j in T.Parallel(C, C):
                    P1_s[i, j] = T.if_then_else(j < m, A1[i, j] * Gamma[i, j], T.Cast(accum, 0))
                for r, d in T.Parallel(C, dk):
                    Qw_s[r, d] = T.if_then_else(
                        r < m, Q_s[r, d] * T.exp2(lg[0] * T.Cast(accum, r)), T.Cast(dtype, 0)
                    )
                mma.wait(1)  # acc_v and A2 are ready
                for i, j in T.Parallel(C, C):
                    P2_s[i, j] = T.if_then_else(j < m, A2[i, j] * Gamma[i, j], T.Cast(accum, 0))
                for i, j in T.Parallel(C, dv):
                    acc_v[i, j] *= scale * T.exp2(lg[0] * T.Cast(accum, T.max(m - i, 0)))
                mma.wait(0)  # acc_k is ready
                for i, j in T.Parallel(C, dk):
                    acc_k[i, j] *= scale * T.exp2(lg[0] * T.Cast(accum, T.max(m - i, 0)))
                mma.gemm(P1_s, dO_s, acc_v)
                mma.gemm(P2_s, Q_s, acc_k)
                for i, j in T.Parallel(dk, dv):
                    dS_f[i, j] *= T.exp2(lg[0] * T.Cast(accum, m))
                mma.gemm(Qw_s, dO_s, dS_f, transpose_A=True)
                mma.wait(1)  # dV and dK are ready; the state's update may still run
                T.copy(acc_v, dV_s)
                T.copy(dV_s, dV[bb, s0 : s0 + C, bh, :])
                T.copy(acc_k, dK_s)
                T.copy(dK_s, dK[bb, s0 : s0 + C, bh, :])
                mma.wait(0)
                # The pipeliner hands a stage's buffer back after the last statement that
                # names it, while an issued wgmma may still read it (kernel.scalar_decay).
                touch[0] = Q_s[0, 0]
                touch[0] = K_s[0, 0]
                touch[0] = V_s[0, 0]
                touch[0] = dO_s[0, 0]
            if states:
                T.copy(dS_f, HT[bbh, 0, :, :])

    return main


def mimic(q, k, v, do, decay, scale: float, chunk: int = 64, start=None):
    """The kernel's chunk loop statement by statement in fp64 torch (``[B, S, H, D]``
    tensors, decay ``[H]``, ``start`` ``[B, H, DK, DV]`` or None): ``(dK, dV, the state at
    the first token)``, to check the algebra on the CPU."""
    import torch

    b, s, h, dk = q.shape
    q, k, v, do = (x.double().transpose(1, 2) for x in (q, k, v, do))  # [B, H, S, D]
    lg = torch.log2(decay.double())[None, :, None, None]
    i = torch.arange(chunk, dtype=torch.float64)
    dist = i[None, :] - i[:, None]  # j - i
    gamma = torch.where(dist >= 0, scale * torch.exp2(lg * dist.clamp(min=0)), 0.0)
    ds = torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float64) if start is None else start.double()
    dk_, dv_ = torch.empty_like(k), torch.empty_like(v)
    n_chunks = (s + chunk - 1) // chunk
    for c in range(n_chunks):
        s0 = (n_chunks - 1 - c) * chunk
        m = min(chunk, s - s0)
        pad = (0, 0, 0, chunk - m)  # TMA's zero rows past S
        qs, ks, vs, dos = (torch.nn.functional.pad(x[:, :, s0 : s0 + m], pad) for x in (q, k, v, do))
        keys = (i < m)[None, None, None, :]
        p1 = torch.where(keys, (ks @ qs.transpose(-1, -2)) * gamma, 0.0)
        p2 = torch.where(keys, (vs @ dos.transpose(-1, -2)) * gamma, 0.0)
        rows = scale * torch.exp2(lg * (m - i).clamp(min=0)[:, None])
        acc_v = (ks @ ds) * rows + p1 @ dos
        acc_k = (vs @ ds.transpose(-1, -2)) * rows + p2 @ qs
        qw = torch.where((i < m)[:, None], qs * torch.exp2(lg * i[:, None]), 0.0)
        ds = ds * torch.exp2(lg * m) + qw.transpose(-1, -2) @ dos
        dv_[:, :, s0 : s0 + m], dk_[:, :, s0 : s0 + m] = acc_v[:, :, :m], acc_k[:, :, :m]
    return dk_.transpose(1, 2), dv_.transpose(1, 2), ds


def check_mimic() -> list[dict]:
    """``mimic`` against ``refs.chunked_backward`` in fp64 on odd shapes (CPU)."""
    import torch

    import refs

    rows = []
    for b, h, s, dk, dv, chunk in [
        (2, 3, 1000, 32, 48, 64),
        (1, 2, 64, 16, 16, 64),
        (2, 2, 37, 16, 32, 64),
        (1, 3, 130, 16, 16, 32),
    ]:
        gen = torch.Generator().manual_seed(s)
        q, k = (torch.randn(b, s, h, dk, generator=gen, dtype=torch.float64) for _ in range(2))
        v, do = (torch.randn(b, s, h, dv, generator=gen, dtype=torch.float64) for _ in range(2))
        decay = torch.tensor([0.05, 0.9, 0.999][:h], dtype=torch.float64)
        h0, dht = (torch.randn(b, h, dk, dv, generator=gen, dtype=torch.float64) for _ in range(2))
        scale = dk**-0.5
        _, want_dk, want_dv, want_dh0 = refs.chunked_backward(
            q, k, v, decay, chunk, do, scale=scale, initial_state=h0, dht=dht
        )
        weight = (scale * decay)[:, None, None]  # kernel.backward's start and dH0
        got_dk, got_dv, final = mimic(q, k, v, do, decay, scale, chunk, start=dht / weight)
        rows.append(
            {
                "shape": f"{b}x{h}x{s}, DK {dk}, DV {dv}, C {chunk}, states in and out",
                "dk_rel_l2": refs.rel_l2(got_dk, want_dk),
                "dv_rel_l2": refs.rel_l2(got_dv, want_dv),
                "dh0_rel_l2": refs.rel_l2(final * weight, want_dh0),
            }
        )
    return rows


def compile_variant(
    name: str,
    batch: int,
    heads: int,
    seqlen: int,
    dk: int,
    dv: int,
    dtype: str,
    arch: str,
    states: bool = False,
):
    threads, stages, asynchronous = VARIANTS[name]
    func = fused_dkdv(
        batch,
        heads,
        seqlen,
        dk,
        dv,
        scale=dk**-0.5,
        dtype=dtype,
        threads=threads,
        num_stages=stages,
        asynchronous=asynchronous,
        states=states,
        arch=arch,
    )
    return func, tilelang.compile(func, target=target(arch), pass_configs=pass_configs(arch))


def compile_only() -> list[dict]:
    """ptxas's figures for every variant at 8x16x4096, DK = DV = 128, sm_90a."""
    from kernel.resources import _ptxas, launch_figures, lower, parse_ptxas

    rows = []
    for name, states in itertools.product(VARIANTS, (False, True)):
        row: dict = {"variant": name, "states": states}
        try:
            func, kernel = compile_variant(name, 8, 16, 4096, 128, 128, "float16", "sm_90a", states)
        except Exception as exc:  # a variant TileLang cannot lower: say why
            rows.append(row | {"error": f"{type(exc).__name__}: {exc}"[:500]})
            continue
        ok, log = _ptxas(kernel.get_kernel_source(), "sm_90a")
        figures = parse_ptxas(log) if ok else {"ptxas_error": log[-1000:]}
        smem, threads = launch_figures(kernel.artifact or lower(func, arch="sm_90a"))
        rows.append(row | figures | {"dynamic_smem": smem, "threads_launched": threads})
    return rows


def _compiles(job: tuple) -> str:
    """Compile one (variant, shape) in a child process: "ok", or why not."""
    try:
        compile_variant(*job)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:300]
    return "ok"


def gpu(out: Path) -> dict:
    import torch

    import refs
    from kernel import attention
    from kernel.backward import sweep_calls
    from kernel.builder import build, constant_decay, cuda_arch, precompile
    from kernel.config import Call, Problem, retnet_decay
    from kernel.timing import alternating
    from kernel.validate import random_qkv

    arch = cuda_arch()
    result: dict = {"checks": [], "timing": {}}
    # Against fp64: ragged last chunks, one chunk, fewer tokens than a chunk, bf16.
    shapes = [(2, 3, 1000, "float16"), (1, 2, 64, "float16"), (2, 2, 37, "bfloat16")]
    problem = Problem(8, 16, 4096, 128, 128, "float16")  # timed
    scale = 128**-0.5
    (_, _), (p_dk, c_dk), (p_dv, c_dv) = sweep_calls(problem, Call(scale))
    sweeps = [attention.kernel_job(p_dk, c_dk, 8), attention.kernel_job(p_dv, c_dv, 8)]
    # Every kernel compiled first, in parallel processes (TileLang's disk cache keeps them).
    jobs = [
        (n, b, h, s, 128, 128, d, arch, st) for n in VARIANTS for b, h, s, d in shapes for st in (False, True)
    ]
    jobs += [(n, 8, 16, 4096, 128, 128, "float16", arch, False) for n in VARIANTS]
    with ProcessPoolExecutor(len(jobs), mp_context=multiprocessing.get_context("spawn")) as pool:
        done = list(pool.map(_compiles, jobs))
    result["compiled"] = dict(zip(map(str, jobs), done))
    precompile(sweeps, arch=arch)
    for (b, h, s, dtype), states in itertools.product(shapes, (False, True)):
        q, k, v = random_qkv(Problem(b, h, s, 128, 128, dtype), seed=s)
        do = torch.randn_like(v, dtype=torch.float32).to(v.dtype)
        decay = torch.tensor([0.05, 0.9, 0.999][:h], device="cuda")
        h0, dht = (torch.randn(b, h, 128, 128, device="cuda") for _ in range(2))
        _, want_dk, want_dv, want_dh0 = refs.chunked_backward(
            q, k, v, decay, 64, do, scale=scale, initial_state=h0, dht=dht if states else None
        )
        weight = (scale * decay)[:, None, None]  # kernel.backward's start and dH0
        start = (dht / weight if states else torch.empty_like(dht)).reshape(b * h, 1, 128, 128)
        for name in VARIANTS:
            _, kernel = compile_variant(name, b, h, s, 128, 128, dtype, arch, states)
            dk_, dv_ = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
            final = torch.full_like(start, float("nan"))
            kernel(q, k, v, do, decay, start, final, dk_, dv_)
            torch.cuda.synchronize()
            check = {"shape": f"{b}x{h}x{s}", "dtype": dtype, "states": states, "variant": name}
            check |= {"dk_rel_l2": refs.rel_l2(dk_, want_dk), "dv_rel_l2": refs.rel_l2(dv_, want_dv)}
            if states:
                check["dh0_rel_l2"] = refs.rel_l2(final.reshape(b, h, 128, 128) * weight, want_dh0)
            check["nan"] = int(dk_.isnan().sum() + dv_.isnan().sum() + (final.isnan().sum() if states else 0))
            result["checks"].append(check)
            print(json.dumps(check), flush=True)
    # Timing at the headline shape: each fused variant against the two sweeps.
    q, k, v = random_qkv(problem, seed=1)
    do = torch.randn_like(v, dtype=torch.float32).to(v.dtype)
    decay = constant_decay(retnet_decay(16), 16, q.device)
    dk_sweep, dv_sweep = (build(*job) for job in sweeps)
    calls = {"two sweeps": lambda: (dk_sweep(v, do, q, decay=decay), dv_sweep(k, q, do, decay=decay))}
    dk_, dv_ = torch.empty_like(k), torch.empty_like(v)
    unused = torch.empty(8 * 16, 1, 128, 128, device="cuda")  # no states: never touched
    for name in VARIANTS:
        _, kernel = compile_variant(name, 8, 16, 4096, 128, 128, "float16", arch)
        calls[f"fused {name}"] = lambda kernel=kernel: kernel(q, k, v, do, decay, unused, unused, dk_, dv_)
    times = alternating(calls)
    result["timing"] = {"shape": "8x16x4096", "sweep_configs": [dk_sweep.config.label, dv_sweep.config.label]}
    result["timing"]["median_ms"] = {n: sorted(t)[1] for n, t in times.items()}
    result["timing"]["rounds_ms"] = times
    out.mkdir(parents=True, exist_ok=True)
    (out / "fused.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["timing"], indent=1))
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile-only", action="store_true", help="ptxas's figures per variant (no GPU)")
    parser.add_argument("--mimic", action="store_true", help="the loop's algebra in fp64 against refs (CPU)")
    parser.add_argument("--out", type=Path, help="where the GPU run writes fused.json")
    args = parser.parse_args()
    if args.mimic:
        for row in check_mimic():
            print(json.dumps(row), flush=True)
        return 0
    if args.compile_only:
        for row in compile_only():
            print(json.dumps(row), flush=True)
        return 0
    if args.out is None:
        parser.error("--out is required for the GPU run")
    gpu(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
