"""The forward a model calls: ``decay_attention``, a drop-in for the forward of fla's
``chunk_simple_gla`` for a constant decay per head, registered as the torch custom op
``decay_tuner::decay_attention`` so that it runs under ``torch.compile(fullgraph=True)``
and inside a captured CUDA graph. It is differentiable in q, k, v and the initial state:
its autograd rule is the op ``decay_tuner::decay_attention_backward``, sweeps of the same
kernel (``kernel.backward``; dk and dv in one where ``kernel.dkdv`` serves). Called
eagerly on real tensors, the same two implementations run under a plain
``torch.autograd.Function`` instead, without the host time torch's dispatch of the ops
adds (experiments/cpu/host_overhead/); there a split forward also keeps the state entering
each segment for the backward's dq sweep (``_backward_of``), which the ops do not.

fla's arguments map one to one: ``g_gamma`` (log-decay per head) is ``log(decay)``, i.e.
``decay = exp(g_gamma)``; ``scale``, ``initial_state`` and ``output_final_state`` mean the
same, and the state is fp32 ``[B, H, DK, DV]`` in both; ``cu_seqlens`` packs sequences as
fla's does (q, k, v ``[1, T, H, D]``, states ``[N, H, DK, DV]``).
"""

import dataclasses
import functools
import math
import warnings
import weakref
from typing import Any

import torch

from kernel.backward import backward, sweep_calls
from kernel.builder import TORCH_DTYPES, ScalarDecayKernel, build, constant_decay, cuda_arch, sm_count
from kernel.config import Call, KernelConfig, Problem
from kernel.deploy import ExportError
from kernel.dispatch import Dispatch, default_config
from kernel.dkdv import dkdv_config
from kernel.variants import packed_config, same_segments

_KERNELS: dict[tuple[Problem, KernelConfig, Call], ScalarDecayKernel] = {}
# (problem, call, sequences) -> the kernel serving it under the current table: picking a
# config (``kernel_job``) took 40 us of Python per call on the CPU machine.
_SERVED: dict[tuple[Problem, Call, int], ScalarDecayKernel] = {}
_SERVED_MAX = 4096  # packed batches differ in T; past this many, start over
_DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}
_TABLE: list[Dispatch | None] = [None]
# id -> (weak reference, version) of the decay and cu_seqlens tensors whose values passed
# their check: the check waits for the GPU, so a model's buffers pay it once.
_CHECKED: dict[int, tuple[weakref.ref, int]] = {}


def use_table(table: Dispatch | None) -> None:
    """Serve every later call with the config ``table`` picks for its shape (``None``: the
    documented default, ``kernel.dispatch.default_config``)."""
    _TABLE[0] = table
    _SERVED.clear()


