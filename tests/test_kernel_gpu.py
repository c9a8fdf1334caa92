"""The kernel against reference C on a real GPU (marked ``gpu``; skipped without CUDA).

Every case runs on fresh random inputs into an output pre-filled with NaN, so an element
the kernel skips fails the test as surely as a wrong one. A case's decay is one alpha for
every head, or RetNet's per-head gammas where it names none (``check``'s default).
"""

import itertools
import zlib

import pytest
import torch
from helpers import selected

from kernel import SEED_CONFIG, KernelConfig, Problem, build
from kernel.builder import constant_decay, cuda_arch, precompile
from kernel.probe import ProbeFailure, ProbeResult, Resources
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
CONFIG_SWEEP = [(Problem(2, 3, 300, d, d), c, 0.9) for d in (128, 64) for c in validation_grid(d)]
# (problem, config, alpha): every alpha of the validation sweep, and RetNet's decays (None).
NUMERIC_CASES = [
    (Problem(*shape, dtype), SEED_CONFIG, alpha)
    for shape, alpha, dtype in itertools.product(SHAPES, (*ALPHAS, None), DTYPES)
]
NUMERIC_CASES += [
    (Problem(2, 3, 300, 128, 128, dtype), KernelConfig(64, 64, 1, 128), alpha)
    for alpha, dtype in itertools.product((*ALPHAS, None), DTYPES)
]
# DK = 256 (the dq and dk passes of fla's RetNet layers, DV = 2 DK) at its default config.
NUMERIC_CASES += [(Problem(2, 2, 1000, 256, 128), KernelConfig(64, 64, 2, 256), 0.9)]


@pytest.fixture(scope="module")
def compiled(request) -> dict[tuple[Problem, KernelConfig], ProbeResult]:
    """Compile every selected case once, in parallel; tests then build from TileLang's
    disk cache."""
    cases = selected(request, "problem", "config")
    return dict(zip(cases, precompile(cases, arch=cuda_arch())))


def _build_or_skip(problem: Problem, config: KernelConfig, compiled: dict) -> object:
    res = compiled[problem, config]
    if isinstance(res, ProbeFailure):
        pytest.skip(f"the compiler rejects this config: {res.message[:200]}")
    if not res.fits_smem:
        pytest.skip(f"{res.smem_bytes} B of shared memory is over the limit; the probe rejects it")
    return build(problem, config)


def _assert_matches_c(kernel, seed: int, alpha: float | None = None) -> None:
    """``check`` with one ``alpha`` for every head, or RetNet's decays where None."""
    p = kernel.problem
    decay = None if alpha is None else constant_decay(alpha, p.heads, torch.device("cuda"))
    result = check(kernel, seed=seed, decay=decay)
    assert result["nan_count"] == 0, result
    assert result["rel_l2"] < TOLERANCE, result


@pytest.mark.parametrize("problem,config,alpha", NUMERIC_CASES, ids=str)
def test_alphas_dtypes_shapes(problem, config, alpha, compiled):
    assert isinstance(compiled[problem, config], Resources)  # these configs always compile
    kernel = _build_or_skip(problem, config, compiled)
    _assert_matches_c(kernel, seed=zlib.crc32(repr((problem, config, alpha)).encode()), alpha=alpha)


@pytest.mark.parametrize("problem,config,alpha", CONFIG_SWEEP, ids=str)
def test_every_accepted_config(problem, config, alpha, compiled):
    _assert_matches_c(_build_or_skip(problem, config, compiled), seed=7, alpha=alpha)


def test_fresh_inputs_each_call_and_reuse_of_output():
    """Two calls with different inputs into the same output buffer both match C."""
    kernel = build(Problem(2, 2, 200, 64, 64), SEED_CONFIG)
    _assert_matches_c(kernel, seed=1, alpha=0.95)
    _assert_matches_c(kernel, seed=2, alpha=0.95)


def test_rejects_bad_tensors():
    problem = Problem(1, 2, 64, 64, 64)
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
    from kernel.environment import environment
    from kernel.files import write_json
    from kernel.ops.deploy import FORMAT, VERSION, load_kernel

    problem = Problem(2, 3, 300, 64, 64)
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
    _assert_matches_c(kernel, seed=3, alpha=0.9)


