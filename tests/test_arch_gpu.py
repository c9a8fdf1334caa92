"""The Ampere and Ada code paths on the GPU at hand (marked ``gpu``; skipped without CUDA).

``kernel.build(..., lower_for=ARCH)`` lowers the kernel as for ARCH (``cp.async`` and
``mma.sync``, no wgmma, no TMA) and nvcc assembles that code for the local GPU
(``kernel.arch.target(ARCH, run_on=...)``), so an H200 runs the sm_80, sm_86 and sm_89
paths. Each case runs on fresh inputs into NaN-filled outputs and is checked against
reference C (``kernel.validate.check``), in the model form and the plain call.
"""

import pytest
import torch
from helpers import selected

from kernel import KernelConfig, Problem, build
from kernel.arch import ARCHS, local_arch
from kernel.builder import cuda_arch, precompile
from kernel.config import Call, model_call
from kernel.probe import ProbeFailure, ProbeResult
from kernel.validate import check
from refs import TOLERANCE

pytestmark = pytest.mark.gpu

PATHS = [name for name, arch in ARCHS.items() if not arch.wgmma and arch.capability < (9, 0)]
# (problem, config): the sync, async-order and transposed-order steps, a ragged tail, a
# split, bf16, DK != DV.
CASES = [
    (Problem(2, 3, 300, 64, 64), KernelConfig(32, 32, 1, 128, "smem")),
    (Problem(2, 3, 1000, 128, 128), KernelConfig(64, 64, 2, 128, "smem")),
    (Problem(1, 4, 777, 64, 128, "bfloat16"), KernelConfig(64, 128, 2, 256, "smem")),
    (Problem(2, 2, 1000, 128, 128), KernelConfig(64, 64, 2, 256, "smem", segments=4)),
]


def _call(problem: Problem, form: str) -> Call:
    return model_call(problem) if form == "model" else Call()


@pytest.fixture(scope="module")
def compiled(request) -> dict[tuple, ProbeResult]:
    """Every selected case probed, and compiled as ``build(..., lower_for=arch)`` compiles
    it here, ahead of the tests and in parallel (one architecture at a time)."""
    cases = selected(request, "arch", "problem", "config", "form")
    found = {}
    for arch in PATHS:
        mine = [case for case in cases if case[0] == arch]
        jobs = [(p, c, _call(p, form)) for _, p, c, form in mine]
        found |= dict(zip(mine, precompile(jobs, arch=arch, run_on=cuda_arch())))
    return found


@pytest.mark.parametrize("arch", PATHS)
@pytest.mark.parametrize("problem,config", CASES, ids=str)
@pytest.mark.parametrize("form", ["model", "plain"])
def test_older_architecture_paths_match_c_on_this_gpu(arch, problem, config, form, compiled):
    call = _call(problem, form)
    res = compiled[arch, problem, config, form]
    if isinstance(res, ProbeFailure):
        pytest.skip(f"the compiler refuses this config for {arch}: {res.message[:200]}")
    if res.smem_bytes > torch.cuda.get_device_properties(0).shared_memory_per_block_optin:
        pytest.skip(f"{res.smem_bytes} B of shared memory: more than this GPU has")
    kernel = build(problem, config, call, lower_for=arch)
    assert "wgmma" not in kernel.source and "tma" not in kernel.source.lower()
    result = check(kernel, seed=11)
    assert result["nan_count"] == 0, result
    assert result["rel_l2"] < TOLERANCE, result


def test_this_gpu_is_a_target():
    assert local_arch() in ARCHS
