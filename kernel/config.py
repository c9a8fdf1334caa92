"""The two frozen value types everything else is keyed by: a problem and a kernel config.

Both validate on construction and raise ``ValueError`` naming the expected and the actual
value, so a user mistake never reaches the compiler. Both round-trip through plain dicts
(``to_dict`` / ``from_dict``) for Optuna, caches and the JSON export.
"""

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any, Self

DTYPES = ("float16", "bfloat16")
# Q/K/V/O rows are moved by TMA and fed to wgmma: 16-element granularity, and a head
# wider than 256 would not leave shared memory for even one chunk.
MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_MULTIPLE = 16, 256, 16
# The values each knob takes in the search space, the validation grid and the bench;
# ``block_dv`` runs over the divisors of DV (``knob_choices``). segments: 1 is the seed's
# single-pass kernel, n > 1 the sequence-split variant (kernel.seq_split).
KNOBS: dict[str, tuple] = {
    "chunk": (32, 64, 128),
    "num_stages": (1, 2, 3, 4),
    "threads": (128, 256),
    "scores": ("smem", "regs"),
    "segments": (1, 2, 4, 8, 16, 32, 64),
}
SCORES = KNOBS["scores"]
SEGMENT_COUNTS = KNOBS["segments"]
SLOT_DTYPES = ("int32", "int64")  # a pool's slot indices, as torch hands them
SWEEPS = ("forward", "dkdv")  # the kernels a config is tuned for: the forward, the fused dk+dv pass
# A problem's decay: a constant per head ("head", the seed's kernels, read at run time), or a
# log-gate per token, fla's ``g`` (``"token"``: ``kernel.gated``, q and k in groups or not).
GATES = ("head", "token")
# The per-token log-gates a gated problem is checked with (``kernel.validate``): -lo to -hi,
# their magnitudes spread evenly in log, the range the gated kernel is built to be safe for.
GATE_RANGE = (1e-4, 20.0)


def knob_choices(dv: int) -> dict[str, tuple]:
    """Knob name -> values, in ``KernelConfig``'s field order, for a value head of ``dv``."""
    block_dvs = tuple(d for d in range(HEAD_DIM_MULTIPLE, dv + 1, HEAD_DIM_MULTIPLE) if dv % d == 0)
    return {
        "chunk": KNOBS["chunk"],
        "block_dv": block_dvs,
        **{k: v for k, v in KNOBS.items() if k != "chunk"},
    }


