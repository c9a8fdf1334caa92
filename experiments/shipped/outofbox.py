"""What a model gets out of the box, in a fresh process with no table of its own: what
``decay_attention`` serves with no step of the user's (``serve.DEFAULT``: a shipped table
of ``kernel.ops.tables`` where one matches, else the rule), the rule before it was fitted
(``rule.legacy_config``, served as a table of its configs at each shape, for the forward
and the dq sweep; the fused dk+dv sweep's rule is unchanged) and fla's ``chunk_simple_gla``,
each timed forward and forward plus backward at the bench shapes and at a shape no sweep
tuned, in one run.

    python experiments/shipped/outofbox.py [DTYPE [forward]] > outofbox.jsonl

With ``forward``: ours alone, the forward alone, timed with the host's launches queued
ahead (the GPU's time; ``fwd_host_ms`` the host's per call); without it, the forward is
timed as the eager call (host included).

The call is the model's: ``decay_attention(q, k, v, decay, output_final_state=True)``,
RetNet's decays, scale DK^-1/2. Each timing (``kernel.timing.time_gpu``: CUDA events,
L2 flushed, median) follows a check of the served output against fla's (relative L2).
Forward plus backward is timed with the host's launches queued ahead (``host_ahead``),
so that it measures the GPU, not the eager autograd's host time. One line per (shape,
mode): ``fwd_ms``, ``fwdbwd_ms``, the served config and the first call's seconds.
"""

import json
import math
import sys
import time

import torch
from rule import legacy_config

import refs
from kernel.builder import cuda_arch, precompile, sm_count
from kernel.config import Problem, model_call, retnet_decay
from kernel.ops import decay_attention, serve
from kernel.ops.dispatch import Dispatch, DispatchEntry
from kernel.timing import time_gpu
from tuner.peers import fla_simple_gla

# (B, H, S, DK, DV): the bench's shapes, the added ones, and shapes no sweep timed.
SHAPES = [
    (8, 16, 4096, 128, 128),
    (16, 16, 2048, 128, 128),
    (4, 16, 8192, 128, 128),
    (2, 16, 16384, 128, 128),
    (1, 8, 32768, 128, 128),
    (4, 8, 8192, 128, 256),
    (16, 32, 2048, 64, 64),
    (3, 12, 6000, 128, 128),
]


def legacy_table(dtype: str, sms: int) -> Dispatch:
    """The legacy rule's forward configs at each shape, and at its dq sweep's (DV, DK)."""
    problems = {Problem(b, h, s, x, y, dtype) for b, h, s, dk, dv in SHAPES for x, y in ((dk, dv), (dv, dk))}
    return Dispatch([DispatchEntry(p, legacy_config(p, sms)) for p in sorted(problems, key=str)], {})


def main(dtype: str, forward_only: bool) -> None:
    torch_dtype = getattr(torch, dtype)
    table = serve.served_table()
    legacy = legacy_table(dtype, sm_count())
    print(json.dumps({"kind": "env", "shipped": table and table.environment}), flush=True)
    modes = {"out of the box": serve.DEFAULT, "legacy rule": legacy}
    jobs = set()  # every kernel both modes serve, compiled ahead across the cores
    for mode in modes.values():
        serve.use_table(mode)
        for b, h, s, dk, dv in SHAPES:
            p = Problem(b, h, s, dk, dv, dtype)
            jobs |= serve.training_jobs(p, model_call(p), b)
    start = time.perf_counter()
    precompile(sorted(jobs, key=str), arch=cuda_arch(), workers=16)
    print(
        json.dumps({"kind": "compiled", "kernels": len(jobs), "s": time.perf_counter() - start}), flush=True
    )
    for b, h, s, dk, dv in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(b * s + dk)
        q, k, v = (
            torch.randn(b, s, h, d, device="cuda", generator=gen, dtype=torch_dtype) for d in (dk, dk, dv)
        )
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        decay = torch.tensor(retnet_decay(h), device="cuda", dtype=torch.float32)
        do = torch.randn(b, s, h, dv, device="cuda", generator=gen, dtype=torch_dtype)
        ours = lambda: decay_attention(q, k, v, decay, output_final_state=True)  # noqa: E731
        g_gamma = decay.log()
        fla = lambda: fla_simple_gla(q, k, v, g_gamma, scale=dk**-0.5)  # noqa: E731
        # forward only: no fla (its first call autotunes for minutes); checked against
        # reference C (fp32, the kernels' chunking) instead
        ref = lambda: refs.kernel_mimic(q.detach(), k.detach(), v.detach(), decay, 64, scale=dk**-0.5)  # noqa: E731
        want = (ref() if forward_only else fla()[0]).detach().double()
        ahead = forward_only  # the first run timed the forward as the eager call, host included
        for mode in (*modes, *(() if forward_only else ("fla",))):
            if mode != "fla":
                serve.use_table(modes[mode])
            fn = fla if mode == "fla" else ours
            start = time.perf_counter()
            o = fn()[0]
            o.backward(do)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - start
            err = float((o.detach().double() - want).norm() / want.norm())
            row = dict(kind="time", b=b, h=h, s=s, dk=dk, dv=dv, dtype=dtype, mode=mode)
            row |= {"rel_l2_vs_ref_c" if forward_only else "rel_l2_vs_fla": err, "first_call_s": first_s}
            if mode != "fla":
                p = Problem(b, h, s, dk, dv, dtype)
                row["config"] = serve.kernel_job(p, model_call(p), b)[1].label
                row["sweeps"] = {n: c.label for n, c in serve.backward_configs(p, model_call(p), b).items()}
            if not math.isfinite(err) or err > 2e-2:
                print(json.dumps(row | {"skipped": "disagrees with fla"}), flush=True)
                continue
            with torch.no_grad():
                fwd = time_gpu(fn, warmup_ms=10, rep_ms=50, host_ahead=ahead)
            row |= {"fwd_ms": fwd.median_ms, "fwd_host_ms": fwd.host_ms}
            if not forward_only:
                both = time_gpu(lambda: fn()[0].backward(do), warmup_ms=10, rep_ms=50, host_ahead=True)  # noqa: B023
                row["fwdbwd_ms"] = both.median_ms
            print(json.dumps(row), flush=True)
    serve.use_table(serve.DEFAULT)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bfloat16", sys.argv[2:] == ["forward"])
