"""tuner.space: the knob table, the named restrictions and the one-wave seeds."""

from helpers import SMALL_PROBLEM

from kernel import SEED_CONFIG, KernelConfig, Problem
from kernel.config import SEGMENT_COUNTS
from kernel.constraints import knobs, violated
from kernel.rule import CHAIN, default_config
from tuner import space

SHALLOW = "num_stages={} is deeper than the {} chunk(s) of a segment"


def test_space_table_and_restrictions():
    table = knobs(Problem(1, 1, 64, 128, 96))
    assert table["block_dv"] == (16, 32, 48, 96)
    assert table["scores"] == ("smem", "regs")
    assert table["segments"][0] == 1  # the single-pass kernel, then the sequence-split variant
    assert len(list(space.search_space(SMALL_PROBLEM).grid)) == 3 * 3 * 4 * 2 * 2 * len(SEGMENT_COUNTS)
    short = Problem(1, 1, 40, 64, 64)  # one chunk of 64: a 2-stage pipeline has nothing to overlap
    assert violated(short, KernelConfig(64, 32, 2, 128)) == [SHALLOW.format(2, 1)]
    assert violated(short, KernelConfig(32, 32, 2, 128)) == []
    assert violated(short, KernelConfig(32, 32, 1, 128, segments=2)) == []  # 32 + 8 tokens
    assert violated(short, KernelConfig(32, 32, 1, 128, segments=4)) == []  # rounds to 2 segments
    assert violated(short, KernelConfig(64, 32, 1, 128, segments=2)) == [
        "segments=2 of whole 64-token chunks leave one segment for seqlen=40: "
        "use segments=1 (the single-pass kernel)"
    ]
    # 4096 tokens: 8 segments hold 8 chunks of 64 each; 16 segments, 2 chunks of 128, too few for 4 stages
    long = Problem(1, 1, 4096, 64, 64)
    assert violated(long, KernelConfig(64, 32, 4, 128, segments=8)) == []
    assert violated(long, KernelConfig(128, 32, 4, 128, segments=16)) == [SHALLOW.format(4, 2)]


def test_every_broken_restriction_is_a_reason():
    narrow = Problem(1, 1, 64, 64, 32)  # block_dv 64 cannot tile DV = 32, nor 2 stages one chunk
    assert violated(narrow, KernelConfig(64, 64, 2, 128)) == [
        "block_dv must divide dv: dv=32 is not a multiple of block_dv=64",
        SHALLOW.format(2, 1),
    ]


def test_wave_seeds_launch_about_one_wave_and_are_allowed():
    # 2x16x16384, DV = 128 at block_dv 128: 32 blocks per segment count, 4 segments = 128
    # blocks, the nearest to 132 SMs; its neighbours 2 and 8, at 2 and 3 stages.
    problem = Problem(2, 16, 16384, 128, 128)
    seeds = space.wave_seeds(space.search_space(problem), sms=132)
    assert sorted((c.segments, c.num_stages) for c in seeds) == [(n, s) for n in (2, 4, 8) for s in (2, 3)]
    assert {(c.chunk, c.block_dv, c.threads, c.scores) for c in seeds} == {(64, 128, 256, "smem")}
    # twice the SMs: one more doubling of segments
    assert {c.segments for c in space.wave_seeds(space.search_space(problem), sms=264)} == {4, 8, 16}
    # 1 segment at most: the headline's 128 (batch, head) pairs already fill the GPU
    assert {c.segments for c in space.wave_seeds(space.search_space(Problem(8, 16, 4096, 128, 128)))} == {
        1,
        2,
    }
    # DV = 256 is split in two 128-wide blocks; a sequence of 256 tokens halves block_dv
    # rather than split; restricted configs are never seeded
    for problem, width in ((Problem(3, 5, 3000, 128, 256), 128), (Problem(1, 2, 256, 64, 64), 32)):
        seeds = space.wave_seeds(space.search_space(problem))
        assert all(c.block_dv == width for c in seeds)
        assert all(violated(problem, c) == [] for c in seeds)
    # the one-wave count (64 segments) would leave no pipeline: the rule's runnable count leads
    short = Problem(1, 2, 256, 64, 64)
    assert (
        space.wave_seeds(space.search_space(short))[0]
        == default_config(short, "sm_90a")
        == KernelConfig(64, 32, 3, 256, "smem", 1)
    )
    # an H100's bandwidth: its rule's config leads, and the H200's split is seeded too
    four = Problem(4, 16, 8192, 128, 128)
    h100 = space.wave_seeds(space.search_space(four), sms=132, bandwidth=3.35e12)
    assert h100[0] == CHAIN and default_config(four, "sm_90a", 132) in h100
    assert space.wave_seeds(space.search_space(four), sms=132, bandwidth=4.8e12) == space.wave_seeds(
        space.search_space(four), sms=132
    )


def test_hopper_refuses_before_any_compile_what_its_mma_cannot_tile():
    """On sm_90a a block_dv off the warpgroup MMA's 32 columns, or a head size it cannot
    tile, is a violated restriction (refused untried); on sm_80 neither is; and a study of
    DV = 48, where the seed's block_dv of 32 is no choice, does not enqueue it."""
    problem = Problem(1, 2, 512, 64, 96)
    narrow = KernelConfig(64, 48, 1, 256, "smem")
    assert violated(problem, narrow, "sm_90a") == ["block_dv 48: on sm_90a a multiple of 32"]
    assert violated(problem, narrow, "sm_80") == []
    odd = Problem(1, 2, 512, 96, 64)
    assert any(
        "DK a multiple of 64" in r for r in violated(odd, KernelConfig(64, 64, 1, 256, "smem"), "sm_90a")
    )
    assert space.search_space(Problem(1, 2, 256, 32, 48)).outside(SEED_CONFIG) == {"block_dv": 32}


def test_ampere_refuses_before_any_compile_what_its_warps_cannot_tile():
    problem = Problem(1, 2, 512, 48, 64)
    narrow = KernelConfig(64, 32, 1, 256, "smem")
    (reason,) = violated(problem, narrow, "sm_80")
    assert reason.startswith("block_dv 32: 8 warps cannot share its products with DK = 48")
    assert violated(problem, KernelConfig(64, 64, 1, 256, "smem"), "sm_80") == []
    assert violated(Problem(1, 2, 512, 64, 64), KernelConfig(32, 16, 1, 256, "regs"), "sm_80")


def test_register_scores_past_128_threads_are_restricted_everywhere():
    """They never compile (tests/test_kernel_cpu.py's layout failure,
    docs/evidence.md#regs-threads): refused untried on every architecture; 128 threads are left
    to compile."""
    problem = Problem(1, 2, 512, 64, 64)
    for arch in ("sm_80", "sm_90a", "sm_120"):
        assert violated(problem, KernelConfig(64, 64, 2, 256, "regs"), arch) == [
            "scores in registers lay out for at most 128 threads, not 256"
        ]
        assert violated(problem, KernelConfig(64, 64, 2, 128, "regs"), arch) == []
