"""Two best configs timed again, alternately, in this one process (``compare --remeasure``),
so that their ratio does not depend on when each study ran."""

from functools import partial

import torch

from kernel.builder import build
from kernel.config import KernelConfig, Problem, model_call
from kernel.timing import alternating
from kernel.validate import random_qkv
from tuner.options import UsageError


def remeasure(problem: Problem, mine: KernelConfig, theirs: KernelConfig, rounds: int = 3) -> dict:
    """Time ``mine`` (the study's) and ``theirs`` (the yardstick's) on ``problem`` in the
    model form the studies measured, alternately for ``rounds`` rounds; return each one's
    median and every time in ms, and the study's median over the yardstick's.
    ``UsageError`` without a CUDA device."""
    if not torch.cuda.is_available():
        raise UsageError("--remeasure needs a CUDA device")
    q, k, v = random_qkv(problem, seed=12345)
    out = torch.empty_like(v)
    final = torch.empty(problem.batch, problem.heads, problem.dk, problem.dv, device=q.device)
    call = model_call(problem)  # the form the studies measured, with its default decay
    kernels = {"study": build(problem, mine, call), "yardstick": build(problem, theirs, call)}
    times = alternating(
        {name: partial(kern, q, k, v, out=out, final_state=final) for name, kern in kernels.items()},
        rounds=rounds,
    )
    med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    return {"median_ms": med, "all_ms": times, "study_over_yardstick": med["study"] / med["yardstick"]}
