"""Issue 53, item 4: fla's ``SimpleGatedLinearAttention`` layer with our op in place of
``chunk_simple_gla``, forward and backward.

The layer, randomly initialised, in bf16 and fp16, once with fla's kernel and once with
ours (``decay_attention(q, k, v, g=g)``), each judged against the same layer run in fp32
with fla's kernel (as experiments/model/retnet.py judges the RetNet layer), dense and over
packed sequences (``cu_seqlens``, lengths 1 to 3000): the relative L2 of the outputs, and of
the gradients of the loss ``sum(out * dout)`` for the input (``dx``) and for all the
layer's weights at once (``dweights``).

    python3 experiments/gated/layer.py --out DIR

Needs flash-linear-attention on the device. Writes DIR/gated_layer.json and prints it.
"""

import argparse
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

import refs
from kernel.ops import decay_attention


def ours(
    q,
    k,
    v,
    g=None,
    g_gamma=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    **_,
):
    """``chunk_simple_gla``'s signature, served by ``decay_attention`` (``decay = exp(g_gamma)``)."""
    decay = None if g_gamma is None else torch.exp(g_gamma.float())
    if g is None and decay is None:
        decay = 1.0
    return decay_attention(
        q, k, v, decay, g=None if g is None else g.float(), scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
    )  # fmt: skip


@contextlib.contextmanager
def swapped() -> Iterator[None]:
    """fla's layer calls ours where it calls ``chunk_simple_gla``."""
    import fla.layers.simple_gla as layer_module

    original = layer_module.chunk_simple_gla
    layer_module.chunk_simple_gla = ours
    try:
        yield
    finally:
        layer_module.chunk_simple_gla = original


def check(dtype: torch.dtype, lengths: list[int] | None) -> dict:
    from fla.layers.simple_gla import SimpleGatedLinearAttention  # not exported by fla.layers in 0.6.0

    torch.manual_seed(0)
    layer = SimpleGatedLinearAttention(hidden_size=1024, num_heads=8, mode="chunk").cuda()
    tokens = 2048 if lengths is None else sum(lengths)
    x = torch.randn(1 if lengths else 4, tokens, 1024, device="cuda")
    dout = torch.randn_like(x)
    kw = {}
    if lengths is not None:
        offsets = torch.tensor([0, *lengths], device="cuda").cumsum(0)
        kw["cu_seqlens"] = offsets.to(torch.int32)

    def run(model: torch.nn.Module, dt: torch.dtype) -> dict[str, torch.Tensor]:
        """The output and the gradients of ``sum(out * dout)``, as fp32."""
        model.zero_grad(set_to_none=True)
        xs = x.to(dt).requires_grad_()
        out = model(xs, **kw)[0]
        (out.float() * dout).sum().backward()
        weights = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        return {"out": out.detach().float(), "dx": xs.grad.float(), "dweights": weights}

    want = run(layer, torch.float32)  # fla's kernel in fp32
    low = layer.to(dtype)
    theirs = run(low, dtype)
    with swapped():
        mine = run(low, dtype)
    row: dict = {"dtype": str(dtype), "lengths": lengths}
    for name in want:
        row[f"fla_{name}_rel_l2_vs_fp32"] = refs.rel_l2(theirs[name], want[name])
        row[f"ours_{name}_rel_l2_vs_fp32"] = refs.rel_l2(mine[name], want[name])
    row["finite"] = all(bool(torch.isfinite(t).all()) for t in mine.values())
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = [
        check(dtype, lengths)
        for dtype in (torch.bfloat16, torch.float16)
        for lengths in (None, [1, 700, 65, 3000, 64, 129])
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gated_layer.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    worst = max(
        r[f"ours_{name}_rel_l2_vs_fp32"] / max(r[f"fla_{name}_rel_l2_vs_fp32"], 1e-6)
        for r in result
        for name in ("out", "dx", "dweights")
    )
    return 0 if all(r["finite"] for r in result) and worst < 2.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
