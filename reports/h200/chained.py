"""Same-run experiment on the GPU: the chained one-kernel split (``kernel.chained``)
against the three-kernel split and the single-pass kernel.

    source .gpu/setup.sh && python3 reports/h200/chained.py > $OUT/chained.jsonl

Every chained config first runs once in a child process with a timeout (a kernel that
waits on another block could hang), checked against reference C with a NaN-prefilled
output; the correct ones and the baselines are then timed in this process, alternating
over three rounds (medians of CUDA events, L2 flushed; ``kernel.timing.alternating``). The
floor is the bytes of Q, K, V and O over the copy rate measured in the same run.
"""

import json
import multiprocessing
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from functools import partial

import torch
from chained_kernel import build_chained
from modes import B1H8, B2H16

from kernel import KernelConfig, Problem, build
from kernel.config import HEADLINE
from kernel.timing import alternating
from kernel.validate import check, random_qkv
from tuner.bench import copy_bandwidth, traffic_bytes

BASELINES = [
    (HEADLINE, KernelConfig(64, 128, 2, 256)),
    (B2H16, KernelConfig(64, 128, 2, 256, segments=4)),
    (B1H8, KernelConfig(64, 128, 2, 256, segments=16)),
]
TIMED = (
    [(HEADLINE, KernelConfig(64, b, 2, 256, segments=n)) for b, n in ((128, 2), (128, 4), (64, 4), (64, 8))]
    + [
        (B2H16, KernelConfig(64, b, 2, 256, segments=n))
        for b, n in ((128, 8), (128, 16), (128, 32), (64, 16), (64, 32))
    ]
    + [
        (B1H8, KernelConfig(64, b, 2, 256, segments=n))
        for b, n in ((128, 16), (128, 32), (128, 64), (64, 32), (64, 64))
    ]
    + [
        (B2H16, KernelConfig(64, 128, 3, 256, segments=16)),
        (B1H8, KernelConfig(64, 128, 3, 256, segments=32)),
    ]
)
CHECKED = [  # correctness only: bf16 with alpha^L underflowing, ragged, DK != DV, C = 32, regs
    (Problem(2, 3, 1000, 128, 128, 0.5, "bfloat16"), KernelConfig(64, 128, 2, 256, segments=4)),
    (Problem(1, 2, 777, 64, 128, 0.8), KernelConfig(64, 64, 1, 128, "regs", segments=8)),
    (Problem(2, 2, 3000, 64, 128, 0.9, "bfloat16"), KernelConfig(32, 64, 2, 128, segments=16)),
    (Problem(1, 1, 65, 128, 128, 0.99), KernelConfig(64, 128, 1, 256, segments=2)),
]


def _compile(case):
    try:
        build_chained(*case, compile_only=True)
        return None
    except Exception as exc:  # reported per case
        return f"{type(exc).__name__}: {str(exc)[-300:]}"


def first_runs() -> int:
    """Child mode: run each compiled chained config once, checked; one JSON line each."""
    for case in TIMED + CHECKED:
        problem, config = case
        row = {"variant": "chained", "problem": problem.to_dict(), "config": config.to_dict()}
        try:
            row |= check(build_chained(*case), seed=21)
        except Exception as exc:
            row |= {"error": f"{type(exc).__name__}: {str(exc)[-300:]}"}
        print(json.dumps(row), flush=True)
    return 0


def main() -> int:
    cases = TIMED + CHECKED
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(os.cpu_count(), mp_context=ctx) as pool:
        for case, error in zip(cases, pool.map(_compile, cases)):
            if error:
                print(json.dumps({"case": [case[0].to_dict(), case[1].label], "compile_error": error}))
    # First runs in a child with a timeout: a kernel whose blocks wait on each other could hang.
    try:
        child = subprocess.run(
            [sys.executable, __file__, "first-runs"], capture_output=True, text=True, timeout=240
        )
        lines = child.stdout.splitlines()
    except subprocess.TimeoutExpired as exc:
        lines = (exc.stdout or b"").decode().splitlines() + [json.dumps({"hang": True})]
    good = []
    for line in (line for line in lines if line.startswith("{")):
        print(line, flush=True)
        row = json.loads(line)
        if row.get("finite") and row["rel_l2"] < 2e-2:
            case = (Problem.from_dict(row["problem"]), KernelConfig.from_dict(row["config"]))
            if case in TIMED:
                good.append(case)
    kernels = {("single/split", *case): build(*case) for case in BASELINES}
    for case in good:
        kern = build_chained(*case)
        row = {"variant": "chained-main", "problem": case[0].to_dict(), "config": case[1].to_dict()}
        print(json.dumps(row | check(kern, seed=31)), flush=True)
        kernels[("chained", *case)] = kern
    bandwidth = copy_bandwidth()
    print(json.dumps({"copy_bandwidth_tbs": bandwidth / 1e12}), flush=True)
    inputs = {p: random_qkv(p, seed=12) for p in {key[1] for key in kernels}}
    outs = {p: torch.empty_like(v) for p, (_, _, v) in inputs.items()}
    times = alternating(
        {key: partial(kern, *inputs[key[1]], out=outs[key[1]]) for key, kern in kernels.items()}
    )
    for (variant, problem, config), ms in times.items():
        floor_ms = traffic_bytes(problem) / bandwidth * 1e3
        median = sorted(ms)[1]
        shape = f"{problem.batch}x{problem.heads}x{problem.seqlen}"
        row = {"variant": variant, "shape": shape, "config": config.label, "median_ms": median}
        print(json.dumps(row | {"x_floor": median / floor_ms, "all_ms": ms}), flush=True)
    return 0


NOWAIT = [
    (B2H16, KernelConfig(64, 128, 2, 256, segments=8)),
    (B2H16, KernelConfig(64, 128, 2, 256, segments=16)),
    (B1H8, KernelConfig(64, 128, 2, 256, segments=16)),
    (B1H8, KernelConfig(64, 128, 2, 256, segments=32)),
    (B1H8, KernelConfig(64, 64, 2, 256, segments=32)),
    # segments short enough for K and V to stay in L2 between the two passes (<= 512 tokens)
    (B2H16, KernelConfig(64, 128, 2, 256, segments=32)),
    (B2H16, KernelConfig(64, 128, 2, 256, segments=64)),
    (B1H8, KernelConfig(64, 128, 2, 256, segments=64)),
    (B1H8, KernelConfig(64, 128, 2, 256, segments=128)),
    (B1H8, KernelConfig(64, 64, 2, 256, segments=64)),
]


def nowait() -> int:
    """Diagnosis: the chained kernel with and without its wait for the previous segment
    (without it the outputs are wrong past the first segment; only the time is kept), so
    the difference is what the chain of carries costs."""
    for case in NOWAIT[int(sys.argv[2]) if sys.argv[2:] else 0 :]:
        kernels = {wait: build_chained(*case, wait=wait) for wait in (True, False)}
        q, k, v = random_qkv(case[0], seed=12)
        out = torch.empty_like(v)
        ms = alternating({wait: partial(kern, q, k, v, out=out) for wait, kern in kernels.items()})
        shape = f"{case[0].batch}x{case[0].heads}x{case[0].seqlen}"
        row = {"shape": shape, "config": case[1].label}
        print(
            json.dumps(row | {"wait_ms": sorted(ms[True])[1], "nowait_ms": sorted(ms[False])[1]}), flush=True
        )
    return 0


if __name__ == "__main__":
    modes = {"first-runs": first_runs, "nowait": nowait}
    sys.exit(modes[sys.argv[1]]() if sys.argv[1:] else main())  # nowait [first case]
