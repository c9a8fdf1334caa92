"""The decode step a server calls: ``decay_decode``, one token per sequence, each
sequence's state read from the row of a state pool that its slot names and updated there
in place (``kernel.decode``). Registered as the torch custom op
``decay_tuner::decay_decode``, which mutates the pool, so that it runs under
``torch.compile(fullgraph=True)`` and inside a captured CUDA graph (the slots live in a
tensor; pad the batch to the captured size with slot -1). An eager call on real tensors
runs the implementation directly, without torch's dispatch of the op.

The slot values stay on the GPU: reading them would wait for it on every call. The kernel
never writes out of bounds whatever they hold (a slot outside ``[0, P)`` is skipped as -1
is). ``DECAY_TUNER_CHECK_SLOTS=1``, for debugging, reads them on every call and refuses
one out of range or repeated within the call.
"""

import os
from typing import Any

import torch

from kernel.arch import get_arch
from kernel.builder import sm_count
from kernel.decode import DecodeConfig, DecodeProblem, decode_config
from kernel.decode_build import DecodeKernel, build_decode
from kernel.ops import inputs
from kernel.ops.serve import served_table

CHECK_VARIABLE = "DECAY_TUNER_CHECK_SLOTS"
POOL_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
SLOT_DTYPES = {torch.int32: "int32", torch.int64: "int64"}
# (a call's ``_signature``, scale) -> (its heads, the kernel serving it, the table it was
# picked from): the config depends on the batch, so each batch size a server pads to has its
# entry; one picked from another table than the one served now (``use_table``) is picked again.
_SERVED: dict[tuple, tuple[int, DecodeKernel, object]] = {}
_SERVED_MAX = 4096


