"""Where forward plus backward spends its time, ours at 8x16x4096 and 2x16x16384 (128/128,
fp16, RetNet's decays, the final state returned, as ``measure.py``'s warm part): the GPU's
kernels by name (torch.profiler, 20 calls), the host's time per call by the number of calls
queued after a sync, and the host's Python by function (cProfile, 200 calls queued without a
sync). Beside ours, the floor torch's autograd sets on the same host: a
``torch.autograd.Function`` of the same tensors that launches nothing, and one that launches
as many kernels as ours (one forward, two backward; a fill each). Then one call after a sync
as a timeline of the host (when each launch and step began and ended, and whether the GPU had
finished the forward by then: a step that waits on the GPU shows as a gap), and the same call
under ``torch.cuda.set_sync_debug_mode("warn")`` (torch's ops that wait on the GPU).

    source .gpu/setup.sh && python3 experiments/host_path/breakdown.py   # with OUT: $OUT/breakdown.txt
"""

import cProfile
import functools
import io
import os
import pstats
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import kernel.builder  # noqa: E402
import kernel.ops.attention  # noqa: E402
from kernel.ops import decay_attention  # noqa: E402


def tensors(b: int, s: int, h: int = 16, d: int = 128):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(b, s, h, d, device="cuda", dtype=torch.float16, generator=g).requires_grad_(True)
        for _ in range(3)
    )
    gammas = torch.tensor([1 - 2 ** (-5 - i) for i in range(h)], device="cuda")
    return q, k, v, gammas, torch.randn_like(v)


class _Floor(torch.autograd.Function):
    """fwd+bwd of q, k, v -> o through autograd, with ``launches`` fills (ours: 1 and 2)."""

    @staticmethod
    def forward(ctx, q, k, v, launches):
        ctx.launches = launches
        o = torch.empty_like(v)
        if launches:
            o.fill_(1.0)
        return o

    @staticmethod
    def backward(ctx, do):
        grads = [torch.empty_like(do) for _ in range(3)]
        for x in grads[: 2 if ctx.launches else 0]:
            x.fill_(1.0)
        return *grads, None


def timeline(once, q, k, v, gammas, do) -> list[str]:
    """One fwd+bwd call after a sync, each launch and backward step timed on the host (us from
    the call's start), with whether the GPU had finished the forward's kernels by then (once
    the forward has returned)."""
    marks: list[tuple[float, str]] = []
    forward_done, recorded = torch.cuda.Event(), []

    def mark(what: str) -> None:
        done = f" (forward done on the GPU: {forward_done.query()})" if recorded else ""
        marks.append((time.perf_counter(), what + done))

    wrapped = [
        (kernel.ops.attention, "launch"),  # the forward's
        (kernel.builder, "launch"),  # the backward's passes
        (kernel.builder, "launch_dkdv"),
        (kernel.ops.attention, "_passes"),
    ]
    saved = [getattr(module, name) for module, name in wrapped]

    def timed(name, function):
        @functools.wraps(function)
        def call(*args, **kwargs):
            mark(f"{name} begins")
            result = function(*args, **kwargs)
            mark(f"{name} ends")
            return result

        return call

    for (module, name), function in zip(wrapped, saved):
        setattr(module, name, timed(name, function))
    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        q.grad = k.grad = v.grad = None
        o, _ = decay_attention(q, k, v, gammas, output_final_state=True)
        forward_done.record()
        recorded.append(True)
        mark("forward returned")
        o.backward(do)
        mark("backward returned")
        torch.cuda.synchronize()
        mark("synchronized: the GPU is done")
    finally:
        for (module, name), function in zip(wrapped, saved):
            setattr(module, name, function)
    lines = [f"{(t - start) * 1e6:9.1f} us  {what}" for t, what in marks]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            once()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    lines.append(f"torch ops that waited on the GPU in one call: {len(caught)}")
    lines += [f"  {w.filename}:{w.lineno}: {w.message}" for w in caught]
    lines += launch_costs(q, k, v, gammas)
    return lines


