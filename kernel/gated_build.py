"""Compile ``kernel.gated``'s forward for the local GPU and call it on torch tensors.

The checks a model's call needs before the launch (``check_call``) raise one ``ValueError``
each: a gate of the wrong shape, dtype or device, H not a multiple of G.
TileLang loads with the first compile (``compile_gated``), so ``import kernel.ops`` loads no
compiler.
"""

import functools
from dataclasses import dataclass

import torch

from kernel.arch import get_arch, local_arch
from kernel.probe import compile_funcs

TORCH_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class GatedConfig:
    """The knobs of the gated forward (as ``kernel.config.KernelConfig``'s single pass)."""

    chunk: int = 64
    block_dv: int = 64
    num_stages: int = 1
    threads: int = 128


def gated_config(*, dk: int, dv: int) -> GatedConfig:
    """The config a model's call runs where none is tuned (no table holds gated configs yet):
    value blocks of 64 columns where DV allows, else the widest multiple of 16 dividing DV
    up to 64; 256 threads past DK = 128, whose ``[DK, 64]`` fp32 state would not fit 128
    threads' registers. Not tuned: the first configs to compile without spills
    (``experiments/gated/probe.txt``)."""
    block_dv = max(d for d in range(16, min(dv, 64) + 1, 16) if dv % d == 0)
    return GatedConfig(chunk=64, block_dv=block_dv, num_stages=1, threads=128 if dk <= 128 else 256)


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


@functools.cache
def compile_gated(
    *, heads: int, groups: int, dk: int, dv: int, dtype: str, config: GatedConfig, scale: float,
    gamma: bool, initial_state: bool, final_state: bool, arch: str, packed: bool = False,
    batch: int | None = None, seqlen: int | None = None,
):  # fmt: skip
    """The compiled kernel of ``kernel.gated.gated_fwd`` (``packed``: ``packed_gated_fwd``)
    for these knobs (once per process; TileLang's disk cache across processes). ``batch``
    and ``seqlen``: the dense shape where ``arch`` compiles per shape, else None."""
    from kernel.gated import gated_fwd, packed_gated_fwd  # TileLang: loaded when a kernel is built

    shape = {} if packed else dict(batch=batch, seqlen=seqlen)
    func = (packed_gated_fwd if packed else gated_fwd)(
        **shape,
        heads=heads, groups=groups, dk=dk, dv=dv, dtype=dtype, chunk=config.chunk, block_dv=config.block_dv,
        num_stages=config.num_stages, threads=config.threads, arch=arch, scale=scale, gamma=gamma,
        initial_state=initial_state, final_state=final_state,
    )  # fmt: skip
    (kernel,) = compile_funcs([func], arch)
    return kernel


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
    config: GatedConfig = GatedConfig(),
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
        out: the output tensor to write (a NaN-filled one in the tests), else a new one.

    Returns:
        o ``[B, S, H, DV]`` and, with output_final_state, the fp32 state ``[B, H, DK, DV]``
        (packed: ``[N, H, DK, DV]``).
    """
    check_call(q, k, v, g, g_gamma, cu_seqlens)
    b, s, groups, dk = q.shape
    heads, dv = v.shape[2], v.shape[3]
    n = b if cu_seqlens is None else cu_seqlens.numel() - 1
    arch = local_arch()
    per_shape = cu_seqlens is None and not get_arch(arch).symbolic_shapes
    kernel = compile_gated(
        heads=heads, groups=groups, dk=dk, dv=dv, dtype=TORCH_DTYPES[q.dtype], config=config,
        scale=dk**-0.5 if scale is None else float(scale), gamma=g_gamma is not None,
        initial_state=initial_state is not None, final_state=output_final_state, arch=arch,
        packed=cu_seqlens is not None, batch=b if per_shape else None, seqlen=s if per_shape else None,
    )  # fmt: skip
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
