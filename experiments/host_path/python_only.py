"""The host's Python around an eager forward-plus-backward call, without a GPU: every kernel
launch replaced by a call that does nothing, so what is timed is the op's own Python, torch's
autograd engine and the tensors it makes (on the CPU; a GPU adds its launches' cost).

    python3 experiments/host_path/python_only.py > experiments/host_path/python_only.txt

At 8x16x4096 and 1x16x64, 128/128, fp16 (the first's tensors cost the CPU's allocator
large buffers; the second's do not, and its config runs unsplit), the
RetNet decays, the final state returned, the gradients set to None before each call as a
training step's ``zero_grad`` does: the median over 20 batches of 50 calls of the wall time
per call, forward alone (no grad) and forward plus backward, and beside them torch's floor
for the same (a ``torch.autograd.Function`` of the same tensors that only makes its outputs
and gradients); then the op's cProfile, by own time. The device checks
(CUDA tensors) are widened to the CPU for this run only.
"""

import cProfile
import inspect
import pstats
import time

import torch

import kernel.ops.inputs as inputs
from kernel.builder import ScalarDecayKernel
from kernel.ops import attention, serve

source = inspect.getsource(inputs._check_qkv).replace('("cuda", "meta")', '("cuda", "meta", "cpu")')
exec(compile(source, inputs.__file__, "exec"), inputs.__dict__)  # noqa: S102 (CPU tensors, this run only)
torch.cuda.is_current_stream_capturing = lambda: False


def nothing(*args: object) -> None:
    """A kernel launch that launches nothing."""


def kernel_for(problem, call, sequences):
    """The op's kernel at the config an H100 (sm_90a, 132 SMs) would run, every launch a no-op
    (a split config launches three kernels)."""
    _, config, _ = serve.kernel_job(problem, call, sequences, arch="sm_90a", sms=132)
    return ScalarDecayKernel(problem, config, (nothing,) * (1 if config.segments == 1 else 3), call)


attention.kernel_for = serve.kernel_for = kernel_for
attention.fuses_here = lambda problem: True


class Floor(torch.autograd.Function):
    """What torch's autograd costs a call of q, k, v that makes its output and gradients and
    does nothing else."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(v)

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def per_call(step, calls: int = 50, batches: int = 20) -> float:
    for _ in range(calls):
        step()
    times = []
    for _ in range(batches):
        t = time.perf_counter()
        for _ in range(calls):
            step()
        times.append((time.perf_counter() - t) / calls)
    return sorted(times)[batches // 2] * 1e6


def main() -> None:
    for b, s in ((8, 4096), (1, 64)):
        measure(b, s)


def measure(b: int, s: int) -> None:
    h, d = 16, 128
    q, k, v = (torch.empty(b, s, h, d, dtype=torch.float16).requires_grad_() for _ in range(3))
    do = torch.empty(b, s, h, d, dtype=torch.float16)
    gammas = torch.tensor([1 - 2 ** (-5 - i) for i in range(h)])

    def ours():
        q.grad = k.grad = v.grad = None
        o, _ = attention.decay_attention(q, k, v, gammas, output_final_state=True)
        o.backward(do)

    def floor():
        q.grad = k.grad = v.grad = None
        Floor.apply(q, k, v).backward(do)

    def forward():
        with torch.no_grad():
            attention.decay_attention(q, k, v, gammas, output_final_state=True)

    print(f"torch {torch.__version__}, {b}x{h}x{s} {d}/{d} fp16, no kernel launched")
    print(f"forward (no grad)        {per_call(forward):7.1f} us/call")
    print(f"forward+backward, ours   {per_call(ours):7.1f} us/call")
    print(f"forward+backward, floor  {per_call(floor):7.1f} us/call (torch's autograd alone)")
    if s < 4096:
        return
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        ours()
    profile.disable()
    print("\ncProfile of 200 forward+backward calls (times inflated by the profiler), by own time:")
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