def launch_costs(q, k, v, gammas) -> list[str]:
    """The host's cost of passing CUDA tensors through TVM-FFI (its ``testing.nop`` with as
    many tensors as the fused pass takes; fast where torch has ``__dlpack_c_exchange_api__``),
    and of one launch of the forward's kernel, each per call over 20 calls after a sync."""
    import tvm_ffi

    nop = tvm_ffi.get_global_func("testing.nop")
    args = [q, k, v, q, k, v, q, k, v, q, k]
    plan = next(p for p in kernel.ops.attention._PLANS.values() if p.problem.batch == q.shape[0])
    o = torch.empty_like(v)
    final = torch.empty(plan.final_shape, dtype=torch.float32, device=q.device)
    ht = final.view(-1, 1, plan.problem.dk, plan.problem.dv)
    calls = {
        "tvm_ffi nop, 11 CUDA tensors": lambda: nop(*args),
        "the forward's kernel, launched alone": lambda: kernel.ops.attention.launch(
            *plan.launch, q, k, v, plan.decay, plan.unused, o, ht, None
        ),
    }
    fast = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    lines = [f"torch.Tensor has __dlpack_c_exchange_api__: {fast}"]
    for name, call in calls.items():
        times = []
        for _ in range(10):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                call()
            times.append((time.perf_counter() - t) / 20 * 1e6)
        lines.append(f"{name}: {sorted(times)[5]:.1f} us a call (host)")
    torch.cuda.synchronize()
    return lines


def main() -> None:
    lines = []
    for b, s in ((8, 4096), (2, 16384)):
        q, k, v, gammas, do = tensors(b, s)

        def once() -> None:
            q.grad = k.grad = v.grad = None  # as a training step's zero_grad
            o, _ = decay_attention(q, k, v, gammas, output_final_state=True)
            o.backward(do)

        for _ in range(20):
            once()
        torch.cuda.synchronize()

        # Host time per call against the number of calls queued after a sync: where it grows
        # with the queue, the launches wait for room in CUDA's queue (a launch of large
        # parameters, TMA descriptors among them, takes more of it), not for our Python.
        def fwd() -> None:
            with torch.no_grad():
                decay_attention(q, k, v, gammas, output_final_state=True)

        def floor(launches: bool):
            def step() -> None:
                q.grad = k.grad = v.grad = None
                _Floor.apply(q, k, v, launches).backward(do)

            return step

        queued = []
        steps = (
            ("fwd", fwd),
            ("fwd+bwd", once),
            ("floor, no launch", floor(False)),
            ("floor, 3 fills", floor(True)),
        )
        for name, step in steps:
            for n in (1, 2, 3, 5, 10, 20):
                times = []
                for _ in range(10):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    for _ in range(n):
                        step()
                    times.append((time.perf_counter() - t) / n * 1e6)
                queued.append(f"{name} {n} queued: {sorted(times)[len(times) // 2]:.1f} us/call")
        torch.cuda.synchronize()
        lines.append(f"== {b}x16x{s}: host time per call, median of 10 batches, by calls queued after a sync")
        lines.append("\n".join(queued))
        lines.append(f"== {b}x16x{s}: one call after a sync, on the host")
        try:  # new on a GPU: were it to fail, the profiles below still run
            lines += timeline(once, q, k, v, gammas, do)
        except Exception as exc:  # noqa: BLE001
            lines.append(f"timeline failed: {exc!r}")
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                once()
            torch.cuda.synchronize()
        lines.append(f"== {b}x16x{s}: GPU kernels, 20 calls")
        lines.append(
            prof.key_averages().table(
                sort_by="self_device_time_total", row_limit=14, max_name_column_width=70
            )
        )
        lines.append(f"== {b}x16x{s}: host ops, 20 calls")
        lines.append(
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70)
        )
        prof_py = cProfile.Profile()
        torch.cuda.synchronize()
        prof_py.enable()
        for _ in range(200):
            once()
        prof_py.disable()
        torch.cuda.synchronize()
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(prof_py, stream=text).sort_stats(order).print_stats(30)
            lines.append(f"== {b}x16x{s}: Python, 200 calls, by {order}")
            lines.append(text.getvalue())
    out = "\n".join(lines)
    print(out)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "breakdown.txt").write_text(out)


if __name__ == "__main__":
    main()
