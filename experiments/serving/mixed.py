"""A chunked-prefill server's mixed batch in one ``decay_attention`` call (256 one-token
decodes first, then 4 prefills of 2,048 tokens, on one fp32 pool of slots) beside the
decode step and the pool prefill timed alone, at DK = DV = 128, H = 8 and 16, fp16 and
bf16, RetNet's decays. The goal: the one call within 1.05x of the two alone, summed.

    python3 experiments/serving/mixed.py [--out FILE]   # default $OUT/mixed.jsonl, else beside this file

Rows per shape: ``decode alone`` (``decay_decode``, 256 sequences), ``prefill alone``
(``decay_attention(..., pool=)`` of the 4 prefills), ``mixed, decodes=256`` (the one call:
the decode step on the first 256 tokens, the pool prefill on the rest), ``mixed, packed
only`` (the same batch with no hint: every sequence through the packed kernel, 256 of them
one-token), and ``apart, back to back`` (the two calls alone, in one timed function). Each
timing is ``kernel.timing.time_gpu`` with the host's launches queued ahead (CUDA events,
warm-up, L2 flushed before every repetition, median and p20/p80 of the GPU's time) and the
host's time per call; ``vs_sum`` divides by the two alone, summed. The mixed call's outputs
and pool are checked bitwise against the two calls apart, once. Each shape runs in a child
process under a timeout.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SHAPES = [(8, "float16"), (8, "bfloat16"), (16, "float16"), (16, "bfloat16")]
DECODES, PREFILLS, PREFILL_LEN = 256, 4, 2048
DK = DV = 128
GOAL = 1.05
CHILD_TIMEOUT_S = 420


def measure(h: int, dtype_name: str) -> list[dict]:
    """Every row of one shape (in the child process)."""
    import torch

    from kernel.ops import decay_attention, decay_decode
    from kernel.timing import time_gpu

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    d, n = DECODES, DECODES + PREFILLS
    lengths = [1] * d + [PREFILL_LEN] * PREFILLS
    t = sum(lengths)
    rows = 2 * n
    decay = torch.tensor([1 - 2 ** (-5 - i) for i in range(h)], device="cuda")
    q, k, v = (torch.randn(1, t, h, x, device="cuda").to(dtype) for x in (DK, DK, DV))
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    slots = torch.randperm(rows, device="cuda")[:n].int()
    from_pool = torch.ones(n, dtype=torch.bool, device="cuda")
    from_pool[d::2] = False  # half the prefills are new requests
    pool = torch.randn(rows, h, DK, DV, device="cuda") * 0.1
    # The parts apart, as their own tensors (what a server would pass running them apart).
    q_d, k_d, v_d = (x[0, :d, None].contiguous() for x in (q, k, v))
    q_p, k_p, v_p = (x[:, d:].contiguous() for x in (q, k, v))
    cu_p, slots_d, slots_p, from_p = (
        (cu[d:] - d).contiguous(),
        slots[:d].clone(),
        slots[d:].clone(),
        from_pool[d:].clone(),
    )

    def decode(p=pool):
        return decay_decode(q_d, k_d, v_d, decay, pool=p, slots=slots_d)

    def prefill(p=pool):
        return decay_attention(
            q_p, k_p, v_p, decay, cu_seqlens=cu_p, pool=p, slots=slots_p, from_pool=from_p
        )[0]

    def mixed(p=pool, hint=d):
        return decay_attention(
            q, k, v, decay, cu_seqlens=cu, pool=p, slots=slots, from_pool=from_pool, decodes=hint
        )[0]

    # Bitwise: the one call against the two apart, from the same pool.
    a, b = pool.clone(), pool.clone()
    o = mixed(a)
    o_d, o_p = decode(b), prefill(b)
    torch.cuda.synchronize()
    equal = bool(torch.equal(o[0, :d], o_d[:, 0]) and torch.equal(o[:, d:], o_p) and torch.equal(a, b))

    base = {"heads": h, "dtype": dtype_name, "decodes": d, "prefills": PREFILLS, "prefill_len": PREFILL_LEN}
    base |= {"dk": DK, "dv": DV, "pool": "float32", "gpu": torch.cuda.get_device_name()}
    out = []
    for what, fn in (
        ("decode alone", decode),
        ("prefill alone", prefill),
        ("mixed, decodes=256", mixed),
        ("mixed, packed only", lambda: mixed(hint=0)),
        ("apart, back to back", lambda: (decode(), prefill())),
    ):
        timing = time_gpu(fn, host_ahead=True)
        out.append(
            base
            | {
                "what": what,
                "gpu_us": timing.median_ms * 1e3,
                "p20_us": timing.p20_ms * 1e3,
                "p80_us": timing.p80_ms * 1e3,
                "host_us": timing.host_ms * 1e3,
            }
        )
    alone = out[0]["gpu_us"] + out[1]["gpu_us"]
    for r in out:
        r["vs_sum"] = r["gpu_us"] / alone
        r["within_goal"] = r["vs_sum"] <= GOAL
        r["equal_apart"] = equal
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(os.environ["OUT"]) / "mixed.jsonl" if os.environ.get("OUT") else HERE / "mixed.jsonl"
    parser.add_argument("--out", type=Path, default=default)
    parser.add_argument("--timeout", type=float, default=CHILD_TIMEOUT_S, help="seconds a shape may take")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        for r in measure(int(args.child[0]), args.child[1]):
            print(json.dumps(r), flush=True)
        return
    rows = []
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    }
    for h, dtype in SHAPES:
        cmd = [sys.executable, __file__, "--child", str(h), dtype]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and what it started (nvcc)
            stdout, _ = proc.communicate()
            rows.append(
                {"heads": h, "dtype": dtype, "what": "all", "error": f"timed out after {args.timeout:g} s"}
            )
        else:
            if proc.returncode:
                rows.append(
                    {"heads": h, "dtype": dtype, "what": "all", "error": f"exit status {proc.returncode}"}
                )
        rows += [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    head = f"{'H':>3} {'dtype':<9} {'what':<22} {'GPU us':>9} {'p20-p80':>17} {'host us':>8} {'vs sum':>7}"
    print(head + "  bitwise")
    for r in rows:
        if "error" in r:
            print(f"{r['heads']:>3} {r['dtype']:<9} {r['what']:<22} {r['error']}")
            continue
        spread = f"{r['p20_us']:.1f}-{r['p80_us']:.1f}"
        print(
            f"{r['heads']:>3} {r['dtype']:<9} {r['what']:<22} {r['gpu_us']:9.1f} {spread:>17} "
            f"{r['host_us']:8.1f} {r['vs_sum']:7.3f}  {r['equal_apart']}"
        )
    print(f"goal: 'mixed, decodes=256' within {GOAL}x of decode alone + prefill alone")


if __name__ == "__main__":
    main()
