"""The kernel against reference C on a real GPU (marked ``gpu``; skipped without CUDA).

Every case runs on fresh random inputs into an output pre-filled with NaN, so an element
the kernel skips fails the test as surely as a wrong one.
"""

import itertools
import zlib

import pytest
import torch

from kernel import SEED_CONFIG, KernelConfig, Problem, build
from kernel.builder import cuda_arch, precompile
from kernel.resources import ProbeFailure, ProbeResult, Resources
from kernel.validate import ALPHAS, check, validation_grid
from refs import TOLERANCE

pytestmark = pytest.mark.gpu

# (batch, heads, seqlen, dk, dv): one token, S < C, ragged last chunk, DK != DV, S % C != 0.
SHAPES = [
    (1, 1, 1, 64, 64),
    (1, 2, 17, 128, 128),
    (2, 3, 300, 128, 128),
    (1, 2, 1000, 64, 128),
    (3, 1, 129, 64, 64),
]
DTYPES = ["float16", "bfloat16"]
CONFIG_SWEEP = [(Problem(2, 3, 300, d, d, 0.9), c) for d in (128, 64) for c in validation_grid(d)]
NUMERIC_CASES = [
    (Problem(*shape, alpha, dtype), SEED_CONFIG)
    for shape, alpha, dtype in itertools.product(SHAPES, ALPHAS, DTYPES)
]
NUMERIC_CASES += [
    (Problem(2, 3, 300, 128, 128, alpha, dtype), KernelConfig(64, 64, 1, 128))
    for alpha, dtype in itertools.product(ALPHAS, DTYPES)
]


@pytest.fixture(scope="session")
def compiled() -> dict[tuple[Problem, KernelConfig], ProbeResult]:
    """Compile every case once, in parallel; tests then build from TileLang's disk cache."""
    cases = CONFIG_SWEEP + NUMERIC_CASES
    return dict(zip(cases, precompile(cases, arch=cuda_arch())))


def _build_or_skip(problem: Problem, config: KernelConfig, compiled: dict) -> object:
    res = compiled[problem, config]
    if isinstance(res, ProbeFailure):
        pytest.skip(f"the compiler rejects this config: {res.message[:200]}")
    if not res.fits_smem:
        pytest.skip(f"{res.smem_bytes} B of shared memory is over the limit; the probe rejects it")
    return build(problem, config)


def _assert_matches_c(kernel, seed: int) -> None:
    result = check(kernel, seed=seed)
    assert result["nan_count"] == 0, result
    assert result["rel_l2"] < TOLERANCE, result


@pytest.mark.parametrize("problem,config", NUMERIC_CASES, ids=str)
def test_alphas_dtypes_shapes(problem, config, compiled):
    assert isinstance(compiled[problem, config], Resources)  # these configs always compile
    kernel = _build_or_skip(problem, config, compiled)
    _assert_matches_c(kernel, seed=zlib.crc32(repr((problem, config)).encode()))


@pytest.mark.parametrize("problem,config", CONFIG_SWEEP, ids=str)
def test_every_accepted_config(problem, config, compiled):
    _assert_matches_c(_build_or_skip(problem, config, compiled), seed=7)


def test_fresh_inputs_each_call_and_reuse_of_output():
    """Two calls with different inputs into the same output buffer both match C."""
    kernel = build(Problem(2, 2, 200, 64, 64, 0.95), SEED_CONFIG)
    _assert_matches_c(kernel, seed=1)
    _assert_matches_c(kernel, seed=2)


def test_rejects_bad_tensors():
    problem = Problem(1, 2, 64, 64, 64, 0.9)
    kernel = build(problem, SEED_CONFIG)
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="float16"):
        kernel(q.float(), q, q)
    with pytest.raises(ValueError, match="shape"):
        kernel(q[:, :32], q, q)
    with pytest.raises(ValueError, match="CUDA"):
        kernel(q.cpu(), q, q)
    with pytest.raises(ValueError, match="contiguous"):
        kernel(q.transpose(1, 2).contiguous().transpose(1, 2), q, q)


def test_exported_config_loads_into_a_ready_kernel(tmp_path):
    from kernel.deploy import FORMAT, VERSION, load_kernel
    from kernel.environment import environment, write_json

    problem = Problem(2, 3, 300, 64, 64, 0.9)
    path = tmp_path / "best.json"
    write_json(
        path,
        {
            "format": FORMAT,
            "version": VERSION,
            "problem": problem.to_dict(),
            "environment": environment(),
            "configs": [{"config": KernelConfig(64, 64, 1, 128).to_dict()}],
        },
    )
    kernel = load_kernel(path)
    assert kernel.problem == problem and kernel.config == KernelConfig(64, 64, 1, 128)
    _assert_matches_c(kernel, seed=3)


@pytest.mark.parametrize("alpha", [0.3, 1e-3])
def test_decay_underflowing_fp32_keeps_the_state_finite(alpha):
    """alpha^C below fp32's range (0.3^128 = 1e-67) must decay the state to 0, not to NaN
    (every power of alpha is computed at run time: exp2 of a large negative number is 0)."""
    _assert_matches_c(build(Problem(2, 2, 300, 64, 64, alpha), KernelConfig(128, 32, 1, 128)), seed=4)


# The sequence-split variant: ragged last segment, S barely over one chunk, a bf16 carry
# that underflows fp32 (0.5^256), scores in registers, DK != DV, 64 segments, and two
# segments (no carry kernel launched).
SPLIT_CASES = [
    (Problem(2, 3, 1000, 64, 128, 0.9, "bfloat16"), KernelConfig(64, 128, 3, 256, segments=2)),
    (Problem(2, 3, 300, 64, 64, 0.9), KernelConfig(64, 32, 2, 128, segments=3)),
    (Problem(1, 2, 1000, 128, 128, 0.5, "bfloat16"), KernelConfig(64, 64, 1, 256, segments=4)),
    (Problem(1, 4, 4096, 128, 128, 0.99), KernelConfig(64, 128, 2, 256, segments=16)),
    (Problem(1, 1, 65, 64, 64, 1.0), KernelConfig(64, 32, 1, 128, segments=2)),
    (Problem(2, 2, 777, 64, 128, 0.8, "bfloat16"), KernelConfig(32, 64, 2, 128, segments=8)),
    (Problem(1, 2, 1000, 128, 128, 0.95), KernelConfig(64, 32, 1, 128, "regs", segments=5)),
    (Problem(1, 3, 4096, 128, 128, 0.999), KernelConfig(64, 128, 2, 256, segments=64)),
]


@pytest.mark.parametrize("problem,config", SPLIT_CASES, ids=str)
def test_sequence_split_variant_matches_c(problem, config):
    _assert_matches_c(build(problem, config), seed=6)


@pytest.mark.parametrize("problem,config", [SPLIT_CASES[0], SPLIT_CASES[1], SPLIT_CASES[4]], ids=str)
def test_sequence_split_writes_every_state_it_reads(problem, config, monkeypatch):
    """The split's states buffer is uninitialised memory: with it NaN-filled before each
    call, the outputs still match (two segments, where no carry kernel runs, and three)."""
    from kernel import variants

    empty = variants.states_buffer
    monkeypatch.setattr(variants, "states_buffer", lambda *a: empty(*a).fill_(float("nan")))
    _assert_matches_c(build(problem, config), seed=7)
