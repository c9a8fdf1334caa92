"""Issue 16: the cost of reading the decay at run time, in one run on the H200.

The kernel of commit 26c71ef (alpha a compile-time constant; its package copied to
``.old/kernel_static`` with its imports renamed, see experiments/README.md) against the
current kernel (each head's alpha read at run time), at the tuned configs of three shapes,
timed alternately (``kernel.timing.alternating``, three rounds of CUDA-event medians, L2
flushed), after both are checked against reference C. The current kernel is also timed in
the model form: per-head decays, a query scale, and the final state returned (and taken).

    python3 experiments/model/runtime_decay.py --out DIR

It ran at commit 8d51598 (``runtime_decay.jsonl``). Later, ``Problem`` lost its alpha
(issue 16), so run it from a worktree of that commit: ``git worktree add /tmp/rd 8d51598``.
"""

import argparse
import importlib
import json
import sys
from functools import partial
from pathlib import Path

import torch

import refs
from kernel.builder import build, constant_decay, cuda_arch, precompile
from kernel.config import Call, KernelConfig, Problem
from kernel.timing import alternating
from kernel.validate import check, random_qkv

CASES = [
    (Problem(8, 16, 4096, 128, 128, 0.99), KernelConfig(64, 128, 3, 256, "smem", 1)),
    (Problem(2, 16, 16384, 128, 128, 0.99), KernelConfig(64, 128, 3, 256, "smem", 4)),
    (Problem(1, 8, 32768, 128, 128, 0.99), KernelConfig(64, 128, 2, 256, "smem", 16)),
]


def model_calls(problem: Problem) -> list[Call]:
    """The model form: the query scale DK^-1/2 and the final state out, without and with
    an initial state in."""
    scale = problem.dk**-0.5
    return [Call(scale, False, True), Call(scale, True, True)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--static", type=Path, default=Path(".old"), help="folder holding kernel_static/")
    args = parser.parse_args()
    sys.path.insert(0, str(args.static))
    static_builder = importlib.import_module("kernel_static.builder")
    args.out.mkdir(parents=True, exist_ok=True)
    arch = cuda_arch()
    static_builder.precompile(CASES, arch=arch)
    precompile([(p, c, call) for p, c in CASES for call in (Call(), *model_calls(p))], arch=arch)
    log = (args.out / "runtime_decay.jsonl").open("w")
    for problem, config in CASES:
        p = problem
        q, k, v = random_qkv(p, seed=0)
        out = torch.empty_like(v)
        decays = torch.tensor([1 - 2 ** (-5 - h) for h in range(p.heads)], device="cuda")
        state = torch.randn(p.batch, p.heads, p.dk, p.dv, device="cuda")
        final = torch.empty_like(state)
        static = static_builder.build(p, config)
        runtime = build(p, config)
        model, model_state = (build(p, config, call) for call in model_calls(p))
        ref = refs.kernel_mimic(q, k, v, p.alpha, config.chunk)
        errors = {"static": refs.rel_l2(static(q, k, v), ref), "runtime": refs.rel_l2(runtime(q, k, v), ref)}
        errors |= {
            "model": check(model, seed=1, decay=decays),
            "model_state": check(model_state, seed=2, decay=decays),
        }
        alpha = constant_decay(p.alpha, p.heads, q.device)
        calls = {
            "static": partial(static, q, k, v, out=out),
            "runtime": partial(runtime, q, k, v, decay=alpha, out=out),
            "model": partial(model, q, k, v, decay=decays, final_state=final, out=out),
            "model_state": partial(
                model_state, q, k, v, decay=decays, initial_state=state, final_state=final, out=out
            ),
        }
        times = alternating(calls, rounds=3)
        med = {name: sorted(t)[1] for name, t in times.items()}
        row = {
            "problem": p.to_dict(),
            "config": config.label,
            "errors": errors,
            "all_ms": times,
            "median_ms": med,
            "runtime_over_static": med["runtime"] / med["static"],
            "model_over_static": med["model"] / med["static"],
        }
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(
            json.dumps(
                {k: row[k] for k in ("config", "median_ms", "runtime_over_static", "model_over_static")}
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
