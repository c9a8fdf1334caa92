"""The fused dk and dv sweep (``kernel.dkdv``): its chunk loop's algebra in fp64 against
autograd through reference A, when it serves, and what it compiles to (real TileLang and
nvcc, no GPU). On the GPU, ``decay_attention``'s gradients run it (tests/test_backward.py)."""

import pytest
import torch
from test_backward import CASES, DECAYS, F64, _autograd, _inputs, _ref_sweep

import refs
from kernel.arch import ARCHS
from kernel.backward import backward
from kernel.config import Call, KernelConfig, Problem
from kernel.dkdv import MAX_STATE, dkdv_config, smem_bytes


def loop(q, k, v, do, decay, scale: float, start, want_final: bool, cu_seqlens, chunk: int = 16):
    """``kernel.dkdv``'s chunk loop statement by statement in fp64 (``[B, S, H, D]``
    tensors; packed: ``B = 1`` and each sequence walked alone): ``(dk, dv, final)``, the
    fused contract of ``kernel.backward.backward``."""
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
        _ref_sweep(decay, scale),
        *(q, k, v, do, decay, scale),
        initial_state=h0,
        dht=dht,
        cu_seqlens=cu,
        want_dh0=True,
        fused=fused,
    )
    for name, g, w in zip(("dq", "dk", "dv", "dh0"), got, _autograd(q, k, v, h0, decay, scale, do, dht, cu)):
        assert g.shape == w.shape and refs.rel_l2(g, w) < 1e-12, (name, refs.rel_l2(g, w))


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


def test_the_backward_fuses_where_the_table_runs_the_sweeps_single_pass():
    """Without a table the default config splits where one block per (batch, head) falls
    short of the SMs: there the two split sweeps run (they were faster on the H200)."""
    from kernel.attention import fuses

    headline, long = Problem(8, 16, 4096, 128, 128), Problem(2, 16, 16384, 128, 128)
    assert fuses(headline, False, None, arch="sm_90a", sms=132)
    assert not fuses(long, False, None, arch="sm_90a", sms=132)
    assert fuses(long, True, None, arch="sm_90a", sms=132)  # packed: the sweeps never split
    assert not fuses(headline, False, None, arch="sm_80", sms=108)
    assert not fuses(Problem(8, 16, 4096, 128, 256), False, None, arch="sm_90a", sms=132)


@pytest.mark.parametrize("packed", [False, True])
def test_the_fused_sweep_compiles_as_counted(packed):
    """For sm_90a, states in and out: no spills, and the shared memory ``smem_bytes``
    counts (which ``dkdv_config`` holds against the architecture's limit)."""
    from kernel.resources import Resources, probe

    problem = Problem(2, 3, 1 if packed else 200, 64, 128)
    config = dkdv_config(problem, "sm_90a")
    res = probe(problem, config, arch="sm_90a", call=Call(0.1, True, True, packed, reverse=True, dkdv=True))
    assert isinstance(res, Resources), res
    assert res.spill_stores == 0 and res.fits_smem, res
    assert res.dynamic_smem + 1024 == smem_bytes(problem, config) and res.static_smem <= 1024, res
