"""What the kernels take: the knobs they were built for (``knobs``, the search space) and
the restrictions a config must keep to run a problem on an architecture (``violated``;
``config_error`` for a config read from a file), and the sizes a call may have
(``size_error``, ``rows_error``). Cheap predicates, no compile: the rule
(``kernel.rule``), the search space (``tuner.space``) and the files a call is served
from (``kernel.ops``) all check configs here.
"""

from kernel import dkdv
from kernel.arch import DEFAULT_ARCH, get_arch
from kernel.config import KernelConfig, Problem, knob_choices

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
            "(a backward's dq and dk passes need it of DV, which is their DK)"
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
    A per-token gate's forward (``kernel.gated``, ``problem.gate == "token"``) keeps its
    scores in shared memory and runs one pass (segments 1), its other knobs free.
    The search space (``tuner.space``) is this table."""
    table = knob_choices(problem.dv)
    if problem.gate == "token":
        return table | {"scores": ("smem",), "segments": (1,)}
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


def dkdv_serves(problem: Problem, arch: str) -> bool:
    """Whether the backward's fused dk and dv pass (``kernel.dkdv``) serves ``problem`` on
    ``arch``: Hopper (wgmma), head sizes its MMA tiles, a state of at most
    ``kernel.dkdv.MAX_STATE`` elements, and one stage within ``arch``'s shared memory per
    block."""
    if problem.dk * problem.dv > dkdv.MAX_STATE or not get_arch(arch).wgmma:
        return False
    if head_size_error(arch, problem.dk, problem.dv):
        return False
    one_stage = KernelConfig(dkdv.CHUNK, problem.dv, 1, dkdv.THREADS, "smem")
    return dkdv.smem_bytes(problem, one_stage) <= get_arch(arch).smem_per_block


def violated(
    problem: Problem, config: KernelConfig, arch: str = DEFAULT_ARCH, sweep: str = "forward"
) -> list[str]:
    """Why ``config`` may not run ``problem`` on ``arch``, one reason per broken
    restriction: it must tile the problem (``KernelConfig.check_fits``), its pipeline may
    be no deeper than the chunks of one segment it overlaps, and the shared memory it
    needs at the least (``KernelConfig.smem_floor``; the fused pass's,
    ``kernel.dkdv.smem_bytes``) must fit one block of ``arch``; the fused pass must serve
    the problem on ``arch`` (``dkdv_serves``); and the head sizes and block_dv must be ones
    ``arch``'s MMA tiles (``tiling_error``), and scores in registers need no more than
    ``REGS_MAX_THREADS`` threads. Cheap: no compile."""
    reasons = [reason] if (reason := tiling_error(arch, problem, config)) else []
    if config.scores == "regs" and config.threads > REGS_MAX_THREADS:
        reasons.append(
            f"scores in registers lay out for at most {REGS_MAX_THREADS} threads, not {config.threads}"
        )
    limit = get_arch(arch).smem_per_block
    floor = dkdv.smem_bytes(problem, config) if sweep == "dkdv" else config.smem_floor(problem)
    if sweep == "dkdv" and not dkdv_serves(problem, arch):
        reasons.append(
            f"the fused dk and dv pass does not serve DK x DV = {problem.dk} x {problem.dv} on {arch}"
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


def runs(config: KernelConfig, problem: Problem) -> bool:
    """Whether ``config`` tiles ``problem`` with a pipeline no deeper than a segment."""
    try:
        config.check_fits(problem)
    except ValueError:
        return False
    return config.pipeline_fits(problem)