@pytest.mark.parametrize("alpha", [0.3, 1e-3])
def test_decay_underflowing_fp32_keeps_the_state_finite(alpha):
    """alpha^C below fp32's range (0.3^128 = 1e-67) must decay the state to 0, not to NaN
    (every power of alpha is computed at run time: exp2 of a large negative number is 0)."""
    _assert_matches_c(build(Problem(2, 2, 300, 64, 64), KernelConfig(128, 32, 1, 128)), seed=4, alpha=alpha)


# The sequence-split variant: ragged last segment, S barely over one chunk, a bf16 carry
# that underflows fp32 (0.5^256), scores in registers, DK != DV, 64 segments, and two
# segments (no carry kernel launched).
SPLIT_CASES = [
    (Problem(2, 3, 1000, 64, 128, "bfloat16"), KernelConfig(64, 128, 3, 256, segments=2), 0.9),
    (Problem(2, 3, 300, 64, 64), KernelConfig(64, 32, 2, 128, segments=3), 0.9),
    (Problem(1, 2, 1000, 128, 128, "bfloat16"), KernelConfig(64, 64, 1, 256, segments=4), 0.5),
    (Problem(1, 4, 4096, 128, 128), KernelConfig(64, 128, 2, 256, segments=16), 0.99),
    (Problem(1, 1, 65, 64, 64), KernelConfig(64, 32, 1, 128, segments=2), 1.0),
    (Problem(2, 2, 777, 64, 128, "bfloat16"), KernelConfig(32, 64, 2, 128, segments=8), 0.8),
    (Problem(1, 2, 1000, 128, 128), KernelConfig(64, 32, 1, 128, "regs", segments=5), 0.95),
    (Problem(1, 3, 4096, 128, 128), KernelConfig(64, 128, 2, 256, segments=64), 0.999),
    (Problem(2, 16, 4096, 128, 128), KernelConfig(64, 128, 2, 256, segments=8), None),  # RetNet's
    # DK = 256: the dq and dk passes of a backward with DV = 2 DK (fla's RetNet), at the
    # default config for their shape (kernel.ops.dispatch.default_config); single-pass below.
    (Problem(2, 2, 1000, 256, 128, "bfloat16"), KernelConfig(64, 64, 2, 256, segments=2), None),
]


@pytest.mark.parametrize("problem,config,alpha", SPLIT_CASES, ids=str)
def test_sequence_split_variant_matches_c(problem, config, alpha):
    _assert_matches_c(build(problem, config), seed=6, alpha=alpha)


@pytest.mark.parametrize("problem,config,alpha", [SPLIT_CASES[0], SPLIT_CASES[1], SPLIT_CASES[4]], ids=str)
def test_sequence_split_writes_every_state_it_reads(problem, config, alpha, monkeypatch):
    """The split's states buffer is uninitialised memory: with it NaN-filled before each
    call, the outputs still match (two segments, where no carry kernel runs, and three)."""
    from kernel import variants

    empty = variants.states_buffer
    monkeypatch.setattr(variants, "states_buffer", lambda *a: empty(*a).fill_(float("nan")))
    _assert_matches_c(build(problem, config), seed=7, alpha=alpha)


def test_a_trial_measures_the_model_form():
    """What a tuner trial measures (``tuner.worker``): the kernel built for ``model_call``
    (scale DK^-1/2, the final state out), checked with RetNet's decays on the output and
    the final state against C, then timed."""
    from tuner.worker import _measure

    problem, config = Problem(2, 16, 1000, 128, 128), KernelConfig(64, 128, 2, 256)
    job = {"problem": problem.to_dict(), "config": config.to_dict(), "seed": 0, "tolerance": TOLERANCE}
    result = _measure(job)
    assert result["nan_count"] == 0 and result["finite"], result
    assert result["state_rel_l2"] is not None and result["state_rel_l2"] <= result["rel_l2"] < TOLERANCE
    assert result["median_ms"] > 0


def test_memory_bandwidth_is_the_peak_a_copy_comes_near():
    """``memory_bandwidth`` (which picks the rule's configs for slower memory) reads the
    GPU's peak: a device copy moves bytes below it, but at more than half of it."""
    from kernel.builder import memory_bandwidth
    from tuner.bench_rows import copy_bandwidth

    peak, copy = memory_bandwidth(), copy_bandwidth()
    assert peak is not None and copy < peak < 2 * copy, (peak, copy)
