"""The model form on a real GPU (marked ``gpu``): per-head decay read at run time, the query
scale, a state in and out, for both variants, against reference C in fp64; the public
``decay_attention`` chained over calls, under ``torch.compile`` and in a CUDA graph."""

import itertools
import math

import pytest
import torch
from helpers import selected

import refs
from kernel.builder import build, cuda_arch, precompile
from kernel.config import Call, KernelConfig, Problem
from kernel.ops.attention import decay_attention
from kernel.probe import Resources
from kernel.validate import check, random_qkv
from refs import TOLERANCE

pytestmark = pytest.mark.gpu


def retnet(heads: int) -> list[float]:
    """RetNet's decays: gamma_h = 1 - 2^(-5-h)."""
    return [1 - 2 ** (-5 - h) for h in range(heads)]


def lightning(heads: int) -> list[float]:
    """Lightning Attention's per-head slopes s_h = 2^(-8(h+1)/H), as decays exp(-s_h)."""
    return [math.exp(-(2 ** (-8 * (h + 1) / heads))) for h in range(heads)]


DECAYS = {
    "retnet8": retnet(8),
    "retnet16": retnet(16),
    "lightning8": lightning(8),
    "small": [0.05] * 8,  # alpha^C underflows fp32 at C = 64
    "mixed": [1.0, 0.9, 0.5, 0.05, 0.999, 0.8, 0.3, 0.99],
}
MODEL = Call(scale=0.125, initial_state=True, final_state=True)
CONFIGS = [
    KernelConfig(64, 128, 2, 256),  # the transposed step
    KernelConfig(64, 64, 2, 256),  # the async step
    KernelConfig(32, 32, 2, 128),  # the sync step
    KernelConfig(64, 32, 1, 128, "regs"),  # scores in registers
    KernelConfig(64, 128, 2, 256, segments=4),  # the split, carry launched
    KernelConfig(64, 64, 1, 128, segments=2),  # two segments: the carry runs for the initial state
    KernelConfig(32, 64, 2, 128, segments=8),
]
# (problem, config, call, decay): ragged chunks, S < C, DK != DV, bf16, every decay family.
CASES = [(Problem(2, 8, 300, 128, 128), c, MODEL, "retnet8") for c in CONFIGS] + [
    (Problem(1, 8, 1000, 64, 128, "bfloat16"), CONFIGS[0], MODEL, "lightning8"),
    (Problem(1, 8, 1000, 64, 128, "bfloat16"), CONFIGS[4], MODEL, "small"),
    (Problem(1, 8, 777, 128, 128), CONFIGS[6], MODEL, "mixed"),
    (Problem(3, 8, 17, 64, 64), CONFIGS[1], MODEL, "small"),
    (Problem(1, 16, 2048, 128, 128), CONFIGS[4], Call(1.0, False, True), "retnet16"),
    (Problem(1, 16, 2048, 128, 128, "bfloat16"), CONFIGS[0], Call(0.5, True, False), "retnet16"),
    # The transposed step with one stage over a sequence shorter than a chunk (what
    # decay_attention runs for S < 64), the calls suspected in the chained-call failure.
    (Problem(2, 8, 63, 128, 128), KernelConfig(64, 128, 1, 256), MODEL, "retnet8"),
    (Problem(2, 8, 1, 128, 128), KernelConfig(64, 128, 1, 256), MODEL, "retnet8"),
]


# Packed sequences: lengths from 1 up, ragged and whole chunks, one longer than a chunk by one.
LENGTHS = [1, 63, 64, 65, 300, 17, 1000, 2]
PACKED_CONFIGS = [
    KernelConfig(64, 128, 2, 256),  # the transposed step
    KernelConfig(64, 64, 2, 256),  # the async step
    KernelConfig(32, 32, 1, 128),  # the sync step
    KernelConfig(64, 32, 3, 128, "regs"),  # scores in registers, a pipeline deeper than most sequences
]


@pytest.fixture(scope="module", autouse=True)
def compiled(request) -> None:
    """Compile the selected cases once, in parallel; the tests then build from TileLang's
    cache."""
    packed = Call(scale=128**-0.5, initial_state=True, final_state=True, packed=True)
    jobs = selected(request, "problem", "config", "call") + [
        (Problem(1, 8, 1, 128, 128, dtype), config, packed)
        for config, dtype in selected(request, "config", "dtype")
    ]
    for res in precompile(jobs, arch=cuda_arch()):
        assert isinstance(res, Resources), res


