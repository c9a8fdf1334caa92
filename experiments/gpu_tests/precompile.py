"""Compile, in parallel processes, every kernel one device call of this folder runs, so that the
tests and scripts after it load them from TileLang's disk cache (a call has 600 s; kernels
compiled one at a time inside each script would take most of it).

    source .gpu/setup.sh && python3 experiments/gpu_tests/precompile.py [GROUP ...]

The jobs, each as its user computes it, in groups (``GROUPS``; all where none is named):
``gated-backward``, ``tests/test_gated_backward.py``'s GPU cases (their backward's passes too);
``host-path``, ``tests/test_backward.py``'s zero-start cases and ``experiments/host_path``'s
training calls; ``gated-scripts``, ``experiments/gated/training.py``'s and ``layer.py``'s gated
calls (fla's ``SimpleGatedLinearAttention(hidden_size=1024, num_heads=8)``: 8 heads of 128 by
128).
"""

import sys
import time
from pathlib import Path

from kernel.builder import cuda_arch, precompile
from kernel.config import Call, Problem
from kernel.gated_build import TORCH_DTYPES, pass_jobs
from kernel.ops.serve import kernel_job, training_jobs
from kernel.probe import Resources


def gated(b, h, s, dk, dv, dtype, groups, call, n):
    return kernel_job(Problem(b, h, s, dk, dv, dtype, "token", groups), call, n)


def gated_backward_jobs() -> set:
    """``tests/test_gated_backward.py``'s GPU cases: their forward and its backward's passes."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from test_gated_backward import GPU_CASES

    jobs = set()
    for (b, s, groups, h, dk, dv, lengths), dtype in GPU_CASES:
        n = b if lengths is None else len(lengths)
        call = Call(dk**-0.5, True, True, lengths is not None)
        jobs.add(gated(b, h, s, dk, dv, TORCH_DTYPES[dtype], groups, call, n))
        jobs.update(pass_jobs(Problem(b, h, s, dk, dv, TORCH_DTYPES[dtype], "token", groups), call))
    return jobs


def host_path_jobs() -> set:
    """``tests/test_backward.py``'s zero-start cases, and ``experiments/host_path``'s training
    calls (``measure.py``, ``breakdown.py``)."""
    jobs = set()
    for b, s, lengths in [(2, 300, None), (1, 510, [1, 63, 64, 65, 300, 17])]:  # test_backward's zero start
        n = b if lengths is None else len(lengths)
        jobs |= training_jobs(
            Problem(b, 4, s, 128, 128, "float16"), Call(0.1, False, True, lengths is not None), n
        )
    for b, s in ((8, 4096), (2, 16384)):
        jobs |= training_jobs(Problem(b, 16, s, 128, 128, "float16"), Call(128**-0.5, False, True, False), b)
    return jobs


def gated_script_jobs() -> set:
    """``experiments/gated/training.py``'s and ``layer.py``'s gated calls, forward and backward."""
    jobs = set()
    for b, h, s, dk, dv, groups in [
        (8, 16, 4096, 128, 128, 16),
        (16, 32, 2048, 64, 64, 32),
        (4, 24, 4096, 128, 64, 1),
    ]:
        jobs.add(gated(b, h, s, dk, dv, "float16", groups, Call(dk**-0.5), b))  # gated/training.py
        jobs.update(pass_jobs(Problem(b, h, s, dk, dv, "float16", "token", groups), Call(dk**-0.5)))
    for dtype in ("bfloat16", "float16"):  # gated/layer.py
        for b, s, call, n in ((4, 2048, Call(128**-0.5), 4), (1, 4019, Call(128**-0.5, packed=True), 6)):
            jobs.add(gated(b, 8, s, 128, 128, dtype, 8, call, n))
            jobs.update(pass_jobs(Problem(b, 8, s, 128, 128, dtype, "token", 8), call))
    return jobs


GROUPS = {
    "gated-backward": gated_backward_jobs,
    "host-path": host_path_jobs,
    "gated-scripts": gated_script_jobs,
}


def main() -> None:
    named = sys.argv[1:] or list(GROUPS)
    unknown = [name for name in named if name not in GROUPS]
    if unknown:
        print(f"precompile.py: unknown groups {unknown}; the groups: {', '.join(GROUPS)}", file=sys.stderr)
        sys.exit(2)
    jobs = set().union(*(GROUPS[name]() for name in named))
    start = time.perf_counter()
    results = precompile(sorted(jobs, key=str), arch=cuda_arch())
    bad = [r for r in results if not isinstance(r, Resources)]
    print(
        f"precompiled {len(jobs)} kernels ({', '.join(named)}) in {time.perf_counter() - start:.0f} s; "
        f"failed: {bad}",
        flush=True,
    )


if __name__ == "__main__":
    main()