def decay_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: float | torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``o_t = (scale * q_t) S_t`` with ``S_t = decay_h * S_{t-1} + k_t^T v_t`` per head.

    q, k: ``[B, S, H, DK]``; v: ``[B, S, H, DV]``; float16 or bfloat16 CUDA tensors.
    decay: a float in (0, 1], or a tensor ``[H]`` of one alpha per head in (0, 1]. scale:
    multiplies the queries (default ``DK ** -0.5``, as fla). initial_state: fp32
    ``[B, H, DK, DV]``, the state before the first token (default zero). Returns ``(o,
    final_state)``: ``o`` ``[B, S, H, DV]`` in q's dtype, and the fp32 ``[B, H, DK, DV]``
    state after the last token when ``output_final_state``, else ``None``. cu_seqlens:
    packed sequences, an int32 (or int64) tensor ``[N + 1]`` of offsets from 0 to T, strictly
    increasing, with q, k, v ``[1, T, H, D]`` and states ``[N, H, DK, DV]``; no state
    crosses from one sequence to the next. A wrong input raises ``ValueError`` before
    anything is launched.
    """
    if scale is None:  # a q that is no tensor is refused with the other checks
        scale = q.shape[-1] ** -0.5 if isinstance(q, torch.Tensor) else 1.0
    alpha, per_head = (float(decay), None) if isinstance(decay, (int, float)) else (1.0, decay)
    args = (q, k, v, per_head, alpha, float(scale), initial_state, output_final_state, cu_seqlens)
    # Traced (torch.compile, fake or meta tensors): the op, whose fake implementation gives
    # the shapes. Called on real tensors: the same implementation, without the op's dispatch.
    traced = torch.compiler.is_compiling() or (
        isinstance(q, torch.Tensor) and (type(q) is not torch.Tensor or q.is_meta)
    )
    o, final = (torch.ops.decay_tuner.decay_attention if traced else _Eager.apply)(*args)
    return o, (final if output_final_state else None)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor | None,
    alpha: float,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    o, final, _ = _attention_and_split(
        q, k, v, decay, alpha, scale, initial_state, output_final_state, cu_seqlens
    )
    return o, final


# A split forward's config and the state entering each of its segments, which the
# backward's dq sweep reads instead of computing them again (``_backward_of``).
Split = tuple[KernelConfig, torch.Tensor]


def _attention_and_split(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor | None,
    alpha: float,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, Split | None]:
    """The op's implementation, and the forward's ``Split`` where it ran split."""
    problem = _problem(q, k, v)
    decay = _decay_tensor(decay, alpha, problem.heads, q.device)
    sequences = problem.batch
    if cu_seqlens is not None:
        cu_seqlens = _check_offsets(cu_seqlens, problem, q.device)
        sequences = cu_seqlens.numel() - 1
    _check_state(initial_state, problem, sequences, q.device)
    return _forward(problem, q, k, v, decay, scale, initial_state, output_final_state, cu_seqlens)


_attention_op = torch.library.custom_op("decay_tuner::decay_attention", mutates_args=())(_attention)


def _forward(
    problem: Problem,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, Split | None]:
    """The kernel's call on checked inputs (``problem``, their shape; decay fp32 ``[H]``,
    offsets int32); the final state is an empty ``(0,)`` tensor unless
    ``output_final_state``; the ``Split`` where the kernel ran split."""
    sequences = problem.batch if cu_seqlens is None else cu_seqlens.numel() - 1
    call = Call(scale, initial_state is not None, output_final_state, cu_seqlens is not None)
    final = _empty_state(q, problem, sequences, output_final_state)
    kern = _kernel(problem, call, sequences)
    o, states = kern.run(  # checked above: no second check
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        decay,
        initial_state=None if initial_state is None else initial_state.contiguous(),
        final_state=final if output_final_state else None,
        cu_seqlens=cu_seqlens,
    )
    return o, final, (None if states is None else (kern.config, states))


@_attention_op.register_fake
def _(q, k, v, decay, alpha, scale, initial_state, output_final_state, cu_seqlens):
    b, s, h, dk = q.shape
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    final = q.new_empty((n, h, dk, v.shape[-1]) if output_final_state else (0,), dtype=torch.float32)
    return q.new_empty(b, s, h, v.shape[-1]), final


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    decay: torch.Tensor | None,
    alpha: float,
    scale: float,
    initial_state: torch.Tensor | None,
    dht: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dH0)`` by the kernel's sweeps (``kernel.backward``) on the inputs the
    forward checked; dH0 is an empty ``(0,)`` tensor where the forward took no state."""
    return _backward_of(q, k, v, do, decay, alpha, scale, initial_state, dht, cu_seqlens, None)


