"""The backward at DV = 256 as two backwards at DV = 128 (issue 30: 128/256's forward plus
backward is 2.15x fla's, short of 3x, because its backward runs three sweeps, 4.54x its
floor: the fused dk and dv sweep holds at most a 128 x 128 state, ``kernel.dkdv``).

``o[..., j]`` depends on ``v[..., j]`` alone, so with ``v = [v1 | v2]`` and ``do = [do1 | do2]``
split along DV (and the states' DV columns with them)::

    dq = dq(v1, do1) + dq(v2, do2)    dk = dk(v1, do1) + dk(v2, do2)    dv = [dv(v1, do1) | dv(v2, do2)]

each term the backward of a 128/128 problem, which the fused sweep serves (its dq sweep and
one fused sweep). Whether that is faster is what this measures, at each shape in one
process: the op's backward as served today (``kernel.ops.attention._backward``: three
sweeps), the halves (the same op on contiguous copies of the halves, then the sums and the
concatenation, all timed), and ``dq_once``: dq from the one sweep served today (at DK =
256, DV = 128), dk and dv from the fused sweep on each half (``kernel.ops.backward`` with
a fused sweep that splits DV), with ``kernel.timing.time_gpu`` (the host queued ahead, L2
flushed, median), RetNet's decays and scale, bf16. The halves are checked against the op's
gradients and both against reference E.

    python3 experiments/backward/dv_halves.py 4x8x8192 [BxHxS ...] > dv_halves.jsonl

``--cpu``: the identity alone, on reference E in fp64 at a small shape (no GPU).
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import refs  # noqa: E402
from kernel.config import Problem, model_call, retnet_decay  # noqa: E402

HALF = 128


def halves_backward(backward, q, k, v, do, decay, scale):
    """``backward(q, k, v, do, decay, scale) -> (dq, dk, dv)`` at DV = 256 from two calls
    at DV = 128."""
    parts = [
        backward(q, k, v[..., i : i + HALF].contiguous(), do[..., i : i + HALF].contiguous(), decay, scale)
        for i in range(0, v.shape[-1], HALF)
    ]
    dq = sum(p[0] for p in parts)
    dk = sum(p[1] for p in parts)
    return dq, dk, torch.cat([p[2] for p in parts], dim=-1)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def reference(q, k, v, do, decay, scale):
    return refs.chunked_backward(q, k, v, decay, 64, do, scale=scale)[:3]


def on_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    b, s, h, dk, dv = 2, 200, 3, 64, 256
    q, k = (torch.randn(b, s, h, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v, do = (torch.randn(b, s, h, dv, generator=gen, dtype=torch.float64) for _ in range(2))
    decay = torch.tensor(retnet_decay(h), dtype=torch.float64)
    whole = reference(q, k, v, do, decay, dk**-0.5)
    split = halves_backward(reference, q, k, v, do, decay, dk**-0.5)
    for name, a, w in zip(("dq", "dk", "dv"), split, whole, strict=True):
        print(json.dumps({"kind": "identity", "grad": name, "rel_l2": rel_l2(a, w)}))


def on_gpu(shapes: list[str]) -> None:
    from kernel.builder import cuda_arch, precompile
    from kernel.config import Call
    from kernel.environment import environment
    from kernel.ops import serve
    from kernel.ops.attention import _backward
    from kernel.ops.backward import backward
    from kernel.ops.serve import kernel_for
    from kernel.timing import time_gpu
    from kernel.validate import random_qkv

    def served(q, k, v, do, decay, scale):
        return _backward(q, k, v, do, decay, 1.0, scale, None, None, None)[:3]

    def dq_once(q, k, v, do, decay, scale):
        b = q.shape[0]

        def sweep(q_, k_, v_, h0, want_final, offsets, reverse):  # no state in or out here
            p = Problem(b, q_.shape[2], q_.shape[1], q_.shape[-1], v_.shape[-1], "bfloat16")
            return kernel_for(p, Call(scale, reverse=reverse), b).run(q_, k_, v_, decay)[0], None

        def fused(q_, k_, v_, do_, start, want_final, offsets):
            half = Problem(b, q_.shape[2], q_.shape[1], q_.shape[-1], HALF, "bfloat16")
            kern = kernel_for(half, Call(scale, reverse=True, dkdv=True), b)
            cut = lambda x, i: x[..., i : i + HALF].contiguous()  # noqa: E731
            cuts = range(0, v_.shape[-1], HALF)
            parts = [kern.run_dkdv(q_, k_, cut(v_, i), cut(do_, i), decay) for i in cuts]
            return sum(p[0] for p in parts), torch.cat([p[1] for p in parts], dim=-1), None

        return backward(sweep, q, k, v, do, decay, scale, fused=fused)[:3]

    print(json.dumps({"kind": "env", "env": environment()}), flush=True)
    for shape in shapes:
        b, h, s = map(int, shape.split("x"))
        problem = Problem(b, h, s, 128, 256, "bfloat16")
        q, k, v = random_qkv(problem, seed=2)
        do = torch.randn_like(v, dtype=torch.float32).to(v.dtype)
        decay = torch.tensor(retnet_decay(h), dtype=torch.float32, device="cuda")
        scale = model_call(problem).scale
        half = Problem(b, h, s, 128, HALF, "bfloat16")  # compiled apart, as the bench does, not in here
        jobs = serve.training_jobs(problem, Call(scale), b) | serve.training_jobs(half, Call(scale), b)
        precompile(sorted(jobs, key=str), arch=cuda_arch())
        ref = reference(q, k, v, do, decay, scale)
        runs = {
            "served": lambda: served(q, k, v, do, decay, scale),
            "halves": lambda: halves_backward(served, q, k, v, do, decay, scale),
            "dq_once": lambda: dq_once(q, k, v, do, decay, scale),
        }
        got = {name: run() for name, run in runs.items()}
        for name, run in runs.items():
            t = time_gpu(run, host_ahead=True)
            grads = zip(("dq", "dk", "dv"), got[name], ref, got["served"], strict=True)
            errors = {g: (rel_l2(a, r), rel_l2(a, o)) for g, a, r, o in grads}
            print(json.dumps({
                "kind": "time", "shape": shape, "dk": 128, "dv": 256, "impl": name, **t.to_dict(),
                "rel_l2_ref_e": {g: e[0] for g, e in errors.items()},
                "rel_l2_served": {g: e[1] for g, e in errors.items()},
            }), flush=True)  # fmt: skip


if __name__ == "__main__":
    on_cpu() if sys.argv[1:] == ["--cpu"] else on_gpu(sys.argv[1:])
