"""GPU timing in the manner of Triton's ``do_bench``: CUDA events, warm-up, L2 flushed
before every repetition, median with the 20th and 80th percentiles."""

from collections.abc import Callable, Hashable, Mapping
from dataclasses import asdict, dataclass
from typing import TypeVar

import torch

Key = TypeVar("Key", bound=Hashable)

# Larger than the H200's 60 MiB L2, so each repetition starts cold.
L2_FLUSH_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def bench(
    fn: Callable[[], object],
    *,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    min_reps: int = 10,
    max_reps: int = 1000,
) -> Timing:
    """Time ``fn()`` on the current CUDA stream; return median and p20/p80 in milliseconds."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
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
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = torch.tensor([s.elapsed_time(e) for s, e in zip(starts, ends)], dtype=torch.float64)
    q = torch.quantile(times, torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64)).tolist()
    return Timing(median_ms=q[0], p20_ms=q[1], p80_ms=q[2], reps=reps)


def alternating(calls: Mapping[Key, Callable[[], object]], *, rounds: int = 3) -> dict[Key, list[float]]:
    """``bench`` each call once per round, the calls taking turns within every round, so
    that a drift of the GPU's clocks or of the host falls on all of them alike: the way
    variants are compared in one run. Returns each call's ``rounds`` medians in ms."""
    times: dict[Key, list[float]] = {key: [] for key in calls}
    for _ in range(rounds):
        for key, fn in calls.items():
            times[key].append(bench(fn).median_ms)
    return times
