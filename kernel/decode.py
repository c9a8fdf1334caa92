"""The decode step on a pool of states, in TileLang: one token per sequence, each
sequence's state read from the slot a tensor names, updated in place.

Per (sequence n, head h), with ``s = Slots[n]`` and ``S = Pool[s, h]`` (``[DK, DV]``)::

    S' = alpha_h * S + k^T v          # [DK, 1] @ [1, DV] -> [DK, DV], fp32
    o  = (scale * q) S'               # [1, DK] @ [DK, DV] -> [1, DV]
    Pool[s, h] = S'

A slot outside ``[0, slots)`` (-1, the padding of a batch, or any bad value) touches no
state and gives a zero output row: the kernel never writes out of bounds, whatever the
indices hold, without the host reading them.

The grid is ``(N*H, DV / block_dv)``: one block per (sequence, head, value slice) owns a
``[DK, block_dv]`` tile of the state, so that a small batch still spreads over the SMs.
The state is not split along DK: each output column is a sum over all of DK, and a DK
split would need a second pass (fp32 atomics into a zeroed buffer, then a cast), two more
launches where a decode step at a small batch is mostly launch latency. ``block_dv`` down
to 8 columns (32 bytes of fp32 a row, one DRAM sector) gives 16 blocks per (sequence,
head) at DV = 128 instead.

This module loads no TileLang until a kernel is made (``decode_step``), so that the
config types serve a command line at once.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Self

from kernel.config import DTYPES, HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, MIN_HEAD_DIM

ACCUM = "float32"
POOL_DTYPES = ("float32", "bfloat16")  # the state pool: fp32, or bf16 to halve its bytes
SLOT_DTYPES = ("int32", "int64")  # the slot indices, as torch hands them
# The values each knob takes; block_dv runs over those that divide DV (``decode_choices``).
DECODE_KNOBS: dict[str, tuple] = {
    "block_dv": (8, 16, 32, 64, 128, 256),
    "threads": (32, 64, 128, 256),
}
# fp32 state elements one thread holds at most: past 128, ptxas spills (the probe of
# tests/test_decode.py, sm_90a).
MAX_ELEMENTS_PER_THREAD = 128
# The rule's aims, not fitted (the tuner ranks the knobs): blocks per SM, and the state
# elements each thread holds.
RULE_BLOCKS_PER_SM = 4
RULE_ELEMENTS_PER_THREAD = 32


@dataclass(frozen=True)
class DecodeProblem:
    """What one compiled decode kernel serves: every batch size N and pool size (both read
    from the tensors at launch) of ``heads`` heads of ``dk`` x ``dv`` states. ``dtype``:
    q, k, v and o; ``pool_dtype``: the states; ``slot_dtype``: the slot indices;
    ``scale`` multiplies the queries, a constant of the kernel; ``gated``: each (sequence,
    head) also reads a log-gate ``g`` of its token (simple GLA's, Mamba2's ``dt * A``) and
    decays by ``alpha_h * exp(g)``."""

    heads: int
    dk: int
    dv: int
    dtype: str = "float16"
    pool_dtype: str = "float32"
    slot_dtype: str = "int32"
    scale: float = 1.0
    gated: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.heads, bool) or not isinstance(self.heads, int) or self.heads < 1:
            raise ValueError(f"heads must be a positive integer, got {self.heads!r}")
        for name in ("dk", "dv"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not (MIN_HEAD_DIM <= value <= MAX_HEAD_DIM and value % HEAD_DIM_MULTIPLE == 0)
            ):
                raise ValueError(
                    f"{name} must be a multiple of {HEAD_DIM_MULTIPLE} in "
                    f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {value!r}"
                )
        for name, allowed in (("dtype", DTYPES), ("pool_dtype", POOL_DTYPES), ("slot_dtype", SLOT_DTYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        scale = self.scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise ValueError(f"scale must be a finite number, got {scale!r}")
        object.__setattr__(self, "scale", float(scale))
        if not isinstance(self.gated, bool):
            raise ValueError(f"gated must be True or False, got {self.gated!r}")

    def state_bytes(self) -> int:
        """Bytes of one (slot, head) state in the pool."""
        return self.dk * self.dv * (4 if self.pool_dtype == "float32" else 2)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if not self.gated:  # a constant decay's records read as before the gate
            del data["gated"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        return cls(**data)


@dataclass(frozen=True)
class DecodeCase:
    """A decode step as the tuner measures it and a dispatch table holds it: ``batch``
    sequences (N) of ``problem``, whose rule and table pick a config by N."""

    batch: int
    problem: DecodeProblem

    def __post_init__(self) -> None:
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch (sequences) must be a positive integer, got {self.batch!r}")

    @property
    def rows(self) -> int:
        """(sequence, head) pairs: the grid's first dimension."""
        return self.batch * self.problem.heads

    def state_bytes(self) -> int:
        """Bytes of the states one step reads (and writes again): N x H x DK x DV of the pool."""
        return self.rows * self.problem.state_bytes()

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, **self.problem.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        fields = dict(data)
        return cls(fields.pop("batch"), DecodeProblem.from_dict(fields))

    def __str__(self) -> str:
        p = self.problem
        return f"decode N={self.batch} H={p.heads} DK={p.dk} DV={p.dv} {p.dtype}, {p.pool_dtype} pool"


