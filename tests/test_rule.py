"""kernel.rule: the rule's configs fit every architecture, its shared-memory estimate
is what the compiled kernels declare, and it keeps the choices the H200 sweeps fitted."""

import pytest

from kernel.arch import ARCHS
from kernel.config import KernelConfig, Problem, model_call
from kernel.constraints import runs
from kernel.rule import CHAIN, STATIC_SMEM, default_config, dkdv_config, smem_bytes

HEADS = [(64, 64), (64, 128), (128, 64), (128, 128), (128, 256), (256, 128), (256, 256)]
SHAPES = [(1, 1, 1), (1, 2, 65), (4, 16, 512), (1, 8, 1000), (8, 16, 4096), (2, 16, 16384), (1, 8, 131072)]


def test_the_rule_runs_every_shape_within_every_architectures_shared_memory():
    for arch in ARCHS.values():
        for dk, dv in HEADS:
            for shape in SHAPES:
                problem = Problem(*shape, dk, dv)
                config = default_config(problem, arch.name)
                assert smem_bytes(problem, config) <= arch.smem_per_block, (arch.name, problem, config)
                assert config.segments == 1 or runs(config, problem), (arch.name, problem, config)
                assert config.pipeline_fits(problem) or config.num_stages == 1


@pytest.mark.parametrize(
    "arch,dk,dv", [("sm_90a", 128, 128), ("sm_90a", 64, 64), ("sm_86", 128, 128), ("sm_86", 256, 256)]
)
def test_the_estimate_is_the_shared_memory_the_lowered_kernels_declare(arch, dk, dv):
    """Lowered (no nvcc) for ``arch``: the dynamic shared memory of every kernel of the
    rule's config, split or not, is the estimate less its static allowance."""
    from kernel.probe import launch_resources, lower
    from kernel.variants import prim_funcs

    problem = Problem(2, 4, 4096, dk, dv, "bfloat16")
    config = default_config(problem, arch)
    assert config.segments > 1  # the split's kernels, the larger of its passes
    funcs = prim_funcs(problem, config, model_call(problem), arch=arch)
    declared = max(launch_resources(lower(f, arch=arch))[0] for f in funcs)
    assert declared == smem_bytes(problem, config) - STATIC_SMEM <= ARCHS[arch].smem_per_block


def test_the_rule_keeps_the_choices_the_sweeps_fitted():
    """docs/evidence.md#rule-family: 3 stages up to DK = 128 and 1 beyond; a short
    sequence halves block_dv before it splits; a long one splits at the widest block_dv;
    where 64-token chunks do not fit the shared memory, 32-token ones serve."""
    rule = lambda b, h, s, dk, dv, arch="sm_90a": default_config(Problem(b, h, s, dk, dv), arch, 132)  # noqa: E731
    assert rule(8, 16, 4096, 128, 128) == KernelConfig(64, 128, 3, 256, "smem", 1)
    assert rule(2, 16, 16384, 128, 128) == KernelConfig(64, 128, 3, 256, "smem", 4)
    assert rule(4, 16, 512, 128, 128) == KernelConfig(64, 64, 3, 256, "smem", 1)  # 128 blocks unsplit
    assert rule(1, 16, 512, 128, 128) == KernelConfig(64, 64, 3, 256, "smem", 2)  # 64 blocks, halved first
    assert rule(1, 16, 2048, 128, 128) == KernelConfig(64, 128, 3, 256, "smem", 8)
    assert rule(4, 16, 8192, 256, 256) == KernelConfig(64, 64, 1, 256, "smem", 1)
    assert rule(4, 16, 512, 256, 256) == KernelConfig(64, 64, 1, 256, "smem", 1)  # DK 256: never halved
    assert rule(8, 16, 4096, 128, 128, "sm_80").num_stages == 2  # 3 stages are over its 163 KB
    assert rule(8, 16, 4096, 256, 256, "sm_86").chunk == 32  # no 64-token config fits its 99 KB


def test_a_split_never_passes_one_block_per_sm():
    """A grid past the SM count runs a second wave: at 3x24x6000 (72 blocks on 132 SMs) the
    split in two, 144 blocks, took 1.48x the unsplit forward and 1.19x the unsplit fused
    pass (docs/evidence.md#rule-family). Unsplit grids may be larger."""
    for dk, dv in HEADS:
        for b, h, s in [*SHAPES, (3, 24, 6000), (1, 40, 8192), (5, 17, 3000), (1, 3, 65536)]:
            problem = Problem(b, h, s, dk, dv)
            for config in (default_config(problem, "sm_90a", 132), dkdv_config(problem, "sm_90a", 132)):
                if config is not None and config.segments > 1:
                    assert config.blocks(problem) <= 132, (problem, config)
    assert default_config(Problem(3, 24, 6000, 128, 128), "sm_90a", 132).segments == 1
    assert dkdv_config(Problem(3, 24, 6000, 128, 128), "sm_90a", 132).segments == 1
    assert default_config(Problem(1, 40, 8192, 128, 128), "sm_90a", 132).segments == 2  # 80 blocks: one wave


