"""Issue 16: the kernel inside fla's RetNet, on the GPU.

fla's ``MultiScaleRetention`` layer calls ``chunk_retention`` for prompts longer than 64
tokens (and without autograd) and ``fused_recurrent_retention`` for decoding. Swapping
``chunk_retention`` for ``decay_attention`` with RetNet's decays (the ones
``chunk_retention`` uses: gamma_h = 1 - 2^(-5-h)) puts our kernel in the prefill, handing
its state to fla's decoding.

1. The layer, randomly initialised, once with fla's kernel and once with ours, in fp16 and
   bf16: relative L2 of the outputs, and the layer's forward time for both (alternating
   CUDA-event medians, L2 flushed: ``kernel.timing.alternating``); and the layer over
   packed sequences (``cu_seqlens``, lengths 1 to 3000).
2. A small RetNet (``RetNetForCausalLM``, random weights), greedy generation of 64 tokens
   after a 512-token prompt, with fla's kernels and with ours in the prefill: the tokens.

    python3 experiments/model/retnet.py --out DIR [--layer-only]

Needs flash-linear-attention and transformers on the device (wheels, see
experiments/README.md). Writes DIR/retnet.json and prints it.
"""

import argparse
import contextlib
import functools
import json
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch

import refs
from kernel.attention import decay_attention
from kernel.timing import alternating


@functools.cache
def retnet_decays(heads: int, device: torch.device) -> torch.Tensor:
    """Made once, as a model holds its decays in a buffer."""
    return 1 - 2.0 ** (-5.0 - torch.arange(heads, dtype=torch.float32, device=device))


def ours(q, k, v, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    """``chunk_retention``'s signature, served by ``decay_attention``."""
    decays = retnet_decays(q.shape[2], q.device)
    return decay_attention(
        q,
        k,
        v,
        decays,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )


@contextlib.contextmanager
def swapped(impl=ours) -> Iterator[None]:
    """fla's layers call ``impl`` (default: ours) where they call ``chunk_retention``."""
    import fla.layers.multiscale_retention as msr

    original = msr.chunk_retention
    msr.chunk_retention = impl
    try:
        yield
    finally:
        msr.chunk_retention = original


def layer_check(dtype: torch.dtype) -> dict:
    from fla.layers import MultiScaleRetention

    torch.manual_seed(0)
    layer = MultiScaleRetention(hidden_size=1024, num_heads=8, mode="chunk").cuda().to(dtype).eval()
    x = torch.randn(4, 2048, 1024, device="cuda", dtype=dtype)
    with torch.no_grad():
        fla_out = layer(x)[0]
        with swapped():
            our_out = layer(x)[0]

        def forward(with_ours: bool) -> torch.Tensor:
            with swapped() if with_ours else contextlib.nullcontext():
                return layer(x)[0]

        times = alternating({"fla": partial(forward, False), "ours": partial(forward, True)}, rounds=3)
    med = {name: sorted(t)[1] for name, t in times.items()}
    return {
        "dtype": str(dtype),
        "rel_l2": refs.rel_l2(our_out, fla_out),
        "finite": bool(torch.isfinite(our_out).all()),
        "all_ms": times,
        "median_ms": med,
        "fla_over_ours": med["fla"] / med["ours"],
    }


def packed_check(dtype: torch.dtype) -> dict:
    from fla.layers import MultiScaleRetention

    torch.manual_seed(1)
    layer = MultiScaleRetention(hidden_size=1024, num_heads=8, mode="chunk").cuda().to(dtype).eval()
    lengths = [1, 700, 65, 3000, 64, 129]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    x = torch.randn(1, sum(lengths), 1024, device="cuda", dtype=dtype)
    with torch.no_grad():
        fla_out = layer(x, cu_seqlens=cu)[0]
        with swapped():
            our_out = layer(x, cu_seqlens=cu)[0]
    return {"dtype": str(dtype), "lengths": lengths, "rel_l2": refs.rel_l2(our_out, fla_out)}


def generation_check() -> dict:
    from fla.models import RetNetConfig, RetNetForCausalLM

    torch.manual_seed(0)
    config = RetNetConfig(hidden_size=512, num_hidden_layers=4, num_heads=4, vocab_size=1000)
    model = RetNetForCausalLM(config).cuda().half().eval()
    prompt = torch.randint(0, config.vocab_size, (1, 512), device="cuda")
    with torch.no_grad():
        fla_tokens = model.generate(prompt, max_new_tokens=64, do_sample=False)
        with swapped():
            our_tokens = model.generate(prompt, max_new_tokens=64, do_sample=False)
    new = slice(prompt.shape[1], None)
    differ = (fla_tokens != our_tokens).nonzero()
    return {
        "new_tokens": int(our_tokens[:, new].numel()),
        "same_tokens": bool(torch.equal(fla_tokens, our_tokens)),
        "first_difference": int(differ[0, 1]) if len(differ) else None,
        "fla": fla_tokens[0, new].tolist(),
        "ours": our_tokens[0, new].tolist(),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layer-only", action="store_true", help="time the layer; skip the rest")
    args = parser.parse_args()
    result = {"layer": [layer_check(d) for d in (torch.float16, torch.bfloat16)]}
    if not args.layer_only:
        result["packed_layer"] = [packed_check(d) for d in (torch.float16, torch.bfloat16)]
        result["generate"] = generation_check()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / ("retnet_layer.json" if args.layer_only else "retnet.json")).write_text(
        json.dumps(result, indent=1)
    )
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