@dataclass(frozen=True)
class DecodeConfig:
    """The knobs of the decode step. block_dv: the value columns one block owns (the grid
    is ``(N*H, DV / block_dv)``); threads: per block."""

    block_dv: int = 32
    threads: int = 128

    def __post_init__(self) -> None:
        for name, allowed in DECODE_KNOBS.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")

    @property
    def label(self) -> str:
        """'32/128': block_dv/threads."""
        return f"{self.block_dv}/{self.threads}"

    def blocks(self, rows: int, dv: int) -> int:
        """Blocks one step launches for ``rows`` (sequence, head) pairs."""
        return rows * (dv // self.block_dv)

    def fits_error(self, problem: DecodeProblem) -> str | None:
        """Why this config cannot run ``problem``, or None."""
        if problem.dv % self.block_dv:
            return f"block_dv={self.block_dv} must divide dv={problem.dv}"
        per_thread = problem.dk * self.block_dv / self.threads
        if per_thread > MAX_ELEMENTS_PER_THREAD:
            return (
                f"a [{problem.dk}, {self.block_dv}] state tile over {self.threads} threads holds "
                f"{per_thread:g} elements a thread, over {MAX_ELEMENTS_PER_THREAD}"
            )
        if per_thread < 1:
            return f"a [{problem.dk}, {self.block_dv}] state tile leaves threads of {self.threads} idle"
        return None

    def check_fits(self, problem: DecodeProblem) -> None:
        """``ValueError`` where this config cannot run ``problem`` (``fits_error``)."""
        if reason := self.fits_error(problem):
            raise ValueError(reason)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        return cls(**data)


def decode_knobs(problem: DecodeProblem) -> dict[str, tuple]:
    """Each knob's values for ``problem`` (``DECODE_KNOBS``, block_dv those dividing DV):
    the tuner's search space, whose configs that ``fits_error`` refuses are told restricted."""
    return {
        "block_dv": tuple(d for d in DECODE_KNOBS["block_dv"] if problem.dv % d == 0),
        "threads": DECODE_KNOBS["threads"],
    }


def decode_choices(problem: DecodeProblem) -> list[DecodeConfig]:
    """Every config that runs ``problem``, in a fixed order: the decode step's search space."""
    return [
        c
        for c in (DecodeConfig(b, t) for b in DECODE_KNOBS["block_dv"] for t in DECODE_KNOBS["threads"])
        if c.fits_error(problem) is None
    ]


def decode_config(problem: DecodeProblem, rows: int, sms: int) -> DecodeConfig:
    """The rule's config for ``rows`` (sequence, head) pairs on a GPU of ``sms`` SMs: the
    widest value slice whose grid gives every SM ``RULE_BLOCKS_PER_SM`` blocks, else the
    narrowest (a small batch: as many blocks as the state's columns allow); threads for
    about ``RULE_ELEMENTS_PER_THREAD`` state elements each, at least 64 (two warps' loads in
    flight a block where the batch is small)."""
    most = MAX_ELEMENTS_PER_THREAD * max(DECODE_KNOBS["threads"])  # state elements a block may hold
    widths = [d for d in DECODE_KNOBS["block_dv"] if problem.dv % d == 0 and problem.dk * d <= most]
    filling = [d for d in widths if rows * (problem.dv // d) >= RULE_BLOCKS_PER_SM * sms]
    block_dv = max(filling) if filling else min(widths)
    want = problem.dk * block_dv // RULE_ELEMENTS_PER_THREAD
    threads = min((t for t in DECODE_KNOBS["threads"] if t >= min(max(want, 64), 256)), default=256)
    config = DecodeConfig(block_dv, threads)
    config.check_fits(problem)
    return config


def decode_step(problem: DecodeProblem, config: DecodeConfig):
    """The ``@T.prim_func`` ``main(Q, K, V, Decay, Slots, Pool, O)`` of one step (gated:
    ``main(Q, K, V, Decay, G, Slots, Pool, O)``), for every batch size N and pool size P
    (symbolic, read from the tensors at launch).

    Q, K: ``[N, 1, H, DK]``; V, O: ``[N, 1, H, DV]``; all of ``dtype``. Decay: fp32 ``[H]``,
    each head's alpha. G: fp32 ``[N, 1, H]``, each token's log-gate (the decay is
    ``alpha_h * exp(G)``). Slots: ``[N]`` of ``slot_dtype``, the pool row of each sequence.
    Pool: ``[P, H, DK, DV]`` of ``pool_dtype``, read and written in place at the valid
    slots only. Accumulation is fp32; a bf16 pool is rounded once, on the store."""
    import tilelang.language as T

    config.check_fits(problem)
    heads, dk, dv, dtype, scale = problem.heads, problem.dk, problem.dv, problem.dtype, problem.scale
    block_dv, threads = config.block_dv, config.threads
    batch, slots = T.dynamic("batch, slots")
    pool_shape, slot_dtype, pool_dtype = [slots, heads, dk, dv], problem.slot_dtype, problem.pool_dtype

    @T.macro
    def step(Q, K, V, Slots, Pool, O, alpha, n, h, v0):
        """One block's ``[DK, block_dv]`` slice of the state of (n, h), decayed by ``alpha``."""
        S = T.alloc_fragment([dk, block_dv], ACCUM)
        o = T.alloc_fragment([block_dv], ACCUM)
        slot = Slots[n]
        if slot >= 0 and slot < slots:
            T.copy(Pool[slot, h, :, v0 : v0 + block_dv], S)
            for d, j in T.Parallel(dk, block_dv):  # S' = alpha S + k^T v
                S[d, j] = S[d, j] * alpha + T.Cast(ACCUM, K[n, 0, h, d]) * T.Cast(ACCUM, V[n, 0, h, v0 + j])
            T.copy(S, Pool[slot, h, :, v0 : v0 + block_dv])
            for d, j in T.Parallel(dk, block_dv):  # the terms of q S', summed over DK
                S[d, j] = S[d, j] * T.Cast(ACCUM, Q[n, 0, h, d])
            T.reduce_sum(S, o, dim=0)  # [DK, bDV] -> [bDV]
            for j in T.Parallel(block_dv):
                O[n, 0, h, v0 + j] = T.Cast(dtype, o[j] * scale)
        else:  # padding (-1) or out of range: no state touched, a zero row
            for j in T.Parallel(block_dv):
                O[n, 0, h, v0 + j] = T.Cast(dtype, 0)

    if problem.gated:

        @T.prim_func
        def gated(
            Q: T.Tensor([batch, 1, heads, dk], dtype), K: T.Tensor([batch, 1, heads, dk], dtype),
            V: T.Tensor([batch, 1, heads, dv], dtype), Decay: T.Tensor([heads], ACCUM),
            G: T.Tensor([batch, 1, heads], ACCUM), Slots: T.Tensor([batch], slot_dtype),
            Pool: T.Tensor(pool_shape, pool_dtype), O: T.Tensor([batch, 1, heads, dv], dtype),
        ):  # fmt: skip
            with T.Kernel(batch * heads, dv // block_dv, threads=threads) as (bnh, bv):
                n, h = bnh // heads, bnh % heads
                step(Q, K, V, Slots, Pool, O, Decay[h] * T.exp(G[n, 0, h]), n, h, bv * block_dv)

        return gated

    @T.prim_func
    def main(
        Q: T.Tensor([batch, 1, heads, dk], dtype), K: T.Tensor([batch, 1, heads, dk], dtype),
        V: T.Tensor([batch, 1, heads, dv], dtype), Decay: T.Tensor([heads], ACCUM),
        Slots: T.Tensor([batch], slot_dtype), Pool: T.Tensor(pool_shape, pool_dtype),
        O: T.Tensor([batch, 1, heads, dv], dtype),
    ):  # fmt: skip
        with T.Kernel(batch * heads, dv // block_dv, threads=threads) as (bnh, bv):
            n, h = bnh // heads, bnh % heads
            step(Q, K, V, Slots, Pool, O, Decay[h], n, h, bv * block_dv)

    return main