def _decay(name: str) -> torch.Tensor:
    return torch.tensor(DECAYS[name], dtype=torch.float32, device="cuda")


@pytest.mark.parametrize("problem,config,call,decay", CASES, ids=str)
def test_model_form_matches_c(problem, config, call, decay):
    result = check(build(problem, config, call), seed=11, decay=_decay(decay))
    assert result["nan_count"] == 0 and result["finite"], result
    assert result["rel_l2"] < TOLERANCE, result


def _qkv(b: int, s: int, h: int, dk: int, dv: int, seed: int):
    return random_qkv(Problem(b, h, s, dk, dv), seed=seed)


@pytest.mark.parametrize(
    "cuts",
    [
        (1000,),
        (300, 1000),
        (1, 64, 999, 1000),  # S = 1 and S = 63: one chunk, the loop unrolled (kernel.variants.PASS_CONFIGS)
    ],
)
def test_a_sequence_cut_into_calls_gives_one_call_s_output(cuts):
    q, k, v = _qkv(2, 1000, 8, 128, 128, seed=3)
    decay, scale = _decay("retnet8"), 128**-0.5
    whole, whole_state = decay_attention(q, k, v, decay, output_final_state=True)
    parts, state, start, errors = [], None, 0, []
    for end in cuts:
        piece = [x[:, start:end].contiguous() for x in (q, k, v)]
        o, state_out = decay_attention(*piece, decay, initial_state=state, output_final_state=True)
        # Each call against reference A from the same incoming state: a failure names its call.
        ref_o, ref_s = refs.recurrent(
            *piece, decay, scale=scale, initial_state=state, output_final_state=True
        )
        errors.append((start, end, refs.rel_l2(o, ref_o), refs.rel_l2(state_out, ref_s)))
        parts.append(o)
        state, start = state_out, end
    assert all(e < TOLERANCE for *_, out_err, state_err in errors for e in (out_err, state_err)), errors
    ref, ref_state = refs.recurrent(q, k, v, decay, scale=scale, output_final_state=True)
    assert refs.rel_l2(torch.cat(parts, dim=1), ref) < TOLERANCE, errors
    assert refs.rel_l2(state, ref_state) < TOLERANCE, errors
    # The keys are weighted, then rounded to fp16 (2^-11), by their distance to the end of
    # their chunk, and the chunks fall elsewhere when the sequence is cut: the two runs agree
    # to about that rounding (2.5e-4 measured on the H200 for the state), not bit for bit.
    assert refs.rel_l2(torch.cat(parts, dim=1), whole) < 5e-3
    assert refs.rel_l2(state, whole_state) < 1e-3


def test_a_float_decay_is_every_head_s_decay():
    q, k, v = _qkv(1, 300, 4, 64, 64, seed=5)
    o, _ = decay_attention(q, k, v, 0.9)
    o_heads, _ = decay_attention(q, k, v, torch.full((4,), 0.9, device="cuda"))
    assert torch.equal(o, o_heads)
    assert refs.rel_l2(o, refs.recurrent(q, k, v, 0.9, scale=64**-0.5)) < TOLERANCE


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(decay=torch.full((3,), 0.9)), "tensor of 4 alphas"),
        (dict(decay=torch.tensor([0.9, 0.9, 1.5, 0.9])), "head 2"),
        (dict(decay=torch.tensor([0.9, 0.0, 0.9, 0.9])), "head 1"),
        (dict(decay=torch.tensor([0.9, float("nan"), 0.9, 0.9])), "head 1"),
        (dict(decay=1.5), r"\(0, 1\]"),
        (dict(initial_state=torch.zeros(1, 4, 64, 32)), "initial_state must be float32"),
        (dict(initial_state=torch.zeros(1, 4, 64, 64, dtype=torch.float16)), "initial_state must be float32"),
    ],
)
def test_bad_input_is_one_value_error(change, message):
    q, k, v = _qkv(1, 100, 4, 64, 64, seed=1)
    args = dict(decay=torch.full((4,), 0.9), initial_state=None) | change
    args = {n: a.cuda() if isinstance(a, torch.Tensor) else a for n, a in args.items()}
    with pytest.raises(ValueError, match=message):
        decay_attention(q, k, v, args.pop("decay"), **args)
    with pytest.raises(ValueError, match="share dtype and device|CUDA"):
        decay_attention(q, k.cpu(), v, 0.9)


