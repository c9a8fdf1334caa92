"""The checks of a ``decay_attention`` call: one ``ValueError`` naming the expected and the
actual value, before anything is launched. The checks of types and shapes run on every
call, traced (fake and meta tensors) or not; those of the values in the decay and offset
tensors where the values exist."""

import functools
import math
import numbers
import weakref
from typing import Any, NamedTuple

import torch

from kernel.builder import TORCH_DTYPES, constant_decay
from kernel.config import Problem
from kernel.constraints import rows_error

DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}
# id -> (weak reference, version) of the decay and cu_seqlens tensors whose values passed
# their check: the check waits for the GPU, so a model's buffers pay it once.
_CHECKED: dict[int, tuple[weakref.ref, int]] = {}


class Sizes(NamedTuple):
    """A call's sizes as its tensors hold them: symbolic where torch.compile traces a new
    length (a ``Problem`` takes ints), for the checks that read only sizes."""

    batch: Any
    heads: Any
    seqlen: Any
    dk: Any
    dv: Any


def sizes(q: torch.Tensor, v: torch.Tensor) -> Sizes:
    """The sizes of checked tensors, each one a ``Problem`` takes (else ``ValueError``
    naming the first it refuses). A symbolic size (torch.compile's) is left to the call
    on real tensors, which checks it."""
    b, s, h, dk = q.shape
    found = Sizes(b, h, s, dk, v.shape[-1])
    Problem(*(x if type(x) is int else 64 for x in found))
    if type(b) is int and type(h) is int:
        _check_rows(b, h, "batch")
    return found


@functools.lru_cache(maxsize=256)
def shape_problem(q_shape: torch.Size, dv: int, dtype: torch.dtype) -> Problem:
    """The problem of checked tensors (q's shape, v's last dimension, their dtype)."""
    b, s, h, dk = q_shape
    return Problem(b, h, s, dk, dv, DTYPE_NAMES[dtype])


def decay_parts(decay: Any) -> tuple[torch.Tensor | None, float]:
    """A call's decay as (its tensor of one alpha per head, else None; its one alpha for
    every head, else 1.0): a real number in (0, 1] or a tensor (whose shape and values
    ``decay_tensor`` checks)."""
    if isinstance(decay, torch.Tensor):
        return decay, 1.0
    if not _real(decay):
        hint = " (1.0 for no decay)" if decay is None else ""
        raise ValueError(
            f"decay must be a float in (0, 1] or a tensor [H] of them{hint}, got {_describe(decay)}"
        )
    check_alpha(decay)
    return None, float(decay)


def check_arguments(scale: Any, initial_state: Any, output_final_state: Any, cu_seqlens: Any) -> None:
    """The types of a call's arguments but the tensors and the decay: a scale that is a
    finite real number or None, a flag that is a bool, states and offsets that are tensors
    or None."""
    if not (scale is None or (_real(scale) and abs(scale) < math.inf)):  # finite; traceable
        raise ValueError(f"scale wants a finite number, got {scale!r}"[:200])
    if not isinstance(output_final_state, bool):
        raise ValueError(f"output_final_state must be True or False, got {_describe(output_final_state)}")
    for name, t in (("initial_state", initial_state), ("cu_seqlens", cu_seqlens)):
        if not (t is None or isinstance(t, torch.Tensor)):
            raise ValueError(f"{name} must be a tensor or None, got {_describe(t)}")


def check_qkv(q: Any, k: Any, v: Any) -> Problem:
    """The problem of the call (``check_tensors``), of at most ``MAX_ROWS`` (batch, head)
    pairs."""
    check_tensors(q, k, v)
    problem = shape_problem(q.shape, v.shape[-1], q.dtype)
    _check_rows(problem.batch, problem.heads, "batch")
    return problem


def check_tensors(q: Any, k: Any, v: Any) -> None:
    """q, k ``[B, S, H, DK]`` and v ``[B, S, H, DV]``, fp16 or bf16 CUDA (or meta) tensors
    of one dtype and device."""
    _check_qkv(q, k, v, "H", shared=3)