def config_grid(dv: int) -> list["KernelConfig"]:
    """Every config of ``knob_choices(dv)``, in a fixed order."""
    table = knob_choices(dv)
    return [KernelConfig(**dict(zip(table, values))) for values in itertools.product(*table.values())]


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Problem:
    """One attention call: Q, K ``[batch, seqlen, heads, dk]``; V, O ``[batch, seqlen, heads, dv]``.

    No decay value: the kernels read each head's decay at run time, so one compiled kernel,
    one study and one dispatch entry serve every decay. A problem dict written before that
    (best-config files, dispatch tables) names one ``alpha``; ``from_dict`` reads it and
    ignores the alpha (``LEGACY_FIELDS``).

    ``gate``: the decay's kind (``GATES``): ``"head"``, a constant per head (the seed's
    kernels), or ``"token"``, a per-token log-gate ``g [B, S, H]`` (``kernel.gated``),
    whose q and k may come in ``groups`` (Mamba2's ``ngroups``: Q, K ``[batch, seqlen,
    groups, dk]``, ``heads`` a multiple of it; None where they have ``heads`` heads, as
    ``groups == heads`` is stored). Both stay out of ``to_dict`` and the repr at their
    defaults, so a constant-decay problem's records read as before.
    """

    batch: int
    heads: int
    seqlen: int
    dk: int
    dv: int
    dtype: str = "float16"
    gate: str = "head"
    groups: int | None = None

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "seqlen"):
            _positive_int(name, getattr(self, name))
        for name in ("dk", "dv"):
            value = getattr(self, name)
            _positive_int(name, value)
            if not (MIN_HEAD_DIM <= value <= MAX_HEAD_DIM and value % HEAD_DIM_MULTIPLE == 0):
                raise ValueError(
                    f"{name} must be a multiple of {HEAD_DIM_MULTIPLE} in "
                    f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {value}"
                )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {self.gate!r}")
        if self.groups is not None:
            _positive_int("groups", self.groups)
            if self.gate != "token":
                raise ValueError("groups of q and k need the per-token gate's kernel: gate='token'")
            if self.heads % self.groups:
                raise ValueError(f"heads must be a multiple of groups = {self.groups}, got {self.heads}")
            if self.groups == self.heads:
                object.__setattr__(self, "groups", None)

    @property
    def qk_heads(self) -> int:
        """The heads of Q and K: ``groups``, else ``heads``."""
        return self.groups or self.heads

    @property
    def kind(self) -> tuple:
        """What a problem tuned at one shape shares with the shapes its config serves (a
        dispatch table's bucket): the head sizes, the dtype and the gate."""
        return self.dk, self.dv, self.dtype, self.gate

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        return {k: v for k, v in data.items() if k not in GATE_FIELDS or v != GATE_FIELDS[k]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        return cls(**_known_fields(cls, {k: v for k, v in data.items() if k not in LEGACY_FIELDS}))

    def __repr__(self) -> str:
        return f"Problem({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"


# Problem fields and their defaults, a constant decay's, which its records leave out.
GATE_FIELDS = {"gate": "head", "groups": None}


def gate_flags(problem: Problem) -> list[str]:
    """The command line's flags of ``problem``'s gate (``--gate token [--groups G]``; none
    for a constant decay): what a child ``python -m tuner`` is handed beside the shape."""
    if problem.gate == "head":
        return []
    return ["--gate", problem.gate, *(["--groups", str(problem.groups)] if problem.groups else [])]


@dataclass(frozen=True)
class KernelConfig:
    """The tunable knobs of the kernel.

    segments: the kernel variant. ``1`` is the seed's single-pass design
    (``kernel.scalar_decay``): one block walks the whole sequence. ``n > 1`` is the
    sequence-split variant (``kernel.seq_split``): the sequence is cut into ``n`` segments
    of whole chunks that run in parallel blocks, joined by a carry of their end states.
    chunk: tokens per chunk C. block_dv: the DV slice one block owns (the grid is
    ``(dv // block_dv, batch * heads)``). num_stages: depth of the software pipeline over
    chunks. threads: consumer threads per block (TileLang adds a producer warp group).
    scores: where the fp16 intra-chunk scores ``A * Gamma`` wait for their MMA, ``"regs"``
    (the seed) or ``"smem"`` (see ``kernel.scalar_decay``).
    """

    chunk: int = 64
    block_dv: int = 32
    num_stages: int = 2
    threads: int = 128
    scores: str = "smem"
    segments: int = 1

    def __post_init__(self) -> None:
        for name in ("chunk", "block_dv", "num_stages", "threads", "segments"):
            _positive_int(name, getattr(self, name))
        if self.scores not in SCORES:
            raise ValueError(f"scores must be one of {SCORES}, got {self.scores!r}")
        if self.chunk < 16 or self.chunk & (self.chunk - 1):
            raise ValueError(f"chunk must be a power of two >= 16, got {self.chunk}")
        if self.block_dv % HEAD_DIM_MULTIPLE:
            raise ValueError(f"block_dv must be a multiple of {HEAD_DIM_MULTIPLE}, got {self.block_dv}")
        if self.threads % 128:
            raise ValueError(f"threads must be a multiple of 128 (a warp group), got {self.threads}")

    @property
    def label(self) -> str:
        """'64/128/2/256/smem/1': the knobs in field order, as ``--enqueue`` reads them."""
        return "/".join(map(str, self.to_dict().values()))

    def segment_length(self, seqlen: int) -> int:
        return segment_length(seqlen, self.chunk, self.segments)

    def segment_count(self, seqlen: int) -> int:
        """Segments the sequence really has (fewer than ``segments`` when S is short)."""
        return math.ceil(seqlen / self.segment_length(seqlen))

    def blocks(self, problem: Problem) -> int:
        """Blocks the single-pass or the outputs kernel launches for ``problem``."""
        return (
            problem.batch * problem.heads * (problem.dv // self.block_dv) * self.segment_count(problem.seqlen)
        )

    def pipeline_fits(self, problem: Problem) -> bool:
        """Whether the pipeline is no deeper than the chunks of one segment it overlaps."""
        return self.num_stages <= self.segment_length(problem.seqlen) // self.chunk

    def check_fits(self, problem: Problem) -> None:
        """Raise ``ValueError`` if this config cannot tile ``problem`` at all."""
        if problem.dv % self.block_dv:
            raise ValueError(
                f"block_dv must divide dv: dv={problem.dv} is not a multiple of block_dv={self.block_dv}"
            )
        if self.segments > 1 and self.segment_length(problem.seqlen) >= problem.seqlen:
            raise ValueError(
                f"segments={self.segments} of whole {self.chunk}-token chunks leave one segment "
                f"for seqlen={problem.seqlen}: use segments=1 (the single-pass kernel)"
            )

    def smem_floor(self, problem: Problem) -> int:
        """Bytes of shared memory the chunk step cannot do with less of: one stage of its
        tiles ``Q_s``, ``K_s``, the weighted keys ``Kw_s`` (``[C, DK]`` each), ``V_s`` and
        ``O_s`` (``[C, bDV]``), and the scores ``[C, C]`` where they wait in shared memory,
        all of the problem's 2-byte dtype. TileLang gives every buffer its own bytes
        (``kernel.variants.PASS_CONFIGS``) and adds pipeline stages and the state's copy,
        so the compiled kernel needs at least this: a config over an architecture's limit
        is restricted before it is compiled (``kernel.constraints.violated``)."""
        c = self.chunk
        scores = c * c if self.scores == "smem" else 0
        return 2 * (3 * c * problem.dk + 2 * c * self.block_dv + scores)

    def seed_register_estimate(self, problem: Problem) -> int:
        """The seed's register arithmetic (section 5): fp32 fragment elements per thread.

        ``S_f [DK, bDV] + acc_o [C, bDV] + Gamma [C, C] + A [C, C]``, divided by the
        threads. It omits ``A_cast`` and temporaries; ptxas reports more.
        """
        c = self.chunk
        elements = problem.dk * self.block_dv + c * self.block_dv + 2 * c * c
        return math.ceil(elements / self.threads)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        return cls(**_known_fields(cls, data))


@dataclass(frozen=True)
class Call:
    """What a call asks of the kernel besides its shape and config, fixed when it is
    compiled: the query scale, whether a state goes in and comes out, whether the batch is
    packed sequences (``cu_seqlens``; one compiled kernel then serves every token and
    sequence count, so the problem's batch and seqlen do not matter to it), and whether
    the recurrence runs backwards in time (``reverse``: the state enters after each
    sequence's last token and leaves at its first; the backward's dk and dv passes,
    ``kernel.ops.backward``). ``dkdv``: the backward's fused reversed pass (``kernel.dkdv``),
    which takes dO too and writes dK and dV; its state in is dS's start, its state out dS
    at the first token. ``slots``: a packed call whose states live in a pool of slots
    (``kernel.scalar_decay.packed_fwd``), the dtype of its slot indices (``SLOT_DTYPES``);
    None for a call of its own state tensors. The decay is not here: the kernels read
    each head's alpha at run time."""

    scale: float = 1.0
    initial_state: bool = False
    final_state: bool = False
    packed: bool = False
    reverse: bool = False
    dkdv: bool = False
    slots: str | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.scale, bool)
            or not isinstance(self.scale, (int, float))
            or not math.isfinite(self.scale)
        ):
            raise ValueError(f"scale must be a finite number, got {self.scale!r}")
        if self.dkdv and not self.reverse:
            raise ValueError("the fused dk and dv sweep runs backwards in time: reverse=True")
        if self.slots is not None:
            if self.slots not in SLOT_DTYPES:
                raise ValueError(f"slots must be one of {SLOT_DTYPES} or None, got {self.slots!r}")
            if not self.packed or self.initial_state or self.final_state or self.reverse:
                raise ValueError(
                    "a pool of slots serves a packed forward call, which has no state tensor in or out"
                )
        object.__setattr__(self, "scale", float(self.scale))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# A call with scale 1 and no state in or out: what ``build`` and ``probe`` compile unless told.
