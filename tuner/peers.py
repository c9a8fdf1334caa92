"""Other implementations of the same forward pass, timed beside the kernel by ``tuner bench``,
in the model form: one decay per head, the query scale, the final state returned.

- ``fla_simple_gla``: flash-linear-attention's Triton ``chunk_simple_gla`` with the per-head
  log-decay ``g_gamma``; an optional extra (``pip install fla-core``), never a dependency
  of the kernel.
- ``torch_chunked``: plain torch, chunked, in the input dtype with an fp32 state.
"""

import torch


def fla_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_gamma: torch.Tensor | None,
    *,
    scale: float,
    g: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    output_final_state: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_simple_gla(q, k, v, g=g, g_gamma=g_gamma, scale=scale, output_final_state=...)``.

    q, k: ``[B, S, H, DK]``; v: ``[B, S, H, DV]``; g_gamma: fp32 ``[H]``, ``log(alpha_h)``,
    or None; g: fp32 ``[B, S, H]``, a per-token log-gate (``bench --gate token``), or None.
    Packed: ``[1, T, H, D]`` with ``cu_seqlens`` (int64 ``[N + 1]`` on the GPU, and its CPU
    copy ``cu_seqlens_cpu``, which spares fla a device sync). Returns ``o`` ``[B, S, H, DV]``
    and the fp32 final state ``[N, H, DK, DV]`` (None without ``output_final_state``).
    Raises ``ImportError`` when fla is not installed.
    """
    from fla.ops.simple_gla import chunk_simple_gla

    packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens, "cu_seqlens_cpu": cu_seqlens_cpu}
    return chunk_simple_gla(
        q, k, v, g=g, g_gamma=g_gamma, scale=scale, output_final_state=output_final_state, **packed
    )


def torch_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, *, scale: float, chunk: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """The seed's chunked form in plain torch: operands in the input dtype, state in fp32.

    Shapes as ``fla_simple_gla`` (no packing); decay: ``[H]``, one alpha per head in (0, 1].
    S must be a multiple of ``chunk``. Returns ``o`` and the fp32 final state ``[B, H, DK, DV]``.
    """
    b, s, h, dk = q.shape
    if s % chunk:
        raise ValueError(f"seqlen must be a multiple of chunk={chunk}, got {s}")
    dt = q.dtype
    qc, kc, vc = (x.transpose(1, 2).reshape(b, h, s // chunk, chunk, -1) for x in (q, k, v))
    i = torch.arange(chunk, device=q.device, dtype=torch.float32)
    lg = decay.to(device=q.device, dtype=torch.float32).log()[:, None]  # [H, 1]
    dist = (i[:, None] - i[None, :]).clamp(min=0)  # [C, C]
    gamma = torch.where(i[:, None] >= i[None, :], torch.exp(lg[..., None] * dist), 0.0)  # [H, C, C]
    w_query = (scale * torch.exp(lg * (i + 1))).to(dt)[:, :, None]  # [H, C, 1]
    w_decay = torch.exp(lg * (chunk - 1 - i)).to(dt)[:, None, :, None]  # [H, 1, C, 1]
    scores = ((qc @ kc.transpose(-1, -2)).float() * (scale * gamma[:, None])).to(dt)  # [B, H, N, C, C]
    out = scores @ vc  # intra-chunk
    contrib = ((kc * w_decay).transpose(-1, -2) @ vc).float()  # [B, H, N, DK, DV]
    state = torch.zeros_like(contrib[:, :, 0])
    carry = torch.exp(lg * chunk)[:, :, None]  # [H, 1, 1]: alpha_h^C
    for c in range(s // chunk):
        out[:, :, c] += (qc[:, :, c] * w_query) @ state.to(dt)
        state = carry * state + contrib[:, :, c]
    return out.reshape(b, h, s, -1).transpose(1, 2).contiguous(), state
