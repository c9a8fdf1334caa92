"""The decode step (``kernel.ops.decay_decode``) beside fla's ``fused_recurrent_simple_gla``
with the gather and scatter of states a server needs around it, and beside a device copy
of the state's bytes (the floor: our step reads and writes each state once, as the copy
does), at DK = DV = 128, fp32 pool, bf16 q/k/v, RetNet's decays:

    python3 experiments/decode/bench.py [--sweep] [--out experiments/decode/bench.jsonl]

Shapes (N sequences x H heads): 1x8, 32x16, 128x16, 512x16 (N*H = 8, 512, 2048, 8192).
Each shape runs in a child process of its own under a timeout (a hung launch is killed
with its process group and recorded as such). Timings are ``kernel.timing.time_gpu`` with
the host's launches queued ahead: CUDA events, warm-up, L2 flushed before every repetition,
median (p20, p80) of the GPU's time; ``host_us`` is the host's time per call (20 calls
queued behind a GPU sleep), ``eager_us`` the pace of 1,000 eager calls in a loop (the host's
time where it is the bottleneck, the GPU's where that is). ``--sweep`` also times every
decode config at each shape (the kernel alone), for the tuner's ranking.

Prints a table; writes one JSON line per (shape, what) to ``--out``.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SHAPES = [(1, 8), (32, 16), (128, 16), (512, 16)]
DK = DV = 128
CHILD_TIMEOUT_S = 600


def measure(n: int, h: int, sweep: bool) -> list[dict]:
    """Every row of one shape (in the child process)."""
    import torch

    from kernel.builder import sm_count
    from kernel.decode import DecodeProblem, decode_choices, decode_config, decode_step
    from kernel.decode_build import build_decode
    from kernel.ops.decode import decay_decode
    from kernel.probe import compile_funcs
    from kernel.timing import time_gpu

    torch.manual_seed(0)
    dtype, scale = torch.bfloat16, DK**-0.5
    rows = 2 * n
    decay = torch.tensor([1 - 2 ** (-5 - i) for i in range(h)], device="cuda")
    pool = torch.randn(rows, h, DK, DV, device="cuda") * 0.1
    slots = torch.randperm(rows, device="cuda")[:n].int()
    slots_long = slots.long()
    q, k, v = (torch.randn(n, 1, h, d, device="cuda").to(dtype) for d in (DK, DK, DV))
    state_bytes = n * h * DK * DV * 4
    base = {"n": n, "heads": h, "rows": n * h, "dk": DK, "dv": DV, "gpu": torch.cuda.get_device_name()}
    out = []

    def row(what: str, fn, **extra) -> dict:
        t = time_gpu(fn, host_ahead=True)
        torch.cuda.synchronize()
        calls = 1000
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        eager_us = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize()
        r = base | {
            "what": what,
            "gpu_us": t.median_ms * 1e3,
            "p20_us": t.p20_ms * 1e3,
            "p80_us": t.p80_ms * 1e3,
            "host_us": t.host_ms * 1e3,
            "eager_us": eager_us,
            "gbps": 2 * state_bytes / (t.median_ms * 1e-3) / 1e9,
        }
        out.append(r | extra)
        return out[-1]

    ours = lambda: decay_decode(q, k, v, decay, pool=pool, slots=slots, scale=scale)
    problem = DecodeProblem(h, DK, DV, "bfloat16", "float32", "int32", scale)
    config = decode_config(problem, n * h, sm_count())

    # Correctness once, against fla where it imports and fp64 reference A otherwise.
    h0 = pool[slots_long].clone()
    o = ours()
    ref_o, ref_s = _reference(q, k, v, decay, h0, scale)
    err = {
        "rel_o": float((o.double() - ref_o).norm() / ref_o.norm()),
        "rel_state": float((pool[slots_long].double() - ref_s).norm() / ref_s.norm()),
    }
    row("ours", ours, config=config.label, **err)
    kern = build_decode(problem, config)
    row("ours, the kernel alone", lambda: kern.run(q, k, v, decay, slots, pool), config=config.label)

    src = torch.empty(state_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    floor = row("copy (floor)", lambda: dst.copy_(src))

    try:
        from fla.ops.simple_gla import fused_recurrent_simple_gla
    except ImportError as exc:
        out.append(base | {"what": "fla", "error": f"{type(exc).__name__}: {exc}"})
    else:
        g_gamma = decay.log()

        def fla():  # what a server runs around fla: gather the states, run, scatter them back
            h0 = pool.index_select(0, slots_long)
            o, ht = fused_recurrent_simple_gla(
                q, k, v, g_gamma=g_gamma, scale=scale, initial_state=h0, output_final_state=True
            )
            pool.index_copy_(0, slots_long, ht)
            return o

        row("fla fused_recurrent + gather/scatter", fla, agree=_agreement(q, k, v, decay, pool, slots, scale))

    for r in out:
        if "gpu_us" in r:
            r["over_floor"] = r["gpu_us"] / floor["gpu_us"]

    if sweep:
        choices = decode_choices(problem)
        compile_funcs([decode_step(problem, c) for c in choices], _arch())
        for c in choices:
            kern = build_decode(problem, c)
            t = time_gpu(lambda kern=kern: kern.run(q, k, v, decay, slots, pool))
            out.append(
                base
                | {
                    "what": "sweep",
                    "config": c.label,
                    "rule": c == config,
                    "gpu_us": t.median_ms * 1e3,
                    "p20_us": t.p20_ms * 1e3,
                    "p80_us": t.p80_ms * 1e3,
                    "over_floor": t.median_ms * 1e3 / floor["gpu_us"],
                }
            )
    return out


def _agreement(q, k, v, decay, pool, slots, scale) -> dict:
    """Ours and fla's one step from the same states, on copies of the pool: relative L2 of
    the outputs and of the states."""
    import torch
    from fla.ops.simple_gla import fused_recurrent_simple_gla

    from kernel.ops.decode import decay_decode

    mine = pool.clone()
    o = decay_decode(q, k, v, decay, pool=mine, slots=slots, scale=scale)
    o_fla, ht = fused_recurrent_simple_gla(
        q, k, v, g_gamma=decay.log(), scale=scale, initial_state=pool[slots.long()], output_final_state=True
    )
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())
    torch.cuda.synchronize()
    return {"rel_o_vs_fla": rel(o, o_fla), "rel_state_vs_fla": rel(mine[slots.long()], ht)}


def _reference(q, k, v, decay, h0, scale):
    import refs

    return refs.recurrent(
        q.double(), k.double(), v.double(), decay.double(), scale=scale,
        initial_state=h0.double(), output_final_state=True,
    )  # fmt: skip


def _arch() -> str:
    from kernel.builder import cuda_arch

    return cuda_arch()


def child(args: argparse.Namespace) -> None:
    n, h = args.child
    for r in measure(n, h, args.sweep):
        print(json.dumps(r), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time every decode config")
    parser.add_argument("--out", type=Path, default=HERE / "bench.jsonl")
    parser.add_argument("--timeout", type=float, default=CHILD_TIMEOUT_S, help="seconds a shape may take")
    parser.add_argument("--child", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    }
    for n, h in SHAPES:
        cmd = [sys.executable, __file__, "--child", str(n), str(h), *(["--sweep"] if args.sweep else [])]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and what it started (nvcc)
            stdout, _ = proc.communicate()
            rows.append({"n": n, "heads": h, "what": "all", "error": f"timed out after {args.timeout:g} s"})
        else:
            if proc.returncode:
                rows.append({"n": n, "heads": h, "what": "all", "error": f"exit status {proc.returncode}"})
        rows += [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"{'N x H':>8} {'what':<38} {'GPU us':>8} {'/floor':>7} {'host us':>8} {'eager us':>9}  notes")
    for r in rows:
        shape = f"{r['n']}x{r['heads']}"
        if "error" in r:
            print(f"{shape:>8} {r['what']:<38} {r['error']}")
            continue
        what = r["what"] + (f" {r['config']}" if "config" in r else "") + (" (rule)" if r.get("rule") else "")
        notes = {k: f"{r[k]:.2e}" for k in ("rel_o", "rel_state") if k in r}
        notes |= {k: f"{v:.2e}" for k, v in r.get("agree", {}).items()}
        host = f"{r['host_us']:8.1f} {r['eager_us']:9.1f}" if "host_us" in r else f"{'':8} {'':9}"
        print(f"{shape:>8} {what:<38} {r['gpu_us']:8.2f} {r['over_floor']:7.3f} {host}  {notes or ''}")


if __name__ == "__main__":
    main()
