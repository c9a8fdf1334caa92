"""Other implementations of the same forward pass, timed beside the kernel by ``tuner bench``.

- ``fla_simple_gla``: flash-linear-attention's Triton ``chunk_simple_gla`` with a per-head
  constant log-decay ``g_gamma``; an optional extra (``pip install fla-core``), never a
  dependency of the kernel.
- ``torch_chunked``: plain torch, chunked, in the input dtype with an fp32 state.
"""

import math

import torch


def fla_simple_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: float) -> torch.Tensor:
    """fla's ``chunk_simple_gla`` with ``g_gamma = ln(alpha)`` per head and no q scaling.

    q, k: ``[B, S, H, DK]``; v: ``[B, S, H, DV]``; returns ``[B, S, H, DV]``.
    Raises ``ImportError`` when fla is not installed.
    """
    from fla.ops.simple_gla import chunk_simple_gla

    g_gamma = torch.full((q.shape[2],), math.log(alpha), dtype=torch.float32, device=q.device)
    out, _ = chunk_simple_gla(q, k, v, g_gamma=g_gamma, scale=1.0)
    return out


def torch_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: float, chunk: int = 64
) -> torch.Tensor:
    """The seed's chunked form in plain torch: operands in the input dtype, state in fp32.

    Shapes as ``fla_simple_gla``; S must be a multiple of ``chunk``.
    """
    b, s, h, dk = q.shape
    if s % chunk:
        raise ValueError(f"seqlen must be a multiple of chunk={chunk}, got {s}")
    dt = q.dtype
    qc, kc, vc = (x.transpose(1, 2).reshape(b, h, s // chunk, chunk, -1) for x in (q, k, v))
    i = torch.arange(chunk, device=q.device, dtype=torch.float32)
    lg = math.log(alpha)
    gamma = torch.where(i[:, None] >= i[None, :], torch.exp(lg * (i[:, None] - i[None, :]).clamp(min=0)), 0.0)
    w_query = torch.exp(lg * (i + 1)).to(dt)[:, None]
    w_decay = torch.exp(lg * (chunk - 1 - i)).to(dt)[:, None]
    scores = ((qc @ kc.transpose(-1, -2)).float() * gamma).to(dt)  # [.., C, C]
    out = scores @ vc  # intra-chunk
    contrib = ((kc * w_decay).transpose(-1, -2) @ vc).float()  # [B, H, NC, DK, DV]
    state = torch.zeros_like(contrib[:, :, 0])
    decay = alpha**chunk
    for c in range(s // chunk):
        out[:, :, c] += (qc[:, :, c] * w_query) @ state.to(dt)
        state = decay * state + contrib[:, :, c]
    return out.reshape(b, h, s, -1).transpose(1, 2).contiguous()