def test_slower_memory_runs_unsplit_where_the_h200_splits_in_two_past_three_quarters_of_the_sms():
    """docs/evidence.md#rule-chain: on the H100 the unsplit half-width config at 128 threads
    beat the split in two at DK = DV = 128 where its grid passed 3/4 of 132 SMs (B*H 56, 64),
    and was even at 96 blocks (B*H 48). Elsewhere, and on the H200, the rule is unchanged."""
    h100, h200 = 3.35e12, 4.8e12
    for b, h, s in [(4, 16, 8192), (4, 16, 2048), (7, 8, 8192), (2, 32, 4096), (4, 16, 32768)]:
        problem = Problem(b, h, s, 128, 128, "bfloat16")
        split = default_config(problem, "sm_90a", 132)
        assert split.segments == 2 and split.block_dv == 128
        assert default_config(problem, "sm_90a", 132, h200) == split
        assert default_config(problem, "sm_90a", 132, h100) == CHAIN
        assert CHAIN.blocks(problem) == split.blocks(problem)
    for b, h, s, dk, dv in [(3, 16, 8192, 128, 128), (6, 8, 4096, 128, 128), (8, 16, 4096, 128, 128)]:
        problem = Problem(b, h, s, dk, dv)  # 96 blocks, and no split
        assert default_config(problem, "sm_90a", 132, h100) == default_config(problem, "sm_90a", 132)
    for dk, dv in [(64, 64), (128, 256), (256, 256)]:
        problem = Problem(4, 16, 8192, dk, dv)  # unmeasured head sizes keep the rule
        assert default_config(problem, "sm_90a", 132, h100) == default_config(problem, "sm_90a", 132)
    ampere = Problem(3, 16, 8192, 128, 128)  # split in two, 96 blocks of 108: unmeasured there
    assert default_config(ampere, "sm_80", 108).segments == 2
    assert default_config(ampere, "sm_80", 108, 2e12) == default_config(ampere, "sm_80", 108)


@pytest.mark.parametrize(
    "dk, dv, said",
    [(96, 64, "DK a multiple of 64"), (32, 32, "DK a multiple of 64"), (64, 48, "DV a multiple of 32")],
)
def test_on_hopper_head_sizes_its_mma_cannot_tile_are_refused_in_one_line(dk, dv, said):
    """Where no config compiles on sm_90a (``kernel.constraints.head_size_error``), the rule says so
    in one line instead of handing TileLang a config it fails on; the fused pass does not
    serve them, and sm_80, which compiles them, keeps its rule."""
    problem = Problem(1, 2, 512, dk, dv)
    with pytest.raises(ValueError, match=f"on sm_90a the kernels need {said}") as caught:
        default_config(problem, "sm_90a")
    assert "\n" not in str(caught.value)
    assert dkdv_config(problem, "sm_90a", 132) is None
    assert default_config(problem, "sm_80").block_dv % 16 == 0


@pytest.mark.parametrize("dk, dv, seqlen", [(64, 96, 512), (192, 64, 512), (64, 224, 512), (64, 256, 4096)])
def test_the_rule_s_config_compiles_for_hopper_at_head_sizes_off_the_bench(dk, dv, seqlen):
    """At 512 tokens the rule halves block_dv (DV = 96 gave 48, which sm_90a's warpgroup MMA
    cannot lay out): on sm_90a it keeps multiples of 32, and the kernels it picks compile,
    forward and fused pass. At DK = 64, DV = 256 its widest block_dv was 256, which two
    warpgroups cannot lay out (docs/evidence.md#head-sizes). Compiled (TileLang and nvcc,
    which raise where they fail), not probed: ptxas's resources are not the question here."""
    from kernel.config import dkdv_call
    from kernel.probe import compile_kernel

    problem = Problem(1, 2, seqlen, dk, dv)
    config = default_config(problem, "sm_90a", 132)
    assert config.block_dv % 32 == 0
    jobs = [(config, model_call(problem))]
    if (fused := dkdv_config(problem, "sm_90a", 132)) is not None:
        jobs.append((fused, dkdv_call(problem)))
    for c, call in jobs:
        kernels = compile_kernel(problem, c, "sm_90a", call)
        assert kernels and all("__global__" in k.get_kernel_source() for k in kernels), c


@pytest.mark.parametrize("dk", [48, 112])
def test_the_rule_s_config_compiles_for_ampere_where_its_warps_must_tile_the_state(dk):
    """On sm_80 (``mma.sync``) 8 warps share the state's DK x block_dv in whole 16 x 8 tiles
    (``kernel.constraints.block_dv_error``): at 512 tokens the rule no longer halves block_dv to 32
    where DK = 48 or 112 leaves them 12 or 28 tiles, and its pick compiles (TileLang and
    nvcc, which raise where they fail); where no width tiles (DK = DV = 48), it says so in
    one line."""
    from kernel.probe import compile_kernel

    problem = Problem(1, 2, 512, dk, 64)
    config = default_config(problem, "sm_80")
    assert config.block_dv == 64
    kernels = compile_kernel(problem, config, "sm_80")
    assert kernels and all("__global__" in k.get_kernel_source() for k in kernels)
    with pytest.raises(ValueError, match="none both fits .* and tiles its MMA across 8 warps"):
        default_config(Problem(1, 2, 512, 48, 48), "sm_80")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_a_job_compiled_ahead_takes_the_arch_s_reference_gpu_without_one(arch):
    """``kernel_job(..., arch=)`` with no SM count is the rule's pick on that arch's reference
    GPU, asked of no device (CI has none)."""
    import kernel.ops.serve as serve
    from kernel.arch import get_arch
    from kernel.config import Call

    serve.use_table(None)  # the rule alone
    try:
        problem = Problem(2, 8, 1000, 128, 128, "float16")
        _, config, _ = serve.kernel_job(problem, Call(0.1), 2, arch=arch)
        assert config == serve.kernel_job(problem, Call(0.1), 2, arch=arch, sms=get_arch(arch).sms)[1]
        assert config == default_config(problem, arch, get_arch(arch).sms)
    finally:
        serve.use_table(serve.DEFAULT)
