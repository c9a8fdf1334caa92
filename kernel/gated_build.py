"""Compile ``kernel.gated``'s forward for the local GPU and call it on torch tensors.

The checks a model's call needs before the launch (``check_call``) raise one ``ValueError``
each: a gate of the wrong shape, dtype or device, H not a multiple of G. A kernel is keyed
as the constant-decay ones are: a per-token gate's ``Problem`` (``gate="token"``, its
groups), a ``KernelConfig`` of its knob table (``kernel.constraints.knobs``) and a ``Call``;
``kernel.variants.prim_funcs`` hands such a problem to ``prim_func``, so that the probe,
``tuner run --gate token`` and ``tuner warmup --gate token`` compile what a call runs.
TileLang loads with the first compile (``compile_gated``), so ``import kernel.ops`` loads no
compiler; a kernel an earlier process compiled is opened without it (``kernel.loader``).
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from kernel.arch import local_arch
from kernel.config import Call, KernelConfig, Problem
from kernel.rule import gated_config

TORCH_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def check_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    g_gamma: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None = None,
) -> int:
    """r = H // G for q, k ``[B, S, G, DK]``, v ``[B, S, H, DV]`` (fp16 or bf16, contiguous,
    one CUDA device), g fp32 ``[B, S, H]`` and g_gamma fp32 ``[H]`` (either may be None),
    and where ``cu_seqlens`` packs sequences, B = 1 and ``cu_seqlens`` an int32 or int64
    ``[N + 1]`` tensor on q's device; one ``ValueError`` per mistake, naming the expected
    and the actual value."""
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"q, k, v: expected [B, S, G, DK] twice and [B, S, H, DV], got {q.shape}, {k.shape}, {v.shape}"
        )
    b, s, groups, _ = q.shape
    heads = v.shape[2]
    if heads % groups:
        raise ValueError(f"v: expected heads H a multiple of q and k's G = {groups}, got H = {heads}")
    if q.dtype not in TORCH_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"q, k, v: expected one dtype of float16, bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    for name, x, shape in (("g", g, (b, s, heads)), ("g_gamma", g_gamma, (heads,))):
        if x is None:
            continue
        if tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(x.shape)}")
        if x.dtype != torch.float32:
            raise ValueError(f"{name}: expected dtype torch.float32, got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (as q), got {x.device}")
    if cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"q, k, v: expected a batch of 1 with cu_seqlens, got {b}")
        if (
            cu_seqlens.dim() != 1
            or cu_seqlens.numel() < 2
            or cu_seqlens.dtype not in (torch.int32, torch.int64)
        ):
            raise ValueError(
                "cu_seqlens: expected int32 or int64 [N + 1], "
                f"got {cu_seqlens.dtype} {list(cu_seqlens.shape)}"
            )
        if cu_seqlens.device != q.device:
            raise ValueError(f"cu_seqlens: expected device {q.device} (as q), got {cu_seqlens.device}")
    return heads // groups


@dataclasses.dataclass(frozen=True)
class PassCall(Call):
    """A call of one of the gated backward's kernel passes
    (``kernel.ops.gated_backward.backward_by_passes``): O written in ``out_dtype``, float32
    for dq's and dk's, of which the gate's gradient takes its terms, None (the inputs'
    dtype) for dv's. Its own key in ``kernel.loader``'s index."""

    out_dtype: str | None = "float32"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.out_dtype not in ("float32", None) or self.dkdv or self.slots is not None:
            raise ValueError(
                f"a gated backward pass writes float32 or its inputs' dtype, with no slots: {self}"
            )


def pass_job(problem: Problem, call: PassCall) -> tuple[Problem, KernelConfig, PassCall]:
    """What one pass of the gated backward on ``problem`` (the pass's own heads and head
    sizes) compiles: the rule's config (``kernel.rule.gated_config``); packed, one kernel
    for every T and N."""
    shape = dataclasses.replace(problem, batch=1, seqlen=1) if call.packed else problem
    return shape, gated_config(problem), call


def pass_jobs(problem: Problem, call: Call) -> list[tuple[Problem, KernelConfig, PassCall]]:
    """Every pass the gated backward of ``call`` on ``problem`` may run (``backward_by_passes``):
    dq's, on do, v and k (DK and DV swapped, H groups); dv's backwards in time on k, q and
    do; dk's on v, do and q; and where ``call`` returns the final state, the dv pass from
    its gradient and the pass on v alone from it. What ``tuner warmup --gate token
    --backward`` compiles."""
    swapped = dataclasses.replace(problem, dk=problem.dv, dv=problem.dk, groups=None)
    s, h0, packed = call.scale, call.initial_state, call.packed
    calls = [
        (swapped, PassCall(s, h0, False, packed)),
        (problem, PassCall(s, False, h0, packed, reverse=True, out_dtype=None)),
        (swapped, PassCall(s, False, False, packed, reverse=True)),
    ]
    if call.final_state:
        calls += [
            (problem, PassCall(s, True, h0, packed, reverse=True, out_dtype=None)),
            (swapped, PassCall(s, True, False, packed, reverse=True)),
        ]
    return [pass_job(p, c) for p, c in calls]


def compile_gated(problem: Problem, config: KernelConfig, call: Call, *, arch: str) -> Callable[..., Any]:
    """What launches the compiled kernel of ``prim_func`` for ``arch``, this GPU's
    (``kernel.loader.fast_functions``: TVM-FFI's entry function, without TileLang's adapter
    around it). Found once per process and shape class (``kernel.variants.shape_generic``):
    opened by ``kernel.loader``'s index, without TileLang, where an earlier process compiled it
    (``tuner warmup --gate token``, the tuner's probes, a first call), else compiled."""
    from kernel.variants import shape_generic

    return _compiled(shape_generic(problem, config, arch), config, call, arch)


@functools.cache
def _compiled(problem: Problem, config: KernelConfig, call: Call, arch: str) -> Callable[..., Any]:
    from kernel.builder import load_or_compile

    _, (launch,) = load_or_compile(problem, config, call, arch, arch, problem)
    return launch


def gated_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    *,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    config: KernelConfig | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(o, final_state)`` of the gated recurrence (``refs.gated_recurrent``) on the GPU.

    Args:
        q, k: ``[B, S, G, DK]``; v: ``[B, S, H, DV]`` (fp16 or bf16, contiguous).
        g: fp32 ``[B, S, H]`` log-gates (<= 0), or None; g_gamma: fp32 ``[H]``, or None.
        scale: multiplies q (default DK^-1/2); initial_state: fp32 ``[B, H, DK, DV]``.
        cu_seqlens: packed sequences, int32 or int64 ``[N + 1]`` offsets from 0 to T,
            strictly increasing (not checked here: ``kernel.ops.inputs`` checks a model's),
            with q, k ``[1, T, G, DK]``, v ``[1, T, H, DV]``, g ``[1, T, H]`` and the
            states ``[N, H, DK, DV]``.
        config: the knobs (default: the rule's, ``kernel.rule.gated_config``).
        out: the output tensor to write (a NaN-filled one in the tests), else a new one.

    Returns:
        o ``[B, S, H, DV]`` and, with output_final_state, the fp32 state ``[B, H, DK, DV]``
        (packed: ``[N, H, DK, DV]``).
    """
    check_call(q, k, v, g, g_gamma, cu_seqlens)
    b, s, groups, dk = q.shape
    heads, dv = v.shape[2], v.shape[3]
    n = b if cu_seqlens is None else cu_seqlens.numel() - 1
    problem = Problem(b, heads, s, dk, dv, TORCH_DTYPES[q.dtype], "token", groups)
    scale = dk**-0.5 if scale is None else float(scale)
    call = Call(scale, initial_state is not None, output_final_state, cu_seqlens is not None)
    config = gated_config(problem) if config is None else config
    kernel = compile_gated(problem, config, call, arch=local_arch())
    f32 = dict(dtype=torch.float32, device=q.device)
    gate = torch.zeros(b, s, heads, **f32) if g is None else g
    gamma = torch.zeros(heads, **f32) if g_gamma is None else g_gamma
    h0 = (
        torch.empty(n * heads, 1, dk, dv, **f32)
        if initial_state is None
        else initial_state.reshape(-1, 1, dk, dv)
    )
    ht = torch.empty(n * heads, 1, dk, dv, **f32)
    o = torch.empty_like(v) if out is None else out
    args = (q, k, v, gate.contiguous(), gamma.contiguous(), h0.contiguous(), o, ht)
    kernel(*args) if cu_seqlens is None else kernel(*args, cu_seqlens.to(torch.int32).contiguous())
    return o, (ht.view(n, heads, dk, dv) if output_final_state else None)