def _backward_of(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    decay: torch.Tensor | None,
    alpha: float,
    scale: float,
    initial_state: torch.Tensor | None,
    dht: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    split: Split | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_backward``, given the forward's ``Split`` where it ran split (an eager call
    keeps it): the dq sweep, the forward on (dO, V, K), has the forward's states
    transposed, so where it cuts the sequence into the same segments it reads them and
    runs its outputs kernel alone."""
    decay = _decay_tensor(decay, alpha, q.shape[2], q.device)
    cu = None if cu_seqlens is None else cu_seqlens.to(torch.int32)
    q, k, v, do = (x.contiguous() for x in (q, k, v, do))
    problem = _shape(q.shape, v.shape[-1], q.dtype)
    sequences = problem.batch if cu is None else cu.numel() - 1

    def sweep(q_, k_, v_, h0, want_final, offsets, reverse):
        p = _shape(q_.shape, v_.shape[-1], q_.dtype)
        call = Call(scale, h0 is not None, want_final, offsets is not None, reverse)
        final = _empty_state(q, p, sequences, True) if want_final else None
        kern, states = _kernel(p, call, sequences), None
        if split is not None and not reverse and same_segments(kern.config, split[0], p.seqlen):
            states = split[1].transpose(-1, -2).contiguous()  # the dq sweep's states
        return kern.run(q_, k_, v_, decay, h0, final, None, offsets, states)[0], final

    def fused(q_, k_, v_, do_, start, want_final, offsets):
        call = Call(scale, start is not None, want_final, offsets is not None, reverse=True, dkdv=True)
        final = _empty_state(q, problem, sequences, True) if want_final else None
        return *_kernel(problem, call, sequences).run_dkdv(
            q_, k_, v_, do_, decay, start, final, offsets
        ), final

    dq, dk, dv, dh0 = backward(
        sweep,
        q,
        k,
        v,
        do,
        decay,
        scale,
        initial_state=None if initial_state is None else initial_state.contiguous(),
        dht=dht,
        cu_seqlens=cu,
        want_dh0=initial_state is not None,
        fused=fused if _fuses(problem) else None,
    )
    return dq, dk, dv, (torch.empty(0, dtype=torch.float32, device=q.device) if dh0 is None else dh0)


_backward_op = torch.library.custom_op("decay_tuner::decay_attention_backward", mutates_args=())(_backward)


@_backward_op.register_fake
def _(q, k, v, do, decay, alpha, scale, initial_state, dht, cu_seqlens):
    dh0 = (
        torch.empty_like(initial_state) if initial_state is not None else q.new_empty(0, dtype=torch.float32)
    )
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dh0


def _setup_backward(ctx: Any, inputs: tuple, output: tuple, split: Split | None = None) -> None:
    q, k, v, decay, alpha, scale, initial_state, _, cu_seqlens = inputs
    config, states = (None, None) if split is None else split
    ctx.save_for_backward(q, k, v, decay, initial_state, cu_seqlens, states)
    ctx.alpha, ctx.scale, ctx.split_config = alpha, scale, config


def _gradients(ctx: Any, do: torch.Tensor | None, dfinal: torch.Tensor | None, backward=_backward) -> tuple:
    """The autograd rule of ``decay_attention``: gradients for q, k, v and the initial state;
    none for the decay (not learned) or the offsets. ``backward``: the backward's
    implementation, or (under ``torch.compile``) its op."""
    q, k, v, decay, initial_state, cu_seqlens, states = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do
    dht = dfinal if dfinal is not None and dfinal.numel() else None  # the (0,) stand-in: no state
    args = (q, k, v, do, decay, ctx.alpha, ctx.scale, initial_state, dht, cu_seqlens)
    if states is None:
        dq, dk, dv, dh0 = backward(*args)
    else:  # an eager call's split forward
        dq, dk, dv, dh0 = _backward_of(*args, (ctx.split_config, states))
    return dq, dk, dv, None, None, None, (dh0 if initial_state is not None else None), None, None


def _op_gradients(ctx: Any, do: torch.Tensor | None, dfinal: torch.Tensor | None) -> tuple:
    return _gradients(ctx, do, dfinal, torch.ops.decay_tuner.decay_attention_backward)


torch.library.register_autograd("decay_tuner::decay_attention", _op_gradients, setup_context=_setup_backward)


class _Eager(torch.autograd.Function):
    """The two implementations and the autograd rule of the ops, without torch's dispatch
    of them: what an eager call runs."""

    @staticmethod
    def forward(ctx: Any, *inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        o, final, split = _attention_and_split(*inputs)
        _setup_backward(ctx, inputs, (o, final), split)
        return o, final

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor | None, dfinal: torch.Tensor | None) -> tuple:
        return _gradients(ctx, do, dfinal)


def _empty_state(q: torch.Tensor, problem: Problem, sequences: int, wanted: bool) -> torch.Tensor:
    shape = (sequences, problem.heads, problem.dk, problem.dv) if wanted else (0,)
    return torch.empty(shape, dtype=torch.float32, device=q.device)


@functools.lru_cache(maxsize=256)
def _shape(q_shape: torch.Size, dv: int, dtype: torch.dtype) -> Problem:
    """The problem of checked tensors (q's shape, v's last dimension, their dtype)."""
    b, s, h, dk = q_shape
    return Problem(b, h, s, dk, dv, _DTYPE_NAMES[dtype])


def fuses(problem: Problem, arch: str) -> bool:
    """Whether the backward of ``problem`` runs dk and dv in one sweep (``kernel.dkdv``) on
    a GPU of ``arch``: wherever that sweep serves the problem. It splits the sequence
    itself where one block per (batch, head) would leave SMs idle
    (``kernel.dkdv.dkdv_config``), and beat the two sweeps on the H200 in one pass (0.250
    against 0.308 ms at 8x16x4096) and split (0.308 against 0.428 at 2x16x16384)
    (experiments/h200/fused_sweep/)."""
    return dkdv_config(problem, arch) is not None


@functools.lru_cache(maxsize=256)
def _fuses(problem: Problem) -> bool:
    """``fuses`` on this GPU."""
    return fuses(problem, cuda_arch())


def backward_configs(problem: Problem, call: Call, sequences: int) -> dict[str, KernelConfig]:
    """The configs the backward of ``call`` on ``problem`` runs, by sweep: ``dq``, then
    ``dk+dv`` where it fuses, else ``dk`` and ``dv`` (as ``kernel_job`` picks them)."""
    names = ("dq", "dk+dv") if _fuses(problem) else ("dq", "dk", "dv")
    return {name: job[1] for name, job in zip(names, _backward_jobs(problem, call, sequences))}


def _backward_jobs(problem: Problem, call: Call, sequences: int) -> list[tuple[Problem, KernelConfig, Call]]:
    """The ``kernel_job`` of each sweep the backward of ``call`` runs, in order."""
    sweeps = sweep_calls(problem, call, fused=_fuses(problem))
    return [kernel_job(p, c, sequences) for p, c in sweeps]


def _problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Problem:
    """The shape of the call, validated."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-d tensor [B, S, H, D], got {_describe(t)}")
        if t.device.type != "cuda":
            raise ValueError(f"{name} must be on a CUDA device, got {t.device}")
    if q.dtype not in _DTYPE_NAMES:
        raise ValueError(f"q must be float16 or bfloat16, got {q.dtype}")
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"k must be shaped as q {list(q.shape)} and v [B, S, H, DV]; got {list(k.shape)}, {list(v.shape)}"
        )
    if not (k.dtype == v.dtype == q.dtype) or not (k.device == v.device == q.device):
        got = ", ".join(f"{t.dtype} on {t.device}" for t in (q, k, v))
        raise ValueError(f"q, k, v must share dtype and device, got {got}")
    return _shape(q.shape, v.shape[-1], q.dtype)