def _check_qkv(q: Any, k: Any, v: Any, heads: str, *, shared: int) -> None:
    """Four dimensions each, CUDA (or meta), fp16 or bf16, one dtype and device; k shaped as
    q, and v sharing q's first ``shared`` sizes (``heads``: what the message calls q's third)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d tensor [B, S, {heads}, D], got {_describe(t)}")
        if t.device.type not in ("cuda", "meta"):
            raise ValueError(f"{name} must be on a CUDA device, got {t.device}")
    if q.dtype not in DTYPE_NAMES:
        raise ValueError(f"q must be float16 or bfloat16, got {q.dtype}")
    if k.shape != q.shape or v.shape[:shared] != q.shape[:shared]:
        raise ValueError(
            f"k must be shaped as q {list(q.shape)} and v [B, S, H, DV]; got {list(k.shape)}, {list(v.shape)}"
        )
    if not (k.dtype == v.dtype == q.dtype) or not (k.device == v.device == q.device):
        got = ", ".join(f"{t.dtype} on {t.device}" for t in (q, k, v))
        raise ValueError(f"q, k, v must share dtype and device, got {got}")


def grouped(q: Any, v: Any) -> bool:
    """Whether q (and k) hold fewer heads than v: q and k in groups (Mamba2's ``ngroups``),
    which the gated kernel serves (``kernel.ops.gated``)."""
    return (
        isinstance(q, torch.Tensor)
        and isinstance(v, torch.Tensor)
        and q.dim() == 4 == v.dim()
        and (q.shape[2] != v.shape[2])
    )


def wants_grad(*tensors: Any) -> bool:
    """Whether autograd records a call of these arguments: grad enabled and a tensor among
    them that requires grad (else an eager call skips ``torch.autograd.Function``'s cost,
    about 6 us of host time)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def check_group_tensors(q: Any, k: Any, v: Any) -> Sizes:
    """q, k ``[B, S, G, DK]`` and v ``[B, S, H, DV]`` with H a multiple of G, fp16 or bf16
    CUDA (or meta) tensors of one dtype and device; the call's sizes, H its heads (of at
    most ``MAX_ROWS`` (batch, head) pairs)."""
    _check_qkv(q, k, v, "heads", shared=2)
    groups, heads = q.shape[2], v.shape[2]
    if type(groups) is int and type(heads) is int and (groups < 1 or heads % groups):
        raise ValueError(f"v's heads H must be a multiple of q and k's groups G = {groups}, got H = {heads}")
    b, s, _, dk = q.shape
    found = Sizes(b, heads, s, dk, v.shape[-1])
    Problem(*(x if type(x) is int else 64 for x in found))
    if type(b) is int and type(heads) is int:
        _check_rows(b, heads, "batch")
    return found


def check_gate(g: Any, sizes: Sizes, device: torch.device) -> None:
    """A per-token log-gate: None, or an fp32 ``[B, S, H]`` tensor (``[1, T, H]`` packed)
    on q's device. Its values are not checked: that would wait for the GPU."""
    if g is None:
        return
    if not isinstance(g, torch.Tensor):
        raise ValueError(f"g must be a tensor [B, S, H] or None, got {_describe(g)}")
    shape = [sizes.batch, sizes.seqlen, sizes.heads]
    if list(g.shape) != shape:
        raise ValueError(f"g must be shaped [B, S, H] = {shape}, got {list(g.shape)}")
    if g.dtype != torch.float32:
        raise ValueError(f"g must be float32 (log-gates, as fla's), got {g.dtype}")
    if g.device != device:
        raise ValueError(f"g is on {g.device} but q is on {device}")


def check_alpha(alpha: float) -> None:
    """One decay for every head, in (0, 1] (NaN is not: a comparison, which torch.compile traces)."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"decay must be in (0, 1], got {alpha}")


def check_decay(decay: torch.Tensor | None, alpha: float, heads: int, device: torch.device) -> None:
    """``alpha`` in (0, 1] where ``decay`` is None, else ``decay`` a floating-point ``[H]``
    tensor on q's device (its values: ``decay_tensor``)."""
    if decay is None:
        check_alpha(alpha)
        return
    if decay.shape != (heads,):
        raise ValueError(
            f"decay must be a float or a tensor of {heads} alphas [H], got shape {list(decay.shape)}"
        )
    if not decay.is_floating_point():
        raise ValueError(f"decay must be a floating-point tensor, got {decay.dtype}")
    if decay.device != device:
        raise ValueError(f"decay is on {decay.device} but q is on {device}")


def decay_tensor(decay: torch.Tensor | None, alpha: float, heads: int, device: torch.device) -> torch.Tensor:
    """The fp32 ``[H]`` decay the kernels read: ``decay``, or ``alpha`` for every head where
    it is None, checked (``check_decay``) and its values to lie in (0, 1]."""
    check_decay(decay, alpha, heads, device)
    if decay is None:
        return constant_decay(alpha, heads, device)
    return decay_values(decay)


def decay_values(decay: torch.Tensor) -> torch.Tensor:
    """A decay tensor of checked shape, dtype and device as the kernels read it (fp32,
    contiguous), its values checked to lie in (0, 1]: once per caller's tensor and version
    (a decay of another dtype is cast anew on every call), never while a graph is captured."""
    alphas = decay.to(torch.float32).contiguous()
    if not _checked_before(decay) and not torch.cuda.is_current_stream_capturing():
        bad = ~((alphas > 0) & (alphas <= 1))
        if bool(bad.any()):
            head = int(bad.nonzero()[0])
            raise ValueError(
                f"decay must lie in (0, 1] for every head, got {alphas[head].item()} at head {head}"
            )
        _remember(decay)
    return alphas


def check_offsets_shape(cu_seqlens: torch.Tensor, problem: Problem | Sizes, device: torch.device) -> None:
    """Packed sequences: q, k, v ``[1, T, H, D]`` and ``cu_seqlens`` an int32 or int64
    ``[N + 1]`` tensor on q's device (its values: ``check_offsets``)."""
    if problem.batch != 1:
        raise ValueError(f"with cu_seqlens, q, k, v must be [1, T, H, D], got a batch of {problem.batch}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            "cu_seqlens must be an int32 or int64 tensor [N + 1], "
            f"got {cu_seqlens.dtype} {list(cu_seqlens.shape)}"
        )
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {device}")
    if type(n := cu_seqlens.numel() - 1) is int and type(problem.heads) is int:  # symbolic: traced
        _check_rows(n, problem.heads, "sequences")


def check_offsets(cu_seqlens: torch.Tensor, problem: Problem, device: torch.device) -> torch.Tensor:
    """The int32 offsets the packed kernel reads: ``[N + 1]`` (``check_offsets_shape``), 0
    first, T last, strictly increasing (values checked once per tensor and version, as the
    decay's are)."""
    check_offsets_shape(cu_seqlens, problem, device)
    return offsets_values(cu_seqlens, problem)


def offsets_values(cu_seqlens: torch.Tensor, problem: Problem) -> torch.Tensor:
    """Offsets of checked shape, dtype and device as the packed kernel reads them (int32,
    contiguous), their values checked once per tensor and version (``check_offsets``)."""
    if not _checked_before(cu_seqlens) and not torch.cuda.is_current_stream_capturing():
        offsets = cu_seqlens.tolist()
        steps = [b - a for a, b in zip(offsets, offsets[1:])]
        if offsets[0] != 0 or offsets[-1] != problem.seqlen or min(steps) < 1:
            raise ValueError(
                f"cu_seqlens must rise strictly from 0 to T = {problem.seqlen}, got {_clip(offsets)}"
            )
        _remember(cu_seqlens)
    return cu_seqlens.to(torch.int32).contiguous()


def check_state(
    state: torch.Tensor | None, problem: Problem | Sizes, sequences: int, device: torch.device
) -> None:
    """An initial state is fp32 ``[B, H, DK, DV]``, or ``[N, H, DK, DV]`` for N packed sequences."""
    if state is None:
        return
    shape = [sequences, problem.heads, problem.dk, problem.dv]
    if list(state.shape) != shape or state.dtype != torch.float32:
        what = "[N, H, DK, DV] for N packed sequences" if sequences != problem.batch else "[B, H, DK, DV]"
        raise ValueError(
            f"initial_state must be float32 {shape} {what}, got {state.dtype} {list(state.shape)}"
        )
    if state.device != device:
        raise ValueError(f"initial_state is on {state.device} but q is on {device}")


def _check_rows(rows: int, heads: int, what: str) -> None:
    if reason := rows_error(rows, heads, what):
        raise ValueError(reason)


def _checked_before(tensor: torch.Tensor) -> bool:
    """Whether this tensor's values, unchanged since, passed their check (``_remember``)."""
    seen = _CHECKED.get(id(tensor))
    return seen is not None and seen[0]() is tensor and seen[1] == tensor._version


def _remember(tensor: torch.Tensor) -> None:
    key = id(tensor)
    _CHECKED[key] = (weakref.ref(tensor, lambda _: _CHECKED.pop(key, None)), tensor._version)


def _real(x: Any) -> bool:
    """A real number that is no bool (numpy's scalars included)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _clip(values: list[int]) -> str:
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:4]))}, ..., {values[-1]}]"


def _describe(x: Any) -> str:
    return f"shape {list(x.shape)}" if isinstance(x, torch.Tensor) else f"{type(x).__name__} {x!r}"[:120]
