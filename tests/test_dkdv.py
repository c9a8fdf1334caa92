"""The fused dk and dv pass (``kernel.dkdv``): its chunk loop's algebra in fp64 against
autograd through reference A, when it serves, and what it compiles to (real TileLang and
nvcc, no GPU). On the GPU, ``decay_attention``'s gradients run it (tests/test_backward.py)."""

import dataclasses
import itertools

import pytest
import torch
from helpers import selected
from test_backward import CASES, DECAYS, F64, _autograd, _inputs, _ref_pass, _split_states

import refs
from kernel.arch import ARCHS
from kernel.config import Call, KernelConfig, Problem
from kernel.dkdv import MAX_STATE, smem_bytes
from kernel.ops.backward import backward
from kernel.rule import dkdv_config


def loop(q, k, v, do, decay, scale: float, start, want_final: bool, cu_seqlens, chunk: int = 16):
    """``kernel.dkdv``'s chunk loop statement by statement in fp64 (``[B, S, H, D]``
    tensors; packed: ``B = 1`` and each sequence walked alone): ``(dk, dv, final)``, the
    fused contract of ``kernel.ops.backward.backward``."""
    b, t, h, dk = q.shape
    spans = [(bb, 0, t) for bb in range(b)] if cu_seqlens is None else [
        (0, int(a), int(e)) for a, e in zip(cu_seqlens[:-1], cu_seqlens[1:])
    ]  # fmt: skip
    lg = torch.log2(decay.to(F64))[:, None, None]  # [H, 1, 1]
    i = torch.arange(chunk, dtype=F64)
    dist = i[None, :] - i[:, None]  # j - i
    gamma = torch.where(dist >= 0, scale * torch.exp2(lg * dist.clamp(min=0)), 0.0)
    grads = torch.empty_like(k), torch.empty_like(v)
    finals = []
    for n, (bb, s_begin, s_end) in enumerate(spans):
        ds = torch.zeros(h, dk, v.shape[-1], dtype=F64) if start is None else start[n].clone()
        x = [y[bb].transpose(0, 1) for y in (q, k, v, do)]  # [H, S, D]
        n_chunks = -(-(s_end - s_begin) // chunk)
        for c in range(n_chunks):
            s0 = s_begin + (n_chunks - 1 - c) * chunk
            m = min(chunk, s_end - s0)
            pad = (0, 0, 0, chunk - m)  # rows past the sequence: out of every product
            qs, ks, vs, dos = (torch.nn.functional.pad(y[:, s0 : s0 + m], pad) for y in x)
            keys = i < m
            p1 = torch.where(keys, (ks @ qs.transpose(-1, -2)) * gamma, 0.0)
            p2 = torch.where(keys, (vs @ dos.transpose(-1, -2)) * gamma, 0.0)
            rows = scale * torch.exp2(lg * (m - i).clamp(min=0)[:, None])
            acc_v = (ks @ ds) * rows + p1 @ dos
            acc_k = (vs @ ds.transpose(-1, -2)) * rows + p2 @ qs
            qw = torch.where(keys[:, None], qs * torch.exp2(lg * i[:, None]), 0.0)
            ds = ds * torch.exp2(lg * m) + qw.transpose(-1, -2) @ dos
            grads[0][bb, s0 : s0 + m] = acc_k[:, :m].transpose(0, 1)
            grads[1][bb, s0 : s0 + m] = acc_v[:, :m].transpose(0, 1)
        finals.append(ds)
    return *grads, (torch.stack(finals) if want_final else None)


@pytest.mark.parametrize("b,s,dk,dv,offsets", CASES)
@pytest.mark.parametrize("with_dht", [True, False])
def test_the_fused_loop_gives_autograd_s_gradients(b, s, dk, dv, offsets, with_dht):
    """``backward`` with the fused loop for dk and dv: autograd's gradients through
    reference A, states in and out, ragged chunks, packed sequences, alpha^C underflowing."""
    cu = None if offsets is None else torch.tensor(offsets)
    n = b if cu is None else len(offsets) - 1
    q, k, v, do, h0, dht = _inputs(b, s, len(DECAYS), dk, dv, n, seed=s + dk + 1)
    dht = dht if with_dht else None
    decay, scale = torch.tensor(DECAYS, dtype=F64), 0.3

    def fused(q_, k_, v_, do_, start, want_final, cu_):
        return loop(q_, k_, v_, do_, decay, scale, start, want_final, cu_)

    got = backward(
        _ref_pass(decay, scale),
        *(q, k, v, do, decay, scale),
        initial_state=h0,
        dht=dht,
        cu_seqlens=cu,
        want_dh0=True,
        fused=fused,
    )
    for name, g, w in zip(("dq", "dk", "dv", "dh0"), got, _autograd(q, k, v, h0, decay, scale, do, dht, cu)):
        assert g.shape == w.shape and refs.rel_l2(g, w) < 1e-12, (name, refs.rel_l2(g, w))


@pytest.mark.parametrize("s,length,chunk", [(1000, 256, 16), (300, 160, 16), (97, 32, 8), (64, 32, 16)])
def test_the_split_fused_loop_gives_autograd_s_gradients(s, length, chunk):
    """The split (``kernel.dkdv.prim_funcs``, segments > 1): the dv sweep's reversed states
    and carry on (Q, dO) give dS entering each segment from its end; the loop over each
    segment from there gives autograd's dk and dv, and segment 0's dS the dH0."""
    q, k, v, do, h0, dht = _inputs(1, s, 1, 16, 24, 1, seed=s)
    alpha, scale = 0.9, 0.3
    start = dht / (scale * alpha)  # kernel.backward's start
    garbage = [torch.randn(length, x.shape[-1], dtype=F64) for x in (q, do)]  # rows past S a tile reads
    tiles = [torch.cat([x[0, :, 0], g]) for x, g in zip((q, do), garbage)]
    states = _split_states(*tiles, alpha, start[0, 0], s, chunk, length, reverse=True)
    bounds = torch.tensor([*range(0, s, length), s])  # the segments, walked as sequences
    decay = torch.tensor([alpha], dtype=F64)
    dk, dv, final = loop(q, k, v, do, decay, scale, torch.stack(states)[:, None], True, bounds, chunk)
    want = _autograd(q, k, v, h0, decay, scale, do, dht, None)
    got = {"dk": (dk, want[1]), "dv": (dv, want[2]), "dh0": (final[:1] * scale * alpha, want[3])}
    for name, (g, w) in got.items():
        assert refs.rel_l2(g, w) < 1e-12, (name, refs.rel_l2(g, w))


def test_where_the_fused_sweep_serves():
    assert dkdv_config(Problem(8, 16, 4096, 128, 128), "sm_90a") == KernelConfig(64, 128, 2, 256, "smem")
    assert dkdv_config(Problem(1, 2, 64, 64, 64, "bfloat16"), "sm_90a") == KernelConfig(
        64, 64, 2, 256, "smem"
    )
    assert dkdv_config(Problem(2, 16, 4096, 128, 256), "sm_90a") is None  # RetNet's DV = 2 DK
    assert 128 * 256 > MAX_STATE
    for arch in set(ARCHS) - {"sm_90a"}:  # no wgmma: never timed
        assert not ARCHS[arch].wgmma and dkdv_config(Problem(8, 16, 4096, 64, 64), arch) is None
    with pytest.raises(ValueError, match="backwards in time"):
        Call(dkdv=True)


def test_the_fused_sweep_splits_where_one_block_per_head_leaves_sms_idle():
    """With the GPU's SM count the sweep takes the segment count nearest one block per SM
    without passing it, as the forward's default does; packed sequences (no SM count) run
    one pass; the backward fuses wherever the sweep serves."""
    from kernel.ops.serve import fuses

    def segments(b, h, s, sms=132):
        return dkdv_config(Problem(b, h, s, 128, 128), "sm_90a", sms).segments

    assert segments(8, 16, 4096) == 1  # 128 blocks
    assert segments(2, 16, 16384) == 4  # the H200's fastest (fused_sweep/split.json)
    assert segments(1, 8, 32768) == 16  # 128 blocks
    assert segments(1, 8, 32768, sms=108) == 8  # 128 blocks would pass 108 SMs: 64
    assert segments(1, 2, 100) == 1  # two chunks: no segment holds the two stages' pipeline
    assert dkdv_config(Problem(1, 2, 32768, 128, 128), "sm_90a") == KernelConfig(64, 128, 2, 256, "smem")
    headline = Problem(8, 16, 4096, 128, 128)
    assert fuses(headline, "sm_90a") and fuses(Problem(2, 16, 16384, 128, 128), "sm_90a")
    assert not fuses(headline, "sm_80")
    assert not fuses(Problem(8, 16, 4096, 128, 256), "sm_90a")


@pytest.mark.parametrize("packed,segments", [(False, 1), (True, 1), (False, 4)])
def test_the_fused_sweep_compiles_as_counted(packed, segments):
    """For sm_90a, states in and out: no spills, and the shared memory ``smem_bytes``
    counts (which ``dkdv_config`` holds against the architecture's limit), split or not."""
    from kernel.probe import Resources, probe

    problem = Problem(2, 3, 1 if packed else 600, 64, 128)
    config = dataclasses.replace(dkdv_config(problem, "sm_90a"), segments=segments)
    res = probe(problem, config, arch="sm_90a", call=Call(0.1, True, True, packed, reverse=True, dkdv=True))
    assert isinstance(res, Resources), res
    assert res.spill_stores == 0 and res.fits_smem, res
    assert res.dynamic_smem + 1024 == smem_bytes(problem, config) and res.static_smem <= 1024, res


def test_the_fused_sweep_is_one_kernel_or_three():
    """One pass: one kernel; split: the dv sweep's reversed states and carry, then the
    sweep per segment; packed sequences: one pass only."""
    from kernel.variants import prim_funcs

    problem, config = Problem(2, 3, 600, 64, 128), KernelConfig(64, 128, 2, 256, "smem")
    call = Call(0.1, True, True, reverse=True, dkdv=True)
    for segments, names in ((1, ["main"]), (4, ["states", "carry", "outputs"])):
        funcs = prim_funcs(problem, dataclasses.replace(config, segments=segments), call, arch="sm_90a")
        assert [f.attrs["global_symbol"] for f in funcs] == names
    packed = dataclasses.replace(call, packed=True)
    with pytest.raises(ValueError, match="one pass for packed"):
        prim_funcs(problem, dataclasses.replace(config, segments=2), packed, arch="sm_90a")


# ---- on the GPU: the kernel itself, whatever ``fuses`` picks for decay_attention ---------

GPU_CASES = [  # (problem, state in, state out, packed lengths, segments): ragged, S < C, bf16, DK != DV
    (Problem(2, 3, 1000, 128, 128), True, True, None, 1),
    (Problem(1, 2, 37, 64, 128, "bfloat16"), False, False, None, 1),
    (Problem(3, 4, 65, 128, 64), False, True, None, 1),
    (Problem(1, 4, 510, 128, 128), True, True, [1, 63, 64, 65, 300, 17], 1),
    (Problem(1, 2, 1007, 128, 128, "bfloat16"), True, False, [2, 1000, 5], 1),
    (Problem(2, 3, 1000, 128, 128), True, True, None, 4),  # a ragged last segment and chunk
    (Problem(1, 2, 300, 128, 128), False, False, None, 2),  # two segments: no carry
    (Problem(2, 2, 777, 128, 128, "bfloat16"), True, False, None, 8),  # 7 segments of 128
    (Problem(3, 2, 500, 64, 128), False, True, None, 2),
]


def _job(problem: Problem, initial: bool, final: bool, lengths, segments: int):
    call = Call(0.1, initial, final, lengths is not None, reverse=True, dkdv=True)
    config = dataclasses.replace(dkdv_config(problem, "sm_90a"), segments=segments)  # Hopper alone
    if lengths is not None:  # a packed kernel serves every T
        problem = Problem(1, problem.heads, 1, problem.dk, problem.dv, problem.dtype)
    return problem, config, call


@pytest.fixture(scope="module")
def compiled_dkdv(request) -> None:
    from kernel.builder import cuda_arch, precompile
    from kernel.probe import Resources

    if not ARCHS[cuda_arch()].wgmma:
        return  # the tests skip
    jobs = [_job(*case) for case in selected(request, "problem", "initial", "final", "lengths", "segments")]
    for res in precompile(jobs, arch=cuda_arch()):
        assert isinstance(res, Resources), res


@pytest.mark.gpu
@pytest.mark.usefixtures("compiled_dkdv")
@pytest.mark.parametrize("problem,initial,final,lengths,segments", GPU_CASES, ids=str)
def test_the_fused_sweep_matches_reference_e(problem, initial, final, lengths, segments):
    """dK, dV and dH0 of the kernel against ``refs.chunked_backward`` in fp64, outputs and
    the state NaN-filled first, on Hopper (where ``dkdv_config`` serves)."""
    from kernel.builder import build, cuda_arch
    from kernel.validate import random_qkv

    if dkdv_config(problem, cuda_arch()) is None:
        pytest.skip(f"the fused pass does not serve {cuda_arch()}")
    p = problem
    q, k, v = random_qkv(p, seed=p.seqlen)
    do = torch.randn_like(v, dtype=torch.float32).to(v.dtype)
    cu = None if lengths is None else torch.tensor([0, *itertools.accumulate(lengths)], device="cuda")
    n = p.batch if cu is None else len(lengths)
    decay = torch.tensor(DECAYS[: p.heads], device="cuda")
    h0, dht = (torch.randn(n, p.heads, p.dk, p.dv, device="cuda") for _ in range(2))
    scale = 0.1
    weight = (scale * decay)[:, None, None]  # kernel.backward's start and dH0
    start = dht / weight if initial else None
    out = torch.full_like(h0, float("nan")) if final else None
    kernel = build(*_job(p, initial, final, lengths, segments))
    dk, dv = kernel.run_dkdv(q, k, v, do, decay, start, out, None if cu is None else cu.to(torch.int32))
    _, want_dk, want_dv, want_dh0 = refs.chunked_backward(
        q, k, v, decay, 64, do, scale=scale, initial_state=h0, dht=dht if initial else None, cu_seqlens=cu
    )
    got = {"dk": (dk, want_dk), "dv": (dv, want_dv)}
    if final:
        got["dh0"] = (out * weight, want_dh0)
    for name, (g, w) in got.items():
        assert not g.isnan().any() and refs.rel_l2(g, w) < refs.TOLERANCE, (name, refs.rel_l2(g, w))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "problem,config,call",
    [
        (Problem(2, 4, 1000, 128, 128), KernelConfig(64, 128, 2, 256, segments=4), None),  # the tuner's call
        (
            Problem(1, 4, 300, 64, 128, "bfloat16"),
            KernelConfig(64, 128, 1, 256),
            Call(0.1, True, True, reverse=True, dkdv=True),
        ),
    ],
    ids=str,
)
def test_the_tuner_s_check_of_the_fused_sweep(problem, config, call):
    """``kernel.validate.check_and_time`` on a fused pass (what a ``--sweep dkdv`` trial
    measures): dK and dV (and dH0 where the call returns it) within tolerance of reference
    E, nothing left NaN, and timed."""
    from kernel.builder import build, cuda_arch
    from kernel.config import dkdv_call
    from kernel.validate import check_and_time

    if dkdv_config(problem, cuda_arch()) is None:
        pytest.skip(f"the fused pass does not serve {cuda_arch()}")
    result = check_and_time(build(problem, config, call or dkdv_call(problem)), seed=3)
    assert result["finite"] and result["nan_count"] == 0 and result["rel_l2"] < refs.TOLERANCE, result
    assert (result["state_rel_l2"] is not None) == (call is not None) and result["median_ms"] > 0
