"""The config a kernel runs where no table holds one: the one home of the rule.

``default_config`` serves the forward (and each backward pass, which is a forward call; a
per-token gate's forward, ``gated_config``), ``dkdv_config`` the backward's fused dk and dv
pass (``kernel.dkdv``). The tuner's first
trials (``tuner.space.wave_seeds``) and the ops' fallback (``kernel.ops``) both derive
from them; what any config must keep to run is ``kernel.constraints``'. The rule was
fitted to grids of every candidate config timed across shapes (``tuner.fit_data.rule_scores``
scores it; docs/evidence.md#rule-family).
"""

import dataclasses
import math

from kernel import dkdv
from kernel.arch import get_arch
from kernel.config import KernelConfig, Problem
from kernel.constraints import block_dv_error, dkdv_serves, head_size_error, knobs, runs

# The family that won across shapes: 64-token chunks (32 where 64 does not fit the shared
# memory), 256 threads, scores in shared memory. evidence: docs/evidence.md#rule-family
CHUNKS, THREADS, SCORES = (64, 32), 256, "smem"
MAX_BLOCK_STATE = 128 * 128  # DK * block_dv: past it the block's fp32 state spills
MAX_DEEP_DK = 128  # 3 pipeline stages paid off up to this DK, 1 beyond
MAX_NARROW_DK = 128  # halving block_dv paid off up to this DK ...
NARROW_BELOW = 2048  # ... and in sequences shorter than this, more than splitting them did
STATIC_SMEM = 1024  # bytes: TileLang's barriers where it warp-specialises the pipeline


def preferred_stages(problem: Problem) -> int:
    """The forward's pipeline depth where it fits: 3 up to DK = 128, 1 beyond."""
    return 3 if problem.dk <= MAX_DEEP_DK else 1


def smem_bytes(problem: Problem, config: KernelConfig) -> int:
    """At least the shared memory the forward declares with the rule's knobs (scores in
    shared memory): per stage Q, K (``[C, DK]``) and V (``[C, bDV]``); once the weighted
    keys (``[C, DK]``), the output tile (``[C, bDV]``), the scores (``[C, C]``) and, where
    block_dv < 128, the state's copy (``[DK, bDV]``), all 2-byte; plus ``STATIC_SMEM``.
    Checked against the compiled kernels (tests/test_rule.py)."""
    c, dk, bdv = config.chunk, problem.dk, config.block_dv
    staged = config.num_stages * c * (2 * dk + bdv)
    state_copy = dk * bdv if bdv < 128 else 0
    return 2 * (staged + c * dk + c * bdv + c * c + state_copy) + STATIC_SMEM


