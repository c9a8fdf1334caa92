"""Issue 53, item 4: fla's ``SimpleGatedLinearAttention`` layer with our op in place of
``chunk_simple_gla``, forward only (the gated backward is not built yet).

The layer, randomly initialised, in bf16 and fp16, once with fla's kernel and once with
ours (``decay_attention(q, k, v, g=g)``), each judged against the same layer run in fp32
with fla's kernel (as experiments/model/retnet.py judges the RetNet layer): the relative L2
of the outputs, dense and over packed sequences (``cu_seqlens``, lengths 1 to 3000). No
gradients: a call that requires grad is refused by the op.

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
    from fla.layers import SimpleGatedLinearAttention

    torch.manual_seed(0)
    layer = SimpleGatedLinearAttention(hidden_size=1024, num_heads=8, mode="chunk").cuda().eval()
    tokens = 2048 if lengths is None else sum(lengths)
    x = torch.randn(1 if lengths else 4, tokens, 1024, device="cuda")
    kw = {}
    if lengths is not None:
        offsets = torch.tensor([0, *lengths], device="cuda").cumsum(0)
        kw["cu_seqlens"] = offsets.to(torch.int32)
    with torch.no_grad():
        want = layer(x, **kw)[0]  # fp32, fla's kernel
        low = layer.to(dtype)
        theirs = low(x.to(dtype), **kw)[0]
        with swapped():
            mine = low(x.to(dtype), **kw)[0]
    return {
        "dtype": str(dtype),
        "lengths": lengths,
        "fla_rel_l2_vs_fp32": refs.rel_l2(theirs, want),
        "ours_rel_l2_vs_fp32": refs.rel_l2(mine, want),
        "ours_vs_fla": refs.rel_l2(mine, theirs),
        "finite": bool(torch.isfinite(mine).all()),
    }


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
    worst = max(r["ours_rel_l2_vs_fp32"] / max(r["fla_rel_l2_vs_fp32"], 1e-6) for r in result)
    return 0 if all(r["finite"] for r in result) and worst < 2.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
