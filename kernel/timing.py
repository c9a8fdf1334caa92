"""GPU timing in the manner of Triton's ``do_bench``: CUDA events, warm-up, L2 flushed
before every repetition, median with the 20th and 80th percentiles.

A call of several kernels whose host side takes about as long as its kernels (forward
plus backward through autograd) times the host too, unevenly: the GPU waits for launches
whenever the host falls behind. ``time_gpu(host_ahead=True)`` queues a GPU sleep before each
repetition's start event, twice the host's time per call, so that the whole call is queued
before the GPU reaches it: the kernels' time alone, and the host's (``host_time``)
reported beside it (measured: ``experiments/backward/``, ``gap_cause.py``)."""

import functools
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import asdict, dataclass
from typing import TypeVar

import torch

Key = TypeVar("Key", bound=Hashable)

# Larger than the GPUs' L2, so each repetition starts cold. evidence: docs/evidence.md#l2-flush
L2_FLUSH_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int
    host_ms: float | None = None  # the host's time per call, where timed with host_ahead

    def to_dict(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v is not None}


def time_gpu(
    fn: Callable[[], object],
    *,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    min_reps: int = 10,
    max_reps: int = 1000,
    host_ahead: bool = False,
) -> Timing:
    """Time ``fn()`` on the current CUDA stream; return median and p20/p80 in milliseconds.
    With ``host_ahead``, the GPU's time with the host's launches queued ahead (see the
    module), and the host's time per call."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
    host_ms = host_time(fn) if host_ahead else None
    sleep = round(2 * host_ms * _sleep_cycles_per_ms()) if host_ms else 0
    # Estimate one call to size the warm-up and the repetitions from the time budgets.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    reps = min(max_reps, max(min_reps, int(rep_ms / estimate)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        flush.zero_()
        if sleep:
            torch.cuda._sleep(sleep)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = torch.tensor([s.elapsed_time(e) for s, e in zip(starts, ends)], dtype=torch.float64)
    q = torch.quantile(times, torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64)).tolist()
    return Timing(median_ms=q[0], p20_ms=q[1], p80_ms=q[2], reps=reps, host_ms=host_ms)


def host_time(fn: Callable[[], object], *, calls: int = 20) -> float:
    """The host's milliseconds per ``fn()``: ``calls`` calls queued behind a 200 ms GPU
    sleep, so that no launch waits for the GPU, timed on the host's clock. A call that waits
    for the GPU all the same (a synchronisation, or more launches than CUDA's queue holds)
    counts its wait too."""
    torch.cuda.synchronize()
    torch.cuda._sleep(round(200 * _sleep_cycles_per_ms()))  # 200 ms: the GPU stays busy meanwhile
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e3


@functools.cache
def _sleep_cycles_per_ms() -> float:
    """``torch.cuda._sleep``'s cycles per millisecond on this GPU, timed once."""
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles // 10)  # warm
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    return cycles / start.elapsed_time(end)


def alternating(calls: Mapping[Key, Callable[[], object]], *, rounds: int = 3) -> dict[Key, list[float]]:
    """``time_gpu`` each call once per round, the calls taking turns within every round, so
    that a drift of the GPU's clocks or of the host falls on all of them alike: the way
    variants are compared in one run. Returns each call's ``rounds`` medians in ms."""
    times: dict[Key, list[float]] = {key: [] for key in calls}
    for _ in range(rounds):
        for key, fn in calls.items():
            times[key].append(time_gpu(fn).median_ms)
    return times
