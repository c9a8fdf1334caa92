"""Issue 18: train a small RetNet from fla with fla's kernels and with ours, same seed.

fla's ``MultiScaleRetention`` calls ``chunk_retention`` in training; swapping it for
``decay_attention`` (``experiments/model/retnet.py``, RetNet's decays) runs our forward
and our backward (``kernel.backward``, three sweeps of the forward kernel) in every layer.

1. The gradients of one step, every parameter (relative L2): ours against fla's, both
   under bf16 autocast, and each against fla's in fp32; with ``--layers``, each layer's
   attention gradients from both kernels against the fp64 reference (``--check-only``:
   this alone).
2. ``--steps`` steps of AdamW from the same initial weights on the same synthetic batches
   (tokens of a fixed random Markov chain, so the loss has somewhere to go: its entropy
   rate is printed), fp32 weights under bf16 autocast: the loss per step for both, and the
   step time (CUDA events, median over the steps after ``--warmup``).

    python3 experiments/backward/train_retnet.py --out DIR [--steps 200]

Writes DIR/train_retnet.json and prints a summary. Needs flash-linear-attention and
transformers (experiments/README.md).
"""

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from retnet import ours, retnet_decays, swapped  # noqa: E402  (the swap of issue 16)

import refs  # noqa: E402

VOCAB, HIDDEN, LAYERS, HEADS = 1000, 512, 4, 4  # DK = 128, DV = 256 per head


def log(message: str, _start: float = time.perf_counter()) -> None:
    """Progress on stderr, with the seconds since the script started."""
    print(f"[{time.perf_counter() - _start:6.1f} s] {message}", file=sys.stderr, flush=True)