def family(problem: Problem, arch: str) -> KernelConfig:
    """The rule's unsplit config for ``problem`` on ``arch``: the widest block_dv (a
    multiple of 16 dividing DV, DK x block_dv within ``MAX_BLOCK_STATE``), then the deepest
    pipeline up to ``preferred_stages``, then 64-token chunks before 32, whose shared memory
    fits ``arch``'s per-block limit and whose products ``arch``'s MMA tiles
    (``block_dv_error``). ``ValueError`` where none does, or where ``arch``'s kernels cannot
    run the head sizes (``head_size_error``)."""
    reason = head_size_error(arch, problem.dk, problem.dv)
    if reason:
        raise ValueError(reason)
    limit = get_arch(arch).smem_per_block
    widest = max(16, min(problem.dv, MAX_BLOCK_STATE // problem.dk))
    widths = [d for d in range(widest - widest % 16, 0, -16) if problem.dv % d == 0]
    for chunk in CHUNKS:
        for width in widths:
            for stages in range(preferred_stages(problem), 0, -1):
                config = KernelConfig(chunk, width, stages, THREADS, SCORES, 1)
                if smem_bytes(problem, config) <= limit and not block_dv_error(arch, problem.dk, config):
                    return config
    raise ValueError(
        f"no config of the rule fits DK={problem.dk}, DV={problem.dv} on {arch}: none both fits its "
        f"{limit} B per block and tiles its MMA across {THREADS // 32} warps"
    )


def default_config(
    problem: Problem, arch: str, sms: int | None = None, bandwidth: float | None = None
) -> KernelConfig:
    """The forward's config for ``problem`` on ``arch`` (a name of ``kernel.arch.ARCHS``):
    ``family``'s, at the block_dv (its own or, for DK <= ``MAX_NARROW_DK`` and sequences
    shorter than ``NARROW_BELOW`` tokens, half of it) and segment count whose grid comes
    nearest one block per SM in log2 without a split past it (``sms``; default: ``arch``'s
    reference GPU), with a pipeline no deeper than a segment's chunks. Of grids as near,
    the unsplit one wins, then the wider block_dv, then fewer segments (which read K and V
    less often). On a GPU whose memory is slower than ``SLOW_MEMORY`` (``bandwidth``, peak
    bytes/s; None: fast memory's), ``unsplit_on_slow_memory`` may trade a split for ``CHAIN``.
    A per-token gate's problem gets ``gated_config``."""
    if problem.gate == "token":
        return gated_config(problem)
    base = family(problem, arch)
    blocks = sms or get_arch(arch).sms
    widths = [base.block_dv]
    half = base.block_dv // 2
    short = problem.seqlen < NARROW_BELOW and problem.dk <= MAX_NARROW_DK
    if short and half >= 32 and half % 16 == 0 and problem.dv % half == 0:
        if not block_dv_error(arch, problem.dk, dataclasses.replace(base, block_dv=half)):
            widths.append(half)
    # per width the segment count nearest the grid; a sequence too short for the pipeline
    # runs the single-pass kernel, as deep as its chunks
    picks = [dataclasses.replace(base, block_dv=w) for w in widths]
    picks = [nearest_grid(c, problem, blocks) or shorter_pipeline(c, problem) for c in picks]

    def order(c: KernelConfig) -> tuple:
        far = abs(math.log2(c.blocks(problem) / blocks))
        return far, c.segments > 1, c.block_dv != base.block_dv, c.segments

    pick = min(picks, key=order)
    if bandwidth is not None and bandwidth < SLOW_MEMORY:
        return unsplit_on_slow_memory(pick, problem, arch, blocks)
    return pick


def gated_config(problem: Problem) -> KernelConfig:
    """The per-token gate's forward (``kernel.gated``) where no table holds a tuned config:
    64-token chunks, one stage, 256 threads, value blocks of 128 columns at DK = DV = 128
    and else of 64 where DV allows (the widest multiple of 16 dividing DV up to 64): at
    three shapes timed on one Hopper GPU, 256 threads beat 128 at every block_dv and block_dv
    128 beat 64 at DK = DV = 128. evidence: docs/evidence.md#rule-gated"""
    if problem.dk == problem.dv == 128:
        return KernelConfig(64, 128, 1, 256, "smem", 1)
    block_dv = max(d for d in range(16, min(problem.dv, 64) + 1, 16) if problem.dv % d == 0)
    return KernelConfig(64, block_dv, 1, 256, "smem", 1)


# On slow memory a split in two, which reads K and V twice, costs more than running the
# sequence unsplit at half the block_dv with one consumer warpgroup (``CHAIN``), as many
# blocks. evidence: docs/evidence.md#rule-chain
SLOW_MEMORY = 4e12  # bytes/s, peak: between the two memory classes measured
MEMORY_CLASSES = (None, 3.35e12)  # a bandwidth of each side: None the fast memory's rule
CHAIN = KernelConfig(64, 64, 3, 128, SCORES, 1)


def unsplit_on_slow_memory(pick: KernelConfig, problem: Problem, arch: str, sms: int) -> KernelConfig:
    """``CHAIN`` where ``pick`` splits a DK = DV = 128 problem of Hopper in two at block_dv
    128 and its grid passes 3/4 of ``sms``, the case measured; else ``pick``."""
    measured = get_arch(arch).wgmma and problem.dk == problem.dv == 128
    split = pick.segments == 2 and pick.block_dv == 128 and 4 * pick.blocks(problem) > 3 * sms
    return CHAIN if measured and split and runs(CHAIN, problem) else pick


def dkdv_config(problem: Problem, arch: str, sms: int | None = None) -> KernelConfig | None:
    """The fused dk and dv pass's config for ``problem`` on ``arch``, or None where the
    pass does not serve it (the backward then runs two passes): it serves Hopper (wgmma),
    a state of at most ``kernel.dkdv.MAX_STATE`` elements, with two stages where they fit
    the shared memory, else one. ``sms``: the GPU's SM count, to split the sequence into
    the segment count whose grid comes nearest one block per SM without passing it; None,
    one pass (what packed sequences run)."""
    if not dkdv_serves(problem, arch):
        return None
    limit = get_arch(arch).smem_per_block
    for stages in (2, 1):
        config = KernelConfig(dkdv.CHUNK, problem.dv, stages, dkdv.THREADS, "smem")
        if dkdv.smem_bytes(problem, config) <= limit:
            split = None if sms is None else nearest_grid(config, problem, sms)
            return config if split is None else split
    return None


def nearest_grid(config: KernelConfig, problem: Problem, blocks: int) -> KernelConfig | None:
    """``config`` with the segment count whose grid on ``problem`` comes nearest, in log2,
    to ``blocks`` without a split past it (with ``blocks`` the SM count, the blocks past it
    would run as a second wave, a short one that still takes as long as the first);
    ``None`` when no count runs ``problem``. A tie goes to fewer segments, which read K and
    V less often. The counts are those the problem's kernels take (``knobs``: one, for a
    per-token gate's)."""
    runnable = [
        c
        for c in (dataclasses.replace(config, segments=n) for n in knobs(problem)["segments"])
        if runs(c, problem) and (c.segments == 1 or c.blocks(problem) <= blocks)
    ]
    if not runnable:
        return None
    return min(runnable, key=lambda c: (abs(math.log2(c.blocks(problem) / blocks)), c.segments))


def shorter_pipeline(config: KernelConfig, problem: Problem) -> KernelConfig:
    """``config`` with no more stages than a segment of ``problem`` has chunks."""
    chunks = max(1, config.segment_length(problem.seqlen) // config.chunk)
    return dataclasses.replace(config, num_stages=min(config.num_stages, chunks))
