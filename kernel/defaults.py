"""The config a kernel runs where no table holds one: the one home of the rule.

``default_config`` serves the forward (and each backward sweep, which is a forward call),
``dkdv_config`` the backward's fused dk and dv sweep (``kernel.dkdv``). The tuner's first
trials (``tuner.space.wave_seeds``) and the ops' fallback (``kernel.ops``) both derive
from them. The rule was fitted to sweeps of every candidate config across shapes
(``tuner.sweep_data.rule_scores`` scores it; docs/evidence.md#rule-family).
"""

import dataclasses
import math

from kernel import dkdv
from kernel.arch import DEFAULT_ARCH, get_arch
from kernel.config import SEGMENT_COUNTS, KernelConfig, Problem, knob_choices

# The family that won across shapes: 64-token chunks (32 where 64 does not fit the shared
# memory), 256 threads, scores in shared memory. evidence: docs/evidence.md#rule-family
CHUNKS, THREADS, SCORES = (64, 32), 256, "smem"
MAX_BLOCK_STATE = 128 * 128  # DK * block_dv: past it the block's fp32 state spills
MAX_DEEP_DK = 128  # 3 pipeline stages paid off up to this DK, 1 beyond
MAX_NARROW_DK = 128  # halving block_dv paid off up to this DK ...
NARROW_BELOW = 2048  # ... and in sequences shorter than this, more than splitting them did
STATIC_SMEM = 1024  # bytes: TileLang's barriers where it warp-specialises the pipeline
# What TileLang 0.1.15's warpgroup MMA lays out: the state's DK rows 64 at a time, a block's
# DV columns 32 at a time, two consumer warpgroups at most 224 of them (at 64-token chunks).
# evidence: docs/evidence.md#head-sizes
# (Here, not in kernel.arch, which keys the kernels' code: what compiles is no part of it.)
WGMMA_DK, WGMMA_BLOCK_DV, WGMMA_WIDEST_SHARED = 64, 32, 224
# Scores in registers lay out for no more than 128 threads on any architecture. (At chunks
# of 32 tokens they fail too; that failure is left to the compiler: the tests' compile
# failure.) evidence: docs/evidence.md#regs-threads
REGS_MAX_THREADS = 128


# The kernels take the batch size and sequence length as 32-bit ints (their generated
# signatures: ``int batch, int seqlen``), and TMA's coordinates are 32-bit.
MAX_EXTENT = 2**31 - 1
# The forward kernels launch a row of blocks per (batch, head) pair, or per (sequence, head)
# pair of packed sequences, along their grid's y axis, which CUDA caps at 65535.
MAX_ROWS = 65535


def rows_error(rows: int, heads: int, what: str = "batch") -> str | None:
    """Why no kernel runs ``rows`` (batch or packed sequences) x ``heads`` pairs in one call,
    in one line; None where one does."""
    if rows * heads > MAX_ROWS:
        return (
            f"{what} x heads = {rows} x {heads} = {rows * heads}: the kernels take at most {MAX_ROWS} "
            f"({what}, head) pairs per call (CUDA's grid); split the {what}"
        )
    return None


def size_error(problem: Problem) -> str | None:
    """Why no kernel runs ``problem``'s batch, heads or sequence length, in one line; None
    where one does."""
    if max(problem.batch, problem.heads, problem.seqlen) > MAX_EXTENT:
        return f"{problem}: batch, heads and seqlen must be at most {MAX_EXTENT} (the kernels' 32-bit sizes)"
    return rows_error(problem.batch, problem.heads)


def head_size_error(arch: str, dk: int, dv: int) -> str | None:
    """Why ``arch``'s kernels cannot run DK x DV, in one line; None where they can."""
    if not get_arch(arch).wgmma:
        return None
    if dk % WGMMA_DK:
        return (
            f"on {arch} the kernels need DK a multiple of {WGMMA_DK} (their warpgroup MMA), got {dk} "
            "(a backward's dq and dk sweeps need it of DV, which is their DK)"
        )
    if dv % WGMMA_BLOCK_DV:
        return f"on {arch} the kernels need DV a multiple of {WGMMA_BLOCK_DV} (their warpgroup MMA), got {dv}"
    return None