def markov_batches(steps: int, batch: int, seqlen: int, seed: int = 0) -> tuple[list[torch.Tensor], float]:
    """``steps`` batches of tokens from one random first-order Markov chain (each token
    picks among 8 likely successors), sampled on the GPU, and the chain's entropy rate in
    nats: the loss a perfect model reaches."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(VOCAB, VOCAB, generator=gen, device="cuda") * 0.5
    logits.scatter_(1, torch.randint(0, VOCAB, (VOCAB, 8), generator=gen, device="cuda"), 8.0)
    probs = logits.softmax(-1)
    entropy = float(-(probs * probs.log()).sum(-1).mean())
    tokens = torch.empty(steps * batch, seqlen, dtype=torch.long, device="cuda")
    tokens[:, 0] = torch.randint(0, VOCAB, (steps * batch,), generator=gen, device="cuda")
    for t in range(1, seqlen):
        tokens[:, t] = torch.multinomial(probs[tokens[:, t - 1]], 1, generator=gen)[:, 0]
    return list(tokens.split(batch)), entropy


def precompile_layers(batch: int, seqlen: int) -> None:
    """Compile, in parallel processes, the forward and the backward's sweeps that the
    layers call (fla's layer passes no scale: ours defaults to DK^-1/2), so that the first
    step does not compile them one by one."""
    from kernel.attention import training_jobs
    from kernel.builder import cuda_arch, precompile
    from kernel.config import Call, Problem

    dk = HIDDEN // HEADS
    problem = Problem(batch, HEADS, seqlen, dk, 2 * dk, "bfloat16")
    jobs = training_jobs(problem, Call(dk**-0.5), batch) | training_jobs(
        problem, Call(dk**-0.5, final_state=True), batch
    )
    precompile(sorted(jobs, key=str), arch=cuda_arch())


def model(seed: int):
    from fla.models import RetNetConfig, RetNetForCausalLM

    torch.manual_seed(seed)
    config = RetNetConfig(
        hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_heads=HEADS, vocab_size=VOCAB, use_cache=False
    )
    return RetNetForCausalLM(config).cuda()


def loss_of(net, tokens: torch.Tensor, autocast: bool = True) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        return net(input_ids=tokens, labels=tokens).loss


def recording(impl, calls: list[dict]):
    """Serve the layers' ``chunk_retention`` with ``impl``, recording each call's q, k, v,
    the gradient its output receives and the gradients it hands back."""

    def recorded(q, k, v, **kwargs):
        call = {"q": q.detach(), "k": k.detach(), "v": v.detach()}
        for name, t in (("dq", q), ("dk", k), ("dv", v)):
            t.register_hook(lambda g, name=name: call.__setitem__(name, g.detach()))
        o, state = impl(q, k, v, **kwargs)
        o.register_hook(lambda g: call.__setitem__("do", g.detach()))
        calls.append(call)
        return o, state

    return swapped(recorded)


def gradient_check(tokens: torch.Tensor, layers: bool) -> dict:
    """One step's gradients, every parameter (relative L2): fla's kernels and ours under
    bf16 autocast against each other and against fla's kernels in fp32 (no autocast), so
    that the gap between the two bf16 runs stands beside each one's gap from fp32. With
    ``layers``, also each layer's dq, dk, dv from each bf16 run against the fp64 reference
    (``refs.chunked_backward``) on the q, k, v and output gradient that layer met in that
    run: the kernels' own error, apart from how the runs' roundings spread through the
    model (the check with it took 348 s on the H200, gradients_layers.log)."""
    import fla.layers.multiscale_retention as msr

    grads, kernels = {}, {}
    runs = (
        ("fla", msr.chunk_retention, True),
        ("ours", ours, True),
        ("fla fp32", msr.chunk_retention, False),
    )
    for name, impl, autocast in runs:
        calls: list[dict] = []
        net = model(seed=0)
        with recording(impl, calls):
            loss_of(net, tokens, autocast).backward()
        grads[name] = {n: p.grad.float() for n, p in net.named_parameters() if p.grad is not None}
        if not (layers and autocast):
            continue
        kernels[name] = []
        for c in calls:
            decay = retnet_decays(c["q"].shape[2], c["q"].device)
            want = refs.chunked_backward(
                c["q"], c["k"], c["v"], decay, 64, c["do"], scale=c["q"].shape[-1] ** -0.5
            )
            kernels[name].append({g: refs.rel_l2(c[g], w) for g, w in zip(("dq", "dk", "dv"), want)})
    result = {}
    for a, b in (("ours", "fla"), ("fla", "fla fp32"), ("ours", "fla fp32")):
        errors = {n: refs.rel_l2(grads[a][n], g) for n, g in grads[b].items()}
        result[f"{a} vs {b}"] = {
            "max_rel_l2": max(errors.values()),
            "median_rel_l2": statistics.median(errors.values()),
            "rel_l2": errors,
        }
    return {"parameters": len(grads["fla"]), **result, "layers_vs_fp64": kernels}


def train(batches: list[torch.Tensor], with_ours: bool, warmup: int) -> dict:
    net = model(seed=0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    losses, times = [], []
    with swapped() if with_ours else contextlib.nullcontext():
        for i, tokens in enumerate(batches):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = loss_of(net, tokens)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            end.record()
            torch.cuda.synchronize()
            losses.append(loss.item())
            times.append(start.elapsed_time(end))
            if i % 50 == 0:
                log(f"{'ours' if with_ours else 'fla'} step {i}: loss {losses[-1]:.4f}, {times[-1]:.1f} ms")
    return {"loss": losses, "step_ms": times, "median_step_ms": statistics.median(times[warmup:])}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--check-only", action="store_true", help="the gradient check alone, no training")
    parser.add_argument("--layers", action="store_true", help="also each layer's gradients against fp64")
    args = parser.parse_args()
    batches, entropy = markov_batches(args.steps, args.batch, args.seqlen)
    log("tokens sampled; compiling our kernels")
    precompile_layers(args.batch, args.seqlen)
    log("compiled; one step's gradients, fla's and ours")
    result = {
        "shape": {
            "batch": args.batch,
            "seqlen": args.seqlen,
            "hidden": HIDDEN,
            "layers": LAYERS,
            "heads": HEADS,
        },
        "entropy_rate": entropy,
        "initial_loss_uniform": math.log(VOCAB),
        "gradients": gradient_check(batches[0], layers=args.layers),
    }
    summary = {
        k: {m: v[m] for m in ("max_rel_l2", "median_rel_l2")}
        for k, v in result["gradients"].items()
        if " vs " in k
    }
    log(f"gradients: {json.dumps(summary | {'layers_vs_fp64': result['gradients']['layers_vs_fp64']})}")
    if args.check_only:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gradients.json").write_text(json.dumps(result, indent=1))
        return 0
    runs = {"fla": train(batches, False, args.warmup), "ours": train(batches, True, args.warmup)}
    result |= runs
    gaps = [abs(a - b) for a, b in zip(runs["fla"]["loss"], runs["ours"]["loss"])]
    result["summary"] = {
        "max_loss_gap": max(gaps),
        "last10_loss": {n: statistics.mean(r["loss"][-10:]) for n, r in runs.items()},
        "median_step_ms": {n: r["median_step_ms"] for n, r in runs.items()},
        "fla_over_ours": runs["fla"]["median_step_ms"] / runs["ours"]["median_step_ms"],
        "grad_rel_l2": summary,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_retnet.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"] | {"entropy_rate": entropy}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