def _decay_tensor(decay: torch.Tensor | None, alpha: float, heads: int, device: torch.device) -> torch.Tensor:
    """The fp32 ``[H]`` decay the kernels read, checked to lie in (0, 1]."""
    if decay is None:
        if not (math.isfinite(alpha) and 0.0 < alpha <= 1.0):
            raise ValueError(f"decay must be in (0, 1], got {alpha}")
        return constant_decay(alpha, heads, device)
    if decay.shape != (heads,):
        raise ValueError(
            f"decay must be a float or a tensor of {heads} alphas [H], got shape {list(decay.shape)}"
        )
    if not decay.is_floating_point():
        raise ValueError(f"decay must be a floating-point tensor, got {decay.dtype}")
    if decay.device != device:
        raise ValueError(f"decay is on {decay.device} but q is on {device}")
    alphas = decay.to(torch.float32).contiguous()
    # The values as the kernels read them, checked once per caller's tensor and version
    # (a decay of another dtype is cast anew on every call), never while a graph is captured.
    if not _checked_before(decay) and not torch.cuda.is_current_stream_capturing():
        bad = ~((alphas > 0) & (alphas <= 1))
        if bool(bad.any()):
            head = int(bad.nonzero()[0])
            raise ValueError(
                f"decay must lie in (0, 1] for every head, got {alphas[head].item()} at head {head}"
            )
        _remember(decay)
    return alphas


def _checked_before(tensor: torch.Tensor) -> bool:
    """Whether this tensor's values, unchanged since, passed their check (``_remember``)."""
    seen = _CHECKED.get(id(tensor))
    return seen is not None and seen[0]() is tensor and seen[1] == tensor._version


def _remember(tensor: torch.Tensor) -> None:
    key = id(tensor)
    _CHECKED[key] = (weakref.ref(tensor, lambda _: _CHECKED.pop(key, None)), tensor._version)