def block_dv_error(arch: str, dk: int, config: KernelConfig) -> str | None:
    """Why ``arch``'s MMA cannot tile ``config``'s products with block_dv columns, in one
    line; None where it can. The warpgroup MMA lays block_dv out 32 columns at a time, and
    for two consumer warpgroups at most 224 of them at chunks of 64 tokens or more;
    elsewhere the warps of ``mma.sync`` share the state's DK x block_dv and the output's
    chunk x block_dv in whole 16 x 8 tiles, or TileLang 0.1.15 finds no warp partition
    (docs/evidence.md#head-sizes)."""
    bdv = config.block_dv
    if get_arch(arch).wgmma:
        if bdv % WGMMA_BLOCK_DV:
            return f"block_dv {bdv}: on {arch} a multiple of {WGMMA_BLOCK_DV}"
        if bdv > WGMMA_WIDEST_SHARED and config.threads > 128 and config.chunk >= 64:
            return (
                f"block_dv {bdv}: on {arch} at most {WGMMA_WIDEST_SHARED} where {config.threads} threads "
                f"share the state of {config.chunk}-token chunks (128 threads or 32-token chunks compile it)"
            )
        return None
    warps, columns = config.threads // 32, bdv // 8
    if all(rows // 16 * columns % warps == 0 for rows in (dk, config.chunk)):
        return None
    return (
        f"block_dv {bdv}: {warps} warps cannot share its products with DK = {dk} and chunk "
        f"{config.chunk} rows in whole 16 x 8 tiles on {arch}"
    )


def tiling_error(arch: str, problem: Problem, config: KernelConfig) -> str | None:
    """Why ``arch``'s kernels cannot run ``config`` on ``problem``'s head sizes, in one
    line (``head_size_error``, ``block_dv_error``); None where they can."""
    return head_size_error(arch, problem.dk, problem.dv) or block_dv_error(arch, problem.dk, config)


def knobs(problem: Problem, sweep: str = "forward") -> dict[str, tuple]:
    """Knob name -> the values the kernels take, in ``KernelConfig``'s field order: the
    knob table of ``kernel.config`` for this problem's DV (the forward), or the fused dk and
    dv sweep's, whose design (``kernel.dkdv``) fixes its chunk (64: wgmma's rows), its
    threads (256: the ``[DK, DV]`` state in registers), its block_dv (DV: the whole state in
    one block) and its scores (in shared memory), and leaves its stages and segments free.
    The search space (``tuner.space``) is this table."""
    table = knob_choices(problem.dv)
    if sweep == "dkdv":
        fused = {
            "chunk": (dkdv.CHUNK,),
            "block_dv": (problem.dv,),
            "num_stages": (1, 2),
            "threads": (dkdv.THREADS,),
            "scores": ("smem",),
        }
        return {name: fused.get(name, values) for name, values in table.items()}
    return table


def violated(
    problem: Problem, config: KernelConfig, arch: str = DEFAULT_ARCH, sweep: str = "forward"
) -> list[str]:
    """Why ``config`` may not run ``problem`` on ``arch``, one reason per broken
    restriction: it must tile the problem (``KernelConfig.check_fits``), its pipeline may
    be no deeper than the chunks of one segment it overlaps, and the shared memory it
    needs at the least (``KernelConfig.smem_floor``; the fused sweep's,
    ``kernel.dkdv.smem_bytes``) must fit one block of ``arch``; the fused sweep must serve
    the problem on ``arch`` (``dkdv_config``); and the head sizes and block_dv must be ones
    ``arch``'s MMA tiles (``tiling_error``), and scores in registers need no more than
    ``REGS_MAX_THREADS`` threads. Cheap: no compile."""
    reasons = [reason] if (reason := tiling_error(arch, problem, config)) else []
    if config.scores == "regs" and config.threads > REGS_MAX_THREADS:
        reasons.append(
            f"scores in registers lay out for at most {REGS_MAX_THREADS} threads, not {config.threads}"
        )
    limit = get_arch(arch).smem_per_block
    floor = dkdv.smem_bytes(problem, config) if sweep == "dkdv" else config.smem_floor(problem)
    if sweep == "dkdv" and dkdv_config(problem, arch) is None:
        reasons.append(
            f"the fused dk and dv sweep does not serve DK x DV = {problem.dk} x {problem.dv} on {arch}"
        )
    if floor > limit:
        reasons.append(f"shared memory: at least {floor} B, over {arch}'s {limit} B per block")
    try:
        config.check_fits(problem)
    except ValueError as exc:
        reasons.append(str(exc))
    if not config.pipeline_fits(problem):
        chunks = config.segment_length(problem.seqlen) // config.chunk
        reasons.append(f"num_stages={config.num_stages} is deeper than the {chunks} chunk(s) of a segment")
    return reasons


def config_error(problem: Problem, config: KernelConfig, arch: str, sweep: str = "forward") -> str | None:
    """Why ``config``, read from a file, may not serve ``problem`` on ``arch``, in one line:
    a knob the kernels do not take (``knobs``: no such kernel was ever compiled or checked)
    or a broken restriction (``violated``); None where it may."""
    if reasons := violated(problem, config, arch, sweep):
        return f"config {config.label} on {arch}: {'; '.join(reasons)}"
    table = knobs(problem, sweep)
    outside = {k: v for k, v in config.to_dict().items() if v not in table[k]}
    return f"config {config.label}: {outside} outside the kernels' knobs {table}" if outside else None


def preferred_stages(problem: Problem) -> int:
    """The forward's pipeline depth where it fits: 3 up to DK = 128, 1 beyond."""
    return 3 if problem.dk <= MAX_DEEP_DK else 1


def smem_bytes(problem: Problem, config: KernelConfig) -> int:
    """At least the shared memory the forward declares with the rule's knobs (scores in
    shared memory): per stage Q, K (``[C, DK]``) and V (``[C, bDV]``); once the weighted
    keys (``[C, DK]``), the output tile (``[C, bDV]``), the scores (``[C, C]``) and, where
    block_dv < 128, the state's copy (``[DK, bDV]``), all 2-byte; plus ``STATIC_SMEM``.
    Checked against the compiled kernels (tests/test_defaults.py)."""
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
    bytes/s; None: fast memory's), ``unsplit_on_slow_memory`` may trade a split for ``CHAIN``."""
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
    """The fused dk and dv sweep's config for ``problem`` on ``arch``, or None where the
    sweep does not serve it (the backward then runs two sweeps): it serves Hopper (wgmma),
    a state of at most ``kernel.dkdv.MAX_STATE`` elements, with two stages where they fit
    the shared memory, else one. ``sms``: the GPU's SM count, to split the sequence into
    the segment count whose grid comes nearest one block per SM without passing it; None,
    one pass (what packed sequences run)."""
    too_large = problem.dk * problem.dv > dkdv.MAX_STATE
    if too_large or not get_arch(arch).wgmma or head_size_error(arch, problem.dk, problem.dv):
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
    V less often."""
    runnable = [
        c
        for c in (dataclasses.replace(config, segments=n) for n in SEGMENT_COUNTS)
        if runs(c, problem) and (c.segments == 1 or c.blocks(problem) <= blocks)
    ]
    if not runnable:
        return None
    return min(runnable, key=lambda c: (abs(math.log2(c.blocks(problem) / blocks)), c.segments))


def runs(config: KernelConfig, problem: Problem) -> bool:
    """Whether ``config`` tiles ``problem`` with a pipeline no deeper than a segment."""
    try:
        config.check_fits(problem)
    except ValueError:
        return False
    return config.pipeline_fits(problem)


def shorter_pipeline(config: KernelConfig, problem: Problem) -> KernelConfig:
    """``config`` with no more stages than a segment of ``problem`` has chunks."""
    chunks = max(1, config.segment_length(problem.seqlen) // config.chunk)
    return dataclasses.replace(config, num_stages=min(config.num_stages, chunks))
