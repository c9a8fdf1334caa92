"""Why the bench's forward-plus-backward rows run slow and spread wide after its forward
section (``bench_long.py --gap``, fifth session: 0.91 ms against 0.56 ms after
``torch.cuda.empty_cache()``, fla's 2.10 against 1.67, while the backward alone held):

    python3 experiments/backward/gap_cause.py --out DIR [BxHxS]

Times ours and fla's forward plus backward (the bench's ``both``: RetNet's decays, scale,
fp16) under two allocator states, ``clean`` (after ``empty_cache``) and ``pooled`` (after
tensors of mixed sizes, 12 GB in all, were made and freed, so that the caching allocator
holds them, as after the bench's forward section), and three ways:

- ``events``: ``kernel.timing.bench`` as the bench times;
- ``sleep``: the same, with a 2 ms GPU sleep queued before each repetition's start event,
  so that the host has queued the whole call before the GPU reaches it: GPU time alone,
  whatever the host's launch cost;
- ``graph``: the call captured once in a CUDA graph and its replay timed (fixed addresses).

Also the host's cost of one call (``host_ms``: queuing 20 calls behind a 200 ms GPU sleep,
wall time over 20). One JSON line per measurement in DIR/gap_cause.jsonl."""

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

SLEEP_CYCLES = 4_000_000  # about 2 ms at the H200's 1.98 GHz


def main() -> int:
    import torch

    from kernel import attention
    from kernel.builder import constant_decay, cuda_arch, precompile
    from kernel.config import Call, Problem, model_call, retnet_decay
    from kernel.timing import L2_FLUSH_BYTES, bench
    from kernel.validate import random_qkv
    from tuner.peers import fla_simple_gla

    parser = argparse.ArgumentParser()
    parser.add_argument("shape", nargs="?", default="8x16x4096", help="BxHxS, DK = DV = 128, fp16")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    b, h, s = map(int, args.shape.split("x"))
    problem = Problem(b, h, s, 128, 128)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "gap_cause.jsonl"

    scale = model_call(problem).scale
    precompile(sorted(attention.training_jobs(problem, Call(scale), b), key=str), arch=cuda_arch())
    q, k, v = (x.requires_grad_() for x in random_qkv(problem, seed=2))
    do = torch.randn_like(v, dtype=torch.float32).to(v.dtype)
    decay = constant_decay(retnet_decay(h), h, q.device)
    g_gamma = decay.log()
    forwards = {
        "ours": lambda: attention.decay_attention(q, k, v, decay, scale=scale)[0],
        "fla": lambda: fla_simple_gla(q, k, v, g_gamma, scale=scale)[0],  # its final state too, as run
    }

    def both(forward: Callable) -> Callable:
        return lambda: torch.autograd.grad(forward(), (q, k, v), do)

    def sleep_bench(fn: Callable) -> dict:
        """bench's loop with the sleep between the flush and the start event."""
        flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(100)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(100)]
        for st, en in zip(starts, ends):
            flush.zero_()
            torch.cuda._sleep(SLEEP_CYCLES)
            st.record()
            fn()
            en.record()
        torch.cuda.synchronize()
        times = torch.tensor([st.elapsed_time(en) for st, en in zip(starts, ends)], dtype=torch.float64)
        qs = torch.quantile(times, torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64)).tolist()
        return {"median_ms": qs[0], "p20_ms": qs[1], "p80_ms": qs[2], "reps": 100}

    def graphed(fn: Callable) -> Callable:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph asks
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    def host_ms(fn: Callable) -> float:
        fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(100 * SLEEP_CYCLES)  # the GPU stays busy while the host queues
        start = time.perf_counter()
        for _ in range(20):
            fn()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        return elapsed / 20 * 1e3

    def record(row: dict) -> None:
        row |= {"shape": args.shape, "cuda_reserved_gb": torch.cuda.memory_reserved() / 2**30}
        print(row, flush=True)
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def measure(state: str) -> None:
        for name, forward in forwards.items():
            fn = both(forward)
            record({"state": state, "impl": name, "how": "host_ms", "host_ms": host_ms(fn)})
            record({"state": state, "impl": name, "how": "events"} | bench(fn).to_dict())
            record({"state": state, "impl": name, "how": "sleep"} | sleep_bench(fn))
            record({"state": state, "impl": name, "how": "events"} | bench(fn).to_dict())
            if state == "clean":  # a graph's private pool would not see the pooled state
                try:
                    record({"state": state, "impl": name, "how": "graph"} | bench(graphed(fn)).to_dict())
                except Exception as exc:  # recorded, not fatal: the other rows stand
                    record({"state": state, "impl": name, "how": "graph", "error": repr(exc)[:300]})

    torch.cuda.empty_cache()
    measure("clean")
    sizes = [(1 + i % 7) * 23 * 2**20 for i in range(80)]  # 23 MiB to 161 MiB, 12 GB in all
    held = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    del held[::2]
    held += [torch.empty(n // 3, dtype=torch.uint8, device="cuda") for n in sizes[:40]]
    del held
    measure("pooled")
    torch.cuda.empty_cache()
    measure("clean again")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
