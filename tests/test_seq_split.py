"""The sequence-split variant on the CPU: its carry algebra in float64, and that its three
kernels lower and compile for sm_90a. The GPU check is in tests/test_kernel_gpu.py."""

import pytest
import torch

import refs
from kernel import KernelConfig, Problem, Resources
from kernel.config import segment_length
from kernel.probe import compile_kernel, probe
from refs.chunk import chunk_weights


def split_reference(q, k, v, alpha: float, chunk: int, segments: int) -> torch.Tensor:
    """The variant's algorithm in fp64: end states per segment, the carry, then outputs."""
    b, s, h, _ = q.shape
    L = segment_length(s, chunk, segments)
    pad = -s % L
    q, k, v = (torch.nn.functional.pad(x.double(), (0, 0, 0, 0, 0, pad)).transpose(1, 2) for x in (q, k, v))
    w = chunk_weights(alpha, chunk)
    n_seg = q.shape[2] // L

    def run(seg: int, state: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        for s0 in range(seg * L, (seg + 1) * L, chunk):
            qs, ks, vs = (x[:, :, s0 : s0 + chunk] for x in (q, k, v))
            if out is not None:
                out[:, :, s0 : s0 + chunk] = (qs * w.w_query[:, None]) @ state + (
                    (qs @ ks.transpose(-1, -2)) * w.gamma
                ) @ vs
            state = w.state_decay * state + (ks * w.w_decay[:, None]).transpose(-1, -2) @ vs
        return state

    zero = q.new_zeros(b, h, q.shape[-1], v.shape[-1])
    ends = [run(p, zero, None) for p in range(n_seg)]  # kernel 1: from a zero state
    out = torch.empty_like(v)
    for p in range(n_seg):  # kernel 2: carry in, then the segment's outputs
        carry = zero
        for j in range(p):
            carry = alpha**L * carry + ends[j]
        run(p, carry, out)
    return out[:, :, :s].transpose(1, 2)


@pytest.mark.parametrize("s,chunk,segments", [(300, 16, 3), (64, 16, 4), (17, 4, 5), (129, 8, 2), (40, 8, 1)])
@pytest.mark.parametrize("alpha", [1.0, 0.9, 0.5])
def test_carry_algebra_matches_the_recurrence(s, chunk, segments, alpha):
    gen = torch.Generator().manual_seed(s + segments)
    q, k = (torch.randn(2, s, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, s, 2, 6, generator=gen, dtype=torch.float64)
    assert (
        refs.rel_l2(split_reference(q, k, v, alpha, chunk, segments), refs.recurrent(q, k, v, alpha)) < 1e-13
    )


@pytest.mark.parametrize("alpha", [1.0, 0.99, 0.5])
def test_reverse_states_walk_reaches_the_forward_end_state(alpha):
    """The states kernel walks a segment's chunks last to first: iteration ``c`` reads chunk
    ``n - 1 - c`` and weights its row ``r`` by ``alpha^(C*c + C-1-r)``, the token's distance
    to the segment's end."""
    chunk, n = 16, 7
    gen = torch.Generator().manual_seed(3)
    k, v = (
        torch.randn(n * chunk, 8, generator=gen, dtype=torch.float64),
        torch.randn(n * chunk, 6, generator=gen, dtype=torch.float64),
    )
    w = chunk_weights(alpha, chunk)
    forward = k.new_zeros(8, 6)
    for c in range(n):
        ks, vs = k[c * chunk : (c + 1) * chunk], v[c * chunk : (c + 1) * chunk]
        forward = w.state_decay * forward + (ks * w.w_decay[:, None]).T @ vs
    reverse = k.new_zeros(8, 6)
    rows = torch.arange(chunk, dtype=torch.float64)
    for c in range(n):
        s0 = (n - 1 - c) * chunk
        weights = alpha ** (chunk * c + chunk - 1 - rows)
        reverse += (k[s0 : s0 + chunk] * weights[:, None]).T @ v[s0 : s0 + chunk]
    assert refs.rel_l2(reverse, forward) < 1e-14


def test_segments_are_whole_chunks():
    assert segment_length(32768, 64, 16) == 2048
    assert segment_length(1000, 64, 4) == 256  # 4 segments, the last one ragged
    assert segment_length(17, 64, 2) == 64


@pytest.mark.parametrize(
    "problem,config",
    [
        (Problem(2, 3, 300, 64, 64), KernelConfig(64, 32, 2, 128, segments=3)),
        (Problem(1, 2, 1000, 128, 128, "bfloat16"), KernelConfig(64, 64, 1, 128, "regs", segments=4)),
    ],
)
def test_three_kernels_compile_for_sm90a(problem, config):
    states, carry, outputs = compile_kernel(problem, config, "sm_90a")
    assert "tma_load" in outputs.get_kernel_source()
    res = probe(problem, config)
    assert isinstance(res, Resources) and res.spill_bytes == 0 and res.fits_smem


def test_a_split_that_leaves_one_segment_is_refused():
    # 64 tokens in 2 segments of whole 64-token chunks: one segment.
    with pytest.raises(ValueError, match="use segments=1"):
        KernelConfig(64, 32, 1, 128, segments=2).check_fits(Problem(1, 1, 64, 64, 64))
    KernelConfig(64, 32, 1, 128, segments=2).check_fits(Problem(1, 1, 65, 64, 64))


def test_single_pass_kernel_refuses_segments():
    from kernel.scalar_decay import prim_func

    with pytest.raises(ValueError, match="one segment"):
        prim_func(Problem(1, 1, 300, 64, 64), KernelConfig(segments=2), arch="sm_90a")