PLAIN_CALL = Call()


def retnet_decay(heads: int) -> tuple[float, ...]:
    """RetNet's per-head decays ``gamma_h = 1 - 2^(-5-h)`` for h = 0 .. heads-1 (0.969,
    0.984, ... towards 1), as fla's ``MultiScaleRetention`` / ``chunk_retention`` computes
    them: the decay the tuner, the validation sweep and the bench check with."""
    _positive_int("heads", heads)
    return tuple(1.0 - 2.0 ** (-5 - h) for h in range(heads))


def model_call(problem: Problem) -> Call:
    """What the tuner measures and the bench times: the model form of a call, as a RetNet
    layer makes it, with the query scale ``DK^-1/2`` and the final state returned (no
    state in: a prefill from zero). Its decay is ``retnet_decay(problem.heads)``; the
    correctness bound covers the output and the final state (``kernel.validate.check``)."""
    return Call(scale=problem.dk**-0.5, final_state=True)


def dkdv_call(problem: Problem) -> Call:
    """What the tuner measures of the backward's fused dk and dv pass (``kernel.dkdv``,
    ``tuner run --sweep dkdv``): the sweep of a model call's backward, with its scale, from no
    final-state gradient and with no initial state, as the bench's backward rows run it."""
    return Call(scale=problem.dk**-0.5, reverse=True, dkdv=True)


def whole_chunks(problem: Problem, chunk: int) -> bool:
    """Whether a dense call's sequences are whole ``chunk``-token chunks (S a multiple of
    C). A kernel is compiled for one of the two classes (``kernel.variants.shape_generic``):
    of whole chunks, where each weight's exponent is a constant, as for a static length; or
    ragged, where each chunk counts its tokens at run time, which serves every length but
    costs time (experiments/generic/README.md)."""
    return problem.seqlen % chunk == 0


def segment_length(seqlen: int, chunk: int, segments: int) -> int:
    """Tokens per segment: whole chunks, so only the last segment is ragged."""
    return math.ceil(math.ceil(seqlen / segments) / chunk) * chunk


# Problem fields of earlier formats, read and ignored: the decay became a run-time input.
LEGACY_FIELDS = ("alpha",)


def _known_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}; expected {sorted(names)}")
    return dict(data)


# The seed's default: C = 64, block_DV = 32, 2 stages, 128 threads, scores in registers.
SEED_CONFIG = KernelConfig(scores="regs")
# The headline problem: the tuner's default and the bench's first shape.
HEADLINE = Problem(batch=8, heads=16, seqlen=4096, dk=128, dv=128)