def _check_offsets(cu_seqlens: torch.Tensor, problem: Problem, device: torch.device) -> torch.Tensor:
    """The int32 offsets the packed kernel reads: ``[N + 1]``, 0 first, T last, strictly
    increasing (values checked as the decay's are, ``_checked_before``)."""
    if problem.batch != 1:
        raise ValueError(f"with cu_seqlens, q, k, v must be [1, T, H, D], got a batch of {problem.batch}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            "cu_seqlens must be an int32 or int64 tensor [N + 1], "
            f"got {cu_seqlens.dtype} {list(cu_seqlens.shape)}"
        )
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {device}")
    if not _checked_before(cu_seqlens) and not torch.cuda.is_current_stream_capturing():
        offsets = cu_seqlens.tolist()
        steps = [b - a for a, b in zip(offsets, offsets[1:])]
        if offsets[0] != 0 or offsets[-1] != problem.seqlen or min(steps) < 1:
            raise ValueError(
                f"cu_seqlens must rise strictly from 0 to T = {problem.seqlen}, got {_clip(offsets)}"
            )
        _remember(cu_seqlens)
    return cu_seqlens.to(torch.int32).contiguous()


def _clip(values: list[int]) -> str:
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:4]))}, ..., {values[-1]}]"


def _check_state(state: torch.Tensor | None, problem: Problem, sequences: int, device: torch.device) -> None:
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


def _kernel(problem: Problem, call: Call, sequences: int) -> ScalarDecayKernel:
    served = _SERVED.get((problem, call, sequences))
    if served is None:
        job = kernel_job(problem, call, sequences)
        if job not in _KERNELS:
            _KERNELS[job] = build(*job)
        if len(_SERVED) >= _SERVED_MAX:
            _SERVED.clear()
        served = _SERVED[problem, call, sequences] = _KERNELS[job]
    return served


def kernel_job(problem: Problem, call: Call, sequences: int) -> tuple[Problem, KernelConfig, Call]:
    """What ``decay_attention`` compiles for a call: the table's config for its shape.
    Packed sequences run the single-pass kernel with the config picked for ``sequences``
    sequences of the mean length (``kernel.variants.packed_config``); a compiled kernel
    serves every T and N, so packed calls compile at most once per config the table holds."""
    p = problem
    if call.dkdv:  # the table's dk+dv entry, else dkdv_config's rule; packed sequences run one pass
        config = dkdv_config(p, cuda_arch(), None if call.packed else sm_count())
        if config is None:
            raise ValueError(f"the fused dk and dv sweep does not serve {p} on {cuda_arch()}")
        tuned = None if _TABLE[0] is None else _TABLE[0].fused(p)
        if tuned is not None:
            config = dataclasses.replace(tuned, segments=1) if call.packed else tuned
    elif call.packed:
        mean = Problem(sequences, p.heads, max(1, p.seqlen // sequences), p.dk, p.dv, p.dtype)
        config = config_for(mean, _TABLE[0], sm_count())
    else:
        config = config_for(p, _TABLE[0], sm_count())
    if call.packed:
        return dataclasses.replace(p, seqlen=1), packed_config(config, cuda_arch()), call
    return p, config, call


def training_jobs(problem: Problem, call: Call, sequences: int) -> set[tuple[Problem, KernelConfig, Call]]:
    """What a differentiable call compiles: its forward's ``kernel_job`` and its backward's
    sweeps' (``kernel.backward.sweep_calls``), to compile ahead in parallel
    (``kernel.builder.precompile``)."""
    return {kernel_job(problem, call, sequences), *_backward_jobs(problem, call, sequences)}


def config_for(problem: Problem, table: Dispatch | None, sms: int) -> KernelConfig:
    """The table's pick for ``problem``; where there is no table, or it holds no entry of
    the problem's DK, DV and dtype, the default config (``default_config``), with a
    warning naming the command that tunes it."""
    if table is not None:
        try:
            return table.pick(problem).config
        except ExportError as exc:
            p = problem
            warnings.warn(
                f"{exc}; serving the default config. Tune it: python -m tuner dispatch "
                f"--dk {p.dk} --dv {p.dv} --dtype {p.dtype}",
                stacklevel=3,
            )
    return default_config(problem, sms)


def _describe(x: Any) -> str:
    return f"shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
