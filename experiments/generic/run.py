"""Shape-generic kernels on the GPU: correctness at many shapes of one compile, cost against
the per-shape kernels they replace, and compiles and time of 50 calls of new shapes.

    python experiments/generic/run.py check   # one kernel per (config, call), served at odd shapes
    python experiments/generic/run.py cost    # generic vs per-shape (BASE: the tree before), same run
    python experiments/generic/run.py shapes  # warm up, then 50 new (B, S) forward + backward

``cost`` imports the per-shape kernels from ``.base/kernel_static``: ``git archive`` of the
commit before the change, its ``kernel`` package renamed (run.sh makes it). Each prints JSON
lines.
"""

import json
import random
import sys
import time

import torch

from kernel.builder import build, compiles, precompile, sm_count
from kernel.config import Call, KernelConfig, Problem, dkdv_call, model_call
from kernel.rule import default_config, dkdv_config
from kernel.validate import check

STATES = Call(scale=0.125, initial_state=True, final_state=True)
REVERSED = Call(scale=0.125, initial_state=True, final_state=True, reverse=True)
DKDV_STATES = Call(scale=0.125, initial_state=True, final_state=True, reverse=True, dkdv=True)
SHAPES = [(1, 1), (1, 63), (2, 64), (3, 65), (2, 192), (1, 1000), (1, 4096), (2, 4097), (1, 16384)]


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def check_reversed(kern, *, seed: int) -> dict:
    """``kernel.validate.check`` of a reversed call: the kernel on (q, k, v) against
    reference C on the tokens flipped in time, flipped back (the same sums)."""
    from refs import kernel_mimic, rel_l2

    p, call = kern.problem, kern.call
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (
        torch.randn(p.batch, p.seqlen, p.heads, d, generator=gen, device="cuda").to(torch.float16)
        for d in (p.dk, p.dk, p.dv)
    )
    h0 = torch.randn(p.batch, p.heads, p.dk, p.dv, generator=gen, device="cuda")
    decay = torch.tensor([1 - 2 ** (-5 - i) for i in range(p.heads)], device="cuda")
    out = torch.full_like(v, float("nan"))
    ht = torch.full_like(h0, float("nan"))
    kern(q, k, v, decay=decay, initial_state=h0, final_state=ht, out=out)
    flip = [x.flip(1) for x in (q, k, v)]
    ref, ref_state = kernel_mimic(
        *flip,
        decay,
        kern.config.chunk,
        block_dv=kern.config.block_dv,
        scale=call.scale,
        initial_state=h0,
        output_final_state=True,
    )
    err = max(rel_l2(out, ref.flip(1)), rel_l2(ht, ref_state))
    return {"rel_l2": err, "nan_count": int(out.isnan().sum() + ht.isnan().sum())}


def check_cases() -> None:
    cases = []
    for dk, dv in ((128, 128), (64, 64)):
        base = Problem(1, 4, 256, dk, dv)
        for cfg in (
            "64/128/2/256/smem/1",
            "64/64/2/256/smem/1",
            "64/32/2/128/regs/1",
            "32/32/2/128/smem/1",
            "64/128/2/256/smem/4",
            "64/64/2/256/smem/8",
            "32/32/1/128/smem/64",
        ):
            c, b, st, th, sc, sg = cfg.split("/")
            config = KernelConfig(int(c), int(b), int(st), int(th), sc, int(sg))
            if dv % config.block_dv:
                continue
            for name, call in (("model", model_call(base)), ("states", STATES), ("reversed", REVERSED)):
                cases.append((base, config, name, call))
        for segs in (1, 4):
            config = KernelConfig(64, dv, 1, 256, "smem", segs)
            cases += [(base, config, "dkdv", dkdv_call(base)), (base, config, "dkdv-states", DKDV_STATES)]
    ragged = [(Problem(1, p.heads, 1000, p.dk, p.dv), c, call) for p, c, _, call in cases]
    precompile([(p, c, call) for p, c, _, call in cases] + ragged, arch="sm_90a", workers=16)
    for base, config, name, call in cases:
        for b, s in SHAPES:
            p = Problem(b, base.heads, s, base.dk, base.dv)
            try:  # one compile per chunk class (S a multiple of the chunk, or not) serves every shape
                served = build(p, config, call)
            except ValueError:  # a split that leaves one segment
                continue
            r = (check_reversed if call.reverse and not call.dkdv else check)(served, seed=b * 7 + s)
            emit(
                kind="check",
                dk=base.dk,
                config=config.label,
                call=name,
                b=b,
                s=s,
                rel_l2=r["rel_l2"],
                nan=r["nan_count"],
                ok=bool(r["rel_l2"] < 2e-2 and r["nan_count"] == 0),
            )
    emit(kind="check_done", compiles=compiles())


BENCH = [
    (8, 16, 4096, 128, 128),
    (2, 16, 16384, 128, 128),
    (1, 8, 32768, 128, 128),
    (4, 8, 8192, 128, 256),
    (16, 32, 2048, 64, 64),
    (3, 16, 3001, 128, 128),
    (64, 8, 512, 64, 64),
]