def decay_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: float | torch.Tensor | None,
    *,
    pool: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    g: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step: for each sequence n and head h, with ``S = pool[slots[n], h]``,
    ``S <- decay_h * S + k^T v`` in place and ``o = (scale * q) S`` (with ``g``: ``S <-
    exp(g[n, 0, h]) * decay_h * S + k^T v``).

    Args:
        q, k: ``[N, 1, H, DK]``; v: ``[N, 1, H, DV]``; float16 or bfloat16 CUDA tensors
            (fla's ``[B, T, H, D]`` with T = 1).
        decay: a float in (0, 1], or a tensor ``[H]`` of one alpha per head in (0, 1];
            may be None (no decay but ``g``'s) where ``g`` is given.
        pool: the states, float32 (or bfloat16) ``[P, H, DK, DV]``, contiguous, on q's
            device; the rows ``slots`` names are updated in place, no other.
        slots: int32 (or int64) ``[N]`` on q's device, the pool row of each sequence; -1
            (padding), like any value outside ``[0, P)``, touches no state and gives a
            zero output row.
        scale: multiplies the queries (default ``DK ** -0.5``, as fla).
        g: fp32 ``[N, 1, H]``, each token's log-gate (<= 0; not checked: that would wait
            for the GPU), as ``decay_attention(..., g=)`` and fla's ``fused_recurrent_simple_gla``
            take it with T = 1.

    Returns:
        o ``[N, 1, H, DV]`` in q's dtype.

    A wrong argument raises one ``ValueError`` before anything is launched, the pool
    untouched. Repeated slots within one call race: ``DECAY_TUNER_CHECK_SLOTS=1`` refuses
    them (and slots out of range), reading the slots on every call.
    """
    per_head, alpha = (None, 1.0) if decay is None and g is not None else inputs.decay_parts(decay)
    inputs.check_arguments(scale, None, False, None)
    # Traced (torch.compile, fake or meta tensors): the op, whose fake implementation gives
    # the shape. On real tensors: its implementation, without the op's dispatch.
    if torch.compiler.is_compiling() or type(q) is not torch.Tensor or q.is_meta:
        check_step(q, k, v, pool, slots, g)
        scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
        return torch.ops.decay_tuner.decay_decode(q, k, v, per_head, alpha, scale, pool, slots, g)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    return _decode(q, k, v, per_head, alpha, scale, pool, slots, g)


def check_step(
    q: Any, k: Any, v: Any, pool: Any, slots: Any, g: Any = None
) -> tuple[int, int, int, int, str, str]:
    """The checks that need no values, of a traced call too: q, k ``[N, 1, H, DK]``, v
    ``[N, 1, H, DV]`` (``inputs.check_tensors``; T = 1), the pool ``[P, H, DK, DV]`` of
    float32 or bfloat16, contiguous, the slots int32 or int64 ``[N]``, and the gate, None
    or fp32 ``[N, 1, H]`` (``inputs.check_gate``), all on q's device. Returns ``(N, H, DK,
    DV, pool dtype, slot dtype)``."""
    inputs.check_tensors(q, k, v)
    n, t, h, dk = q.shape
    dv = v.shape[-1]
    if t != 1:
        raise ValueError(f"a decode step takes one token per sequence, q [N, 1, H, DK]; got T = {t}")
    inputs.check_gate(g, inputs.sizes(q, v), q.device)
    if type(n) is int and n < 1:  # symbolic where torch.compile traces a dynamic batch
        raise ValueError(f"a decode step takes at least one sequence, got N = {n}")
    if not isinstance(pool, torch.Tensor):
        raise ValueError(f"pool must be a tensor [P, H, DK, DV], got {_describe(pool)}")
    if pool.dim() != 4 or pool.shape[0] < 1 or tuple(pool.shape[1:]) != (h, dk, dv):
        raise ValueError(f"pool must be [P, {h}, {dk}, {dv}] with P >= 1, got {list(pool.shape)}")
    if pool.dtype not in POOL_DTYPES:
        raise ValueError(f"pool must be float32 or bfloat16, got {pool.dtype}")
    if pool.device != q.device:
        raise ValueError(f"pool is on {pool.device} but q is on {q.device}")
    if not pool.is_contiguous():
        raise ValueError(
            f"pool must be contiguous (it is written in place), got strides {list(pool.stride())}"
        )
    if not isinstance(slots, torch.Tensor):
        raise ValueError(f"slots must be an int32 tensor [N], got {_describe(slots)}")
    if slots.dtype not in SLOT_DTYPES or tuple(slots.shape) != (n,):
        raise ValueError(
            f"slots must be an int32 or int64 tensor [{n}], got {slots.dtype} {list(slots.shape)}"
        )
    if slots.device != q.device:
        raise ValueError(f"slots is on {slots.device} but q is on {q.device}")
    return n, h, dk, dv, POOL_DTYPES[pool.dtype], SLOT_DTYPES[slots.dtype]


def check_slot_values(slots: torch.Tensor, pool_rows: int) -> None:
    """``ValueError`` unless every slot is -1 or a row of the pool, no row twice: reads
    the slots (waits for the GPU), what ``DECAY_TUNER_CHECK_SLOTS`` turns on."""
    values = slots.tolist()
    bad = [s for s in values if not -1 <= s < pool_rows]
    if bad:
        raise ValueError(f"slots must lie in [-1, {pool_rows}) (-1: skip), got {_clip(bad)}")
    used = [s for s in values if s >= 0]
    if len(set(used)) != len(used):
        repeated = sorted({s for s in used if used.count(s) > 1})
        raise ValueError(
            f"slots must not repeat within one call (their states would race), got {_clip(repeated)}"
        )


def checking() -> bool:
    """Whether ``CHECK_VARIABLE`` turns the check of the slot values on: ``1``, ``true``,
    ``yes`` or ``on``; unset, empty, ``0``, ``false``, ``no`` or ``off`` leave it off (any
    case); ``ValueError`` for any other value."""
    value = os.environ.get(CHECK_VARIABLE, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{CHECK_VARIABLE} wants 1, true, yes or on, or 0, false, no or off, got {value!r}")


def kernel_for(problem: DecodeProblem, batch: int) -> DecodeKernel:
    """The kernel serving a step of ``batch`` sequences (``config_for``), compiled on first use."""
    return build_decode(problem, config_for(problem, batch))


def config_for(
    problem: DecodeProblem, batch: int, *, arch: str | None = None, sms: int | None = None
) -> DecodeConfig:
    """The config of a step of ``batch`` sequences: the pick of the table served
    (``kernel.ops.serve.served_table``; for ``arch`` where compiling ahead) for the nearest
    number of sequences it was tuned at (``Dispatch.decode_config``), else the rule's
    (``kernel.decode.decode_config``) for ``sms`` SMs (default: this GPU's)."""
    table = served_table(arch)
    tuned = None if table is None else table.decode_config(problem, batch)
    return tuned or decode_config(problem, batch * problem.heads, sms or sm_count())


# The numbers of sequences ``warmup_jobs`` serves: every N up to this many.
WARMUP_MAX_BATCH = 2048


def warmup_jobs(
    heads: int, dk: int, dv: int, dtype: str, *, arch: str, sms: int | None = None
) -> list[tuple[DecodeProblem, DecodeConfig]]:
    """Every decode kernel a model of ``heads`` heads of ``dk`` x ``dv`` calls at fla's
    default scale (``DK^-1/2``), by pool dtype (fp32, bf16) and slot dtype (int32, int64),
    for every N up to ``WARMUP_MAX_BATCH``: the table served's picks (``config_for``), else
    the rule's on ``sms`` SMs (default: ``arch``'s reference GPU's). One per compiled kernel."""
    sms = sms or get_arch(arch).sms
    jobs: dict[tuple[DecodeProblem, DecodeConfig], None] = {}
    for pool_dtype in POOL_DTYPES.values():
        for slot_dtype in SLOT_DTYPES.values():
            problem = DecodeProblem(heads, dk, dv, dtype, pool_dtype, slot_dtype, dk**-0.5)
            for n in range(1, WARMUP_MAX_BATCH + 1):
                jobs[problem, config_for(problem, n, arch=arch, sms=sms)] = None
    return list(jobs)


def _decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor | None,
    alpha: float,
    scale: float,
    pool: torch.Tensor,
    slots: torch.Tensor,
    g: torch.Tensor | None = None,
) -> torch.Tensor:
    """The op's implementation: checks, then one launch. The checks of types, shapes,
    dtypes, devices and layout that passed once for a call's ``_signature`` are not run
    again: a server's step costs a few attribute reads before its launch."""
    key = (_signature(q, k, v, pool, slots, g), scale)
    served = _SERVED.get(key)
    if served is not None and served[2] is not served_table():
        served = None
    if served is None:
        n, heads, dk, dv, pool_dtype, slot_dtype = check_step(q, k, v, pool, slots, g)
        dtype = inputs.DTYPE_NAMES[q.dtype]
        problem = DecodeProblem(heads, dk, dv, dtype, pool_dtype, slot_dtype, scale, g is not None)
    else:
        heads, kern, _ = served
    decay = inputs.decay_tensor(decay, alpha, heads, q.device)
    if checking() and not torch.cuda.is_current_stream_capturing():
        check_slot_values(slots, pool.shape[0])
    if served is None:  # every check passed: compile, or find the kernel compiled
        kern = kernel_for(problem, n)
        if len(_SERVED) >= _SERVED_MAX:
            _SERVED.clear()
        _SERVED[key] = (heads, kern, served_table())
    gate = None if g is None else g.contiguous()
    return kern.run(
        q.contiguous(), k.contiguous(), v.contiguous(), decay, slots.contiguous(), pool, gate=gate
    )