def test_a_decay_changed_in_place_is_checked_again():
    """Values are checked once per tensor and version: a model's buffer costs one wait."""
    q, k, v = _qkv(1, 100, 4, 64, 64, seed=1)
    decay = torch.full((4,), 0.9, device="cuda")
    decay_attention(q, k, v, decay)
    decay[2] = 1.5
    with pytest.raises(ValueError, match="head 2"):
        decay_attention(q, k, v, decay)


def test_runs_under_torch_compile_fullgraph():
    q, k, v = _qkv(2, 500, 8, 64, 64, seed=2)
    decay, h0 = _decay("lightning8"), torch.randn(2, 8, 64, 64, device="cuda")

    def layer(q, k, v, decay, h0):
        o, state = decay_attention(q, k, v, decay, scale=0.2, initial_state=h0, output_final_state=True)
        return o * 2, state

    compiled = torch.compile(layer, fullgraph=True)
    eager_o, eager_state = layer(q, k, v, decay, h0)
    o, state = compiled(q, k, v, decay, h0)
    assert torch.equal(o, eager_o) and torch.equal(state, eager_state)


def test_runs_inside_a_captured_cuda_graph():
    q, k, v = (x.clone() for x in _qkv(1, 700, 8, 128, 128, seed=8))
    decay, h0 = _decay("retnet8"), torch.randn(1, 8, 128, 128, device="cuda")
    decay_attention(q, k, v, decay, initial_state=h0, output_final_state=True)  # compile outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, state = decay_attention(q, k, v, decay, initial_state=h0, output_final_state=True)
    for seed in (20, 21):  # new inputs into the captured buffers, then a replay
        for dst, src in zip((q, k, v), _qkv(1, 700, 8, 128, 128, seed=seed)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager_o, eager_state = decay_attention(q, k, v, decay, initial_state=h0, output_final_state=True)
        assert torch.equal(o, eager_o) and torch.equal(state, eager_state)


def test_a_float_decay_first_seen_inside_a_capture_is_refused():
    """Its constant [H] tensor would be filled only on replay: one line, nothing cached."""
    q, k, v = _qkv(1, 100, 4, 64, 64, seed=4)
    decay_attention(q, k, v, 0.5)  # compile outside the capture
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="before capturing a CUDA graph"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            decay_attention(q, k, v, 0.123)


def test_the_custom_op_passes_torch_s_opcheck():
    q, k, v = _qkv(1, 130, 4, 64, 64, seed=9)
    decay, h0 = torch.full((4,), 0.8, device="cuda"), torch.randn(1, 4, 64, 64, device="cuda")
    op = torch.ops.decay_tuner.decay_attention.default
    torch.library.opcheck(op, (q, k, v, decay, 1.0, 0.125, h0, True, None))
    cu = torch.tensor([0, 1, 60, 130], dtype=torch.int32, device="cuda")
    torch.library.opcheck(op, (q, k, v, decay, 1.0, 0.125, h0.expand(3, -1, -1, -1).contiguous(), True, cu))


def _packed(lengths: list[int], h: int, dk: int, dv: int, seed: int, dtype: str = "float16"):
    q, k, v = random_qkv(Problem(1, h, sum(lengths), dk, dv, dtype), seed=seed)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    return q, k, v, cu


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("config", PACKED_CONFIGS, ids=lambda c: c.label)
def test_packed_sequences_match_a_and_each_sequence_alone(config, dtype):
    """One compiled kernel for every T and N: two packings through the same kernel, NaN in
    every output and final state before the call, each against reference A and C with the
    same cu_seqlens, and each sequence against its own call (no state leaks across)."""
    call = Call(scale=128**-0.5, initial_state=True, final_state=True, packed=True)
    kernel = build(Problem(1, 8, 1, 128, 128, dtype), config, call)
    decay = _decay("mixed")
    for lengths, seed in ((LENGTHS, 1), ([5, 4000, 129], 2)):
        q, k, v, cu = _packed(lengths, 8, 128, 128, seed, dtype)
        h0 = torch.randn(len(lengths), 8, 128, 128, device="cuda")
        o, final = torch.full_like(v, float("nan")), torch.full_like(h0, float("nan"))
        kernel(q, k, v, decay=decay, initial_state=h0, final_state=final, out=o, cu_seqlens=cu)
        args = dict(scale=call.scale, initial_state=h0, cu_seqlens=cu, output_final_state=True)
        ref_o, ref_s = refs.recurrent(q, k, v, decay, **args)
        c_o, c_s = refs.kernel_mimic(q, k, v, decay, config.chunk, **args)
        assert not o.isnan().any() and not final.isnan().any()
        for ref, got in ((ref_o, o), (ref_s, final), (c_o, o), (c_s, final)):
            assert refs.rel_l2(got, ref) < TOLERANCE
        for n, (a, b) in enumerate(itertools.pairwise(cu.tolist())):
            alone_o, alone_s = refs.recurrent(
                *(x[:, a:b] for x in (q, k, v)),
                decay,
                scale=call.scale,
                initial_state=h0[n : n + 1],
                output_final_state=True,
            )
            assert refs.rel_l2(o[:, a:b], alone_o) < TOLERANCE, (n, a, b)
            assert refs.rel_l2(final[n : n + 1], alone_s) < TOLERANCE, (n, a, b)


def test_decay_attention_packs_as_fla_does():
    """The public call with cu_seqlens, against reference A, and without a state in."""
    q, k, v, cu = _packed(LENGTHS, 8, 64, 128, seed=6)
    decay = _decay("retnet8")
    o, final = decay_attention(q, k, v, decay, output_final_state=True, cu_seqlens=cu.long())
    ref_o, ref_s = refs.recurrent(q, k, v, decay, scale=64**-0.5, cu_seqlens=cu, output_final_state=True)
    assert refs.rel_l2(o, ref_o) < TOLERANCE and refs.rel_l2(final, ref_s) < TOLERANCE
    assert final.shape == (len(LENGTHS), 8, 64, 128)


@pytest.mark.parametrize(
    "offsets,message",
    [
        ([0, 5, 5, 100], "rise strictly"),
        ([1, 50, 100], "rise strictly"),
        ([0, 50, 99], "rise strictly from 0 to T = 100"),
        ([0], r"\[N \+ 1\]"),
    ],
)
def test_bad_offsets_are_one_value_error(offsets, message):
    q, k, v = _qkv(1, 100, 4, 64, 64, seed=1)
    with pytest.raises(ValueError, match=message):
        decay_attention(q, k, v, 0.9, cu_seqlens=torch.tensor(offsets, device="cuda"))
    cu = torch.tensor([0, 50, 100], device="cuda")
    with pytest.raises(ValueError, match=r"\[N, H, DK, DV\]"):
        decay_attention(q, k, v, 0.9, cu_seqlens=cu, initial_state=torch.zeros(1, 4, 64, 64, device="cuda"))
    with pytest.raises(ValueError, match="batch of 2"):
        decay_attention(*_qkv(2, 50, 4, 64, 64, seed=1), 0.9, cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens is on cpu"):
        decay_attention(q, k, v, 0.9, cu_seqlens=cu.cpu())


def test_a_new_table_serves_the_next_call():
    """``decay_attention`` remembers which kernel serves each shape and call; ``use_table``
    forgets that, so the next call takes the new table's pick, and ``use_table(None)`` the
    default config again."""
    import dataclasses

    from kernel.ops import serve
    from kernel.ops.dispatch import Dispatch, DispatchEntry

    problem, call = Problem(1, 2, 256, 64, 64), Call(0.125)
    default = serve.kernel_for(problem, call, 1).config
    other = dataclasses.replace(default, block_dv=32)
    serve.use_table(Dispatch([DispatchEntry(problem, other)], {}))
    try:
        assert serve.kernel_for(problem, call, 1).config == other
    finally:
        serve.use_table(None)
    assert serve.kernel_for(problem, call, 1).config == default


def test_a_steady_call_never_waits_for_the_gpu():
    """Once a first call has checked the decay's and the offsets' values, the forward and
    backward of ``decay_attention`` never synchronize with the GPU (torch's sync debug mode
    raises if they do), so a model's step stays asynchronous. The decay is bf16, which the
    call casts anew every time: its check must still be remembered."""
    problem = Problem(1, 4, 128, 64, 64, "bfloat16")
    q, k, v = (x.requires_grad_() for x in random_qkv(problem, seed=3))
    decay = torch.tensor(retnet(4), dtype=torch.bfloat16, device="cuda")
    cu = torch.tensor([0, 100, 128], dtype=torch.int32, device="cuda")
    h0 = torch.zeros(2, 4, 64, 64, device="cuda", requires_grad=True)

    def step():
        o, final = decay_attention(q, k, v, decay, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        return torch.autograd.grad(o.float().sum() + final.sum(), (q, k, v, h0))

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