def cost() -> None:
    sys.path.insert(0, ".base")
    from kernel_static import builder as static  # the per-shape kernels of the tree before

    from kernel.timing import time_gpu

    jobs = []
    for b, h, s, dk, dv in BENCH:
        p = Problem(b, h, s, dk, dv, "bfloat16")
        jobs.append((p, default_config(p, "sm_90a", sm_count()), model_call(p)))
        fused = dkdv_config(p, "sm_90a", sm_count())
        if fused is not None:
            jobs.append((p, fused, dkdv_call(p)))
    t = time.time()
    from kernel_static import config as sc

    def as_static(p, c, call):  # the tree before's own types
        return sc.Problem(**p.to_dict()), sc.KernelConfig(**c.to_dict()), sc.Call(**call.to_dict())

    static.precompile([as_static(*j) for j in jobs], arch="sm_90a", workers=16)
    precompile(jobs, arch="sm_90a", workers=16)
    emit(kind="cost_compiled", seconds=time.time() - t)
    for p, config, call in jobs:
        kerns = {"static": static.build(*as_static(p, config, call)), "generic": build(p, config, call)}
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (
            torch.randn(p.batch, p.seqlen, p.heads, d, generator=gen, device="cuda").to(torch.bfloat16) * 0.5
            for d in (p.dk, p.dk, p.dv)
        )
        do = torch.randn_like(v)
        decay = torch.tensor([1 - 2 ** (-5 - i) for i in range(p.heads)], device="cuda")
        final = torch.empty(p.batch * p.heads, 1, p.dk, p.dv, device="cuda")

        def fn(kern):
            if call.dkdv:
                return lambda: kern.run_dkdv(q, k, v, do, decay)
            return lambda: kern.run(q, k, v, decay, None, final.view(p.batch, p.heads, p.dk, p.dv))

        outs = {n: fn(kn)() for n, kn in kerns.items()}
        same = all(torch.equal(a, b) for a, b in zip(*outs.values()) if a is not None)
        times = {n: [] for n in kerns}
        host = {n: [] for n in kerns}
        for _ in range(5):  # the two take turns; the GPU's time with the host's launches queued ahead
            for n, kn in kerns.items():
                timing = time_gpu(fn(kn), host_ahead=True)
                times[n].append(timing.median_ms)
                host[n].append(timing.host_ms)
        med = {n: sorted(v)[2] for n, v in times.items()}
        host_med = {n: sorted(v)[2] for n, v in host.items()}
        emit(
            kind="cost",
            shape=f"{p.batch}x{p.heads}x{p.seqlen}",
            dk=p.dk,
            dv=p.dv,
            config=config.label,
            call="dkdv" if call.dkdv else "forward",
            static_ms=med["static"],
            generic_ms=med["generic"],
            ratio=med["generic"] / med["static"],
            static_host_ms=host_med["static"],
            generic_host_ms=host_med["generic"],
            bitwise_same=same,
            rounds=times,
        )


def shapes() -> None:
    """Run in a fresh process after ``warmup`` filled the disk cache."""
    import glob
    import os

    from tilelang import env

    from kernel import builder
    from kernel.ops import decay_attention

    def cache_entries() -> int:  # a real compile adds one; a load from the disk cache none
        return len(glob.glob(os.path.join(env.TILELANG_CACHE_DIR, "*", "*", "*")))

    loads = []
    compile_kernel = builder.compile_kernel

    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = compile_kernel(*args, **kwargs)
        loads.append(round(time.perf_counter() - t, 3))
        return out

    builder.compile_kernel = timed
    t = time.perf_counter()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    emit(kind="cuda_init", seconds=time.perf_counter() - t)
    entries = cache_entries()
    t0 = time.perf_counter()
    h, dk, dv = 16, 128, 128
    decay = torch.tensor([1 - 2 ** (-5 - i) for i in range(h)], device="cuda")
    rng = random.Random(0)

    def step(b, s):
        q, k, v = (
            torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for d in (dk, dk, dv)
        )
        o, _ = decay_attention(q, k, v, decay)
        o.float().sum().backward()
        torch.cuda.synchronize()

    step(2, 1000)
    emit(
        kind="first_call",
        seconds=time.perf_counter() - t0,
        kernels=compiles(),
        load_seconds=list(loads),
        new_cache_entries=cache_entries() - entries,
    )
    seen = {(2, 1000)}
    for round_ in ("first fifty: configs loaded on first use", "next fifty, same process"):
        sizes = []
        while len(sizes) < 50:
            b, s = rng.randint(1, 8), rng.randint(1, 6000)
            if (b, s) not in seen:
                seen.add((b, s))
                sizes.append((b, s))
        fifty(round_, sizes, step, loads, cache_entries, entries)


def fifty(round_, sizes, step, loads, cache_entries, entries) -> None:
    before, done = compiles(), len(loads)
    t = time.perf_counter()
    for b, s in sizes:
        step(b, s)
    emit(
        kind="fifty_shapes",
        round=round_,
        seconds=time.perf_counter() - t,
        new_kernels=compiles() - before,
        load_seconds=loads[done:],
        new_cache_entries=cache_entries() - entries,
        shapes=sizes,
    )


def warm() -> None:
    from kernel.ops.serve import warmup

    t = time.perf_counter()
    results = warmup(16, 128, 128, "bfloat16", backward=True, arch="sm_90a", sms=sm_count(), workers=16)
    failed = [r.message[:200] for r in results if not hasattr(r, "registers")]
    emit(kind="warmup", seconds=time.perf_counter() - t, jobs=len(results), failed=failed)


if __name__ == "__main__":
    {"check": check_cases, "cost": cost, "shapes": shapes, "warmup": warm}[sys.argv[1]]()