def _signature(q: Any, k: Any, v: Any, pool: Any, slots: Any, g: Any) -> tuple | None:
    """What ``check_step`` and the choice of kernel read of a call: equal signatures pass
    or fail them alike. None where an argument is no tensor."""
    try:
        return (
            type(q), type(k), type(v), type(pool), type(slots), q.shape, k.shape, v.shape,
            q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, pool.shape, pool.dtype,
            pool.device, pool.is_contiguous(), slots.shape, slots.dtype, slots.device,
            None if g is None else (type(g), g.shape, g.dtype, g.device),
        )  # fmt: skip
    except AttributeError:
        return None


_decode_op = torch.library.custom_op("decay_tuner::decay_decode", mutates_args=("pool",))(_decode)


@_decode_op.register_fake
def _(q, k, v, decay, alpha, scale, pool, slots, g=None):
    _, h, dk, dv, pool_dtype, slot_dtype = check_step(q, k, v, pool, slots, g)
    inputs.check_decay(decay, alpha, h, q.device)
    # Sizes traced symbolically (torch.compile's dynamic shapes, opcheck's) are checked
    # where the real call runs; a placeholder takes each one's place here.
    sizes = (x if type(x) is int else 64 for x in (h, dk, dv))
    DecodeProblem(*sizes, inputs.DTYPE_NAMES[q.dtype], pool_dtype, slot_dtype, scale)
    return q.new_empty(v.shape)


def _clip(values: list[int]) -> str:
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:8]))}, ...] ({len(values)})"


def _describe(x: Any) -> str:
    return f"shape {list(x.shape)}" if isinstance(x, torch.Tensor) else f"{type(x).__name__} {x!r}"[:120]
