"""The gated references (refs.gated, refs.gated_backward) in float64: A, B and C agree on odd
sizes, gates from -1e-4 to -20 per token, groups and packed sequences; the constant decay is
their special case; the backward, the gate's gradient included, is autograd through A;
fla's ``naive_recurrent_simple_gla`` is an outside oracle where fla is installed."""

import importlib.util
import math
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import Tensor

import refs
from refs.gated import gate_mask

REF_TOL = 1e-12
SEQLENS = [1, 15, 63, 130]  # 1 token, ragged chunks, several chunks
GROUPS = [(1, 1), (2, 3), (1, 4)]  # (G, r): H = G * r heads of v
F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_close(name: str, ref: Tensor, out: Tensor, ratio: float) -> None:
    err = refs.rel_l2(out, ref)
    print(f"{name}: rel L2 {err:.3e} (bound {ratio:.1e})")
    assert not math.isnan(err), f"{name}: rel L2 is NaN"
    assert err <= ratio, f"{name}: rel L2 {err:.3e} > {ratio:.1e}"


def gates(b: int, s: int, h: int, *, gen: torch.Generator, lo: float = 1e-4, hi: float = 20.0) -> Tensor:
    """Per-token log-gates from -lo to -hi, log-uniform in magnitude (fp32, as a model's)."""
    u = torch.rand(b, s, h, generator=gen, dtype=F64)
    return -torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo))).float()


def inputs(b: int, s: int, groups: int, r: int, dk: int = 8, dv: int = 6, *, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, s, groups, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, s, groups * r, dv, generator=gen)
    return q, k, v, gates(b, s, groups * r, gen=gen), gen


def forms(chunk: int, block_dv: int | None = None) -> dict:
    return {
        "B gated_chunked": partial(refs.gated_chunked, chunk=chunk),
        "C gated_kernel_mimic": partial(refs.gated_kernel_mimic, chunk=chunk, block_dv=block_dv),
    }


# ---- A = B = C ----------------------------------------------------------------------------


@pytest.mark.parametrize("groups, r", GROUPS)
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("seqlen", SEQLENS)
def test_chunked_forms_agree_with_the_recurrence(seqlen, chunk, groups, r):
    q, k, v, g, gen = inputs(2, seqlen, groups, r, seed=seqlen)
    h = groups * r
    g_gamma = -torch.rand(h, generator=gen)
    h0 = torch.randn(2, h, 8, 6, generator=gen)
    kw = dict(g_gamma=g_gamma, scale=8**-0.5, initial_state=h0, output_final_state=True)
    ref, ref_state = refs.gated_recurrent(q, k, v, g, **kw)
    assert bool(ref.isfinite().all()) and bool(ref_state.isfinite().all())
    for name, form in forms(chunk, block_dv=4).items():
        out, state = form(q, k, v, g, **kw)
        assert_close(f"{name} vs A", ref, out, REF_TOL)
        assert_close(f"{name} state vs A", ref_state, state, REF_TOL)


@pytest.mark.parametrize("cuts", [[0, 1, 17, 50], [0, 50], [0, 49, 50], [0, 16, 32, 33, 50]])
def test_packed_sequences_are_independent_calls(cuts):
    q, k, v, g, gen = inputs(1, 50, 2, 2, seed=len(cuts))
    h0 = torch.randn(len(cuts) - 1, 4, 8, 6, generator=gen)
    cu = torch.tensor(cuts)
    for name, form in {"A gated_recurrent": refs.gated_recurrent, **forms(16, block_dv=3)}.items():
        out, state = form(q, k, v, g, initial_state=h0, cu_seqlens=cu, output_final_state=True)
        for n, (a, e) in enumerate(zip(cuts, cuts[1:])):
            o_n, s_n = refs.gated_recurrent(
                q[:, a:e],
                k[:, a:e],
                v[:, a:e],
                g[:, a:e],
                initial_state=h0[n : n + 1],
                output_final_state=True,
            )
            assert_close(f"{name} {cuts} sequence {n}", o_n, out[:, a:e], REF_TOL)
            assert_close(f"{name} {cuts} state {n}", s_n, state[n : n + 1], REF_TOL)


def _reversed_recurrence(q, k, v, lg, h0, scale):
    """The definition of ``refs.gated_reversed``, token by token from the last: ``S_t =
    exp(g_{t+1}) S_{t+1} + k_t^T v_t`` (``g_T = 0``, ``S_T = h0``), ``o_t = scale q_t S_t``."""
    b, s, h, _ = v.shape
    r = h // q.shape[2]
    qh, kh = (x.to(F64).repeat_interleave(r, dim=2) for x in (q, k))
    state, out = h0.to(F64).clone(), torch.empty(b, s, h, v.shape[-1], dtype=F64)
    for t in reversed(range(s)):
        decay = torch.exp(lg[:, t + 1]) if t + 1 < s else torch.ones(b, h, dtype=F64)
        state = decay[..., None, None] * state + kh[:, t, :, :, None] * v[:, t, :, None, :].to(F64)
        out[:, t] = scale * torch.einsum("bhk,bhkv->bhv", qh[:, t], state)
    return out, state


@pytest.mark.parametrize(
    "form",
    [refs.gated_reversed, partial(refs.gated_kernel_mimic, block_dv=4, reverse=True)],
    ids=["B gated_reversed", "C gated_kernel_mimic reverse"],
)
@pytest.mark.parametrize("cuts", [None, [0, 1, 17, 50], [0, 16, 32, 33, 50]], ids=str)
@pytest.mark.parametrize("groups, r", GROUPS)
def test_reversed_is_the_recurrence_backwards_in_time(groups, r, cuts, form):
    """``gated_reversed`` and reference C with ``reverse``: each sequence's tokens from the
    last, the state decayed by the next token's gate (the gated backward's reversed passes,
    ``kernel.ops.gated_backward``)."""
    b = 2 if cuts is None else 1
    q, k, v, g, gen = inputs(b, 50, groups, r, seed=groups * r)
    h = groups * r
    g_gamma = -torch.rand(h, generator=gen)
    n = b if cuts is None else len(cuts) - 1
    h0 = torch.randn(n, h, 8, 6, generator=gen)
    cu = None if cuts is None else torch.tensor(cuts)
    out, state = form(
        q, k, v, g, 16, g_gamma=g_gamma, scale=0.3, initial_state=h0, output_final_state=True, cu_seqlens=cu
    )
    lg = g.to(F64) + g_gamma.to(F64)
    for i, (a, e) in enumerate([(0, 50)] if cuts is None else zip(cuts, cuts[1:])):
        rows = slice(None) if cuts is None else slice(i, i + 1)
        o_i, s_i = _reversed_recurrence(q[:, a:e], k[:, a:e], v[:, a:e], lg[:, a:e], h0[rows], 0.3)
        assert_close(f"reversed {cuts} sequence {i}", o_i, out[:, a:e], REF_TOL)
        assert_close(f"reversed {cuts} state {i}", s_i, state[rows], REF_TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_kernel_mimic_rounded_rounds_what_the_kernel_casts(dtype):
    """Reference C with ``rounded``: the state, the masked scores and the weighted keys in the
    inputs' dtype: within that dtype's rounding of the unrounded form, and not equal to it."""
    q, k, v, g, _ = inputs(2, 100, 1, 2, seed=3)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    args = dict(scale=0.3, output_final_state=True)
    exact = refs.gated_kernel_mimic(q, k, v, g, 16, **args)
    rounded = refs.gated_kernel_mimic(q, k, v, g, 16, rounded=dtype, **args)
    bound = 2e-3 if dtype == torch.float16 else 1.6e-2
    for name, a, b in zip(("o", "final"), rounded, exact):
        assert 0 < refs.rel_l2(a, b) < bound, (name, refs.rel_l2(a, b))


@pytest.mark.parametrize("lo, hi", [(1e-4, 1e-4), (20.0, 20.0), (1e-4, 20.0)])
def test_extreme_gates_stay_finite(lo, hi):
    """-20 per token over a 64-token chunk is exp(-1260): it underflows to zero, never to NaN."""
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 130, 2, 16, generator=gen) for _ in range(2))
    v = torch.randn(2, 130, 2, 16, generator=gen)
    g = gates(2, 130, 2, gen=gen, lo=lo, hi=hi)
    ref, ref_state = refs.gated_recurrent(q, k, v, g, output_final_state=True)
    for name, form in forms(64, block_dv=8).items():
        out, state = form(q, k, v, g, output_final_state=True)
        assert bool(out.isfinite().all()) and bool(state.isfinite().all()), name
        assert_close(f"{name} gates -{lo}..-{hi}", ref, out, REF_TOL)
    if lo == hi == 20.0:  # each token forgets all before it: o_t = (q_t . k_t) v_t
        diag = (q.double() * k.double()).sum(-1, keepdim=True) * v.double()
        assert_close("gate -20: the token alone", diag, ref, 1e-7)


def test_mask_is_exactly_zero_above_the_diagonal():
    G = torch.tensor([-20.0, -40.0, -1260.0, -1260.0001], dtype=F64).cumsum(0)
    mask = gate_mask(G)
    assert bool(mask.isfinite().all())
    assert bool((mask.triu(1) == 0).all())
    assert bool((mask.diagonal() == 1).all())
    assert bool(((mask >= 0) & (mask <= 1)).all())


# ---- special cases: the constant decay, groups, g_gamma -----------------------------------


@pytest.mark.parametrize("seqlen", SEQLENS)
def test_constant_decay_is_the_log_gate_of_alpha(seqlen):
    """g = log(alpha_h) per token reproduces refs.recurrent / chunked / kernel_mimic."""
    alpha = torch.tensor([0.99, 0.9, 0.5], dtype=F64)
    gen = torch.Generator().manual_seed(seqlen)
    q, k = (torch.randn(2, seqlen, 3, 8, generator=gen) for _ in range(2))
    v, h0 = torch.randn(2, seqlen, 3, 5, generator=gen), torch.randn(2, 3, 8, 5, generator=gen)
    g = torch.log(alpha).expand(2, seqlen, 3).contiguous()
    kw = dict(scale=0.4, initial_state=h0, output_final_state=True)
    pairs = {
        "A": (refs.recurrent(q, k, v, alpha, **kw), refs.gated_recurrent(q, k, v, g, **kw)),
        "B": (refs.chunked(q, k, v, alpha, 16, **kw), refs.gated_chunked(q, k, v, g, 16, **kw)),
        "C": (
            refs.kernel_mimic(q, k, v, alpha, 16, block_dv=2, **kw),
            refs.gated_kernel_mimic(q, k, v, g, 16, block_dv=2, **kw),
        ),
        # the same decay given as fla's g_gamma alone
        "A g_gamma": (
            refs.recurrent(q, k, v, alpha, **kw),
            refs.gated_recurrent(q, k, v, None, g_gamma=g[0, 0], **kw),
        ),
    }
    for name, ((want, want_state), (got, got_state)) in pairs.items():
        assert_close(f"{name} gated(log alpha) vs constant", want, got, REF_TOL)
        assert_close(f"{name} gated(log alpha) state vs constant", want_state, got_state, REF_TOL)


def test_constant_decay_packed():
    alpha = torch.tensor([0.95, 0.6], dtype=F64)
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, 40, 2, 8, generator=gen) for _ in range(2))
    v = torch.randn(1, 40, 2, 5, generator=gen)
    cu = torch.tensor([0, 1, 23, 40])
    g = torch.log(alpha).expand(1, 40, 2)
    want = refs.chunked(q, k, v, alpha, 8, cu_seqlens=cu, output_final_state=True)
    got = refs.gated_chunked(q, k, v, g, 8, cu_seqlens=cu, output_final_state=True)
    for w, o in zip(want, got):
        assert_close("packed gated(log alpha) vs constant", w, o, REF_TOL)


@pytest.mark.parametrize("groups, r", GROUPS[1:])
def test_head_h_reads_group_h_over_r(groups, r):
    """Grouped q and k equal q and k repeated per head, head h reading group h // r."""
    q, k, v, g, _ = inputs(2, 21, groups, r)
    qh, kh = (x.repeat_interleave(r, dim=2) for x in (q, k))
    for h in range(groups * r):
        assert torch.equal(qh[:, :, h], q[:, :, h // r])
    for name, form in {"A": refs.gated_recurrent, **forms(8)}.items():
        assert_close(f"{name} groups vs repeated heads", form(qh, kh, v, g), form(q, k, v, g), REF_TOL)


def test_g_and_g_gamma_add():
    q, k, v, g, gen = inputs(2, 19, 1, 3)
    g_gamma = -3 * torch.rand(3, generator=gen)
    for name, form in {"A": refs.gated_recurrent, **forms(8)}.items():
        assert_close(
            f"{name} g + g_gamma",
            form(q, k, v, g.double() + g_gamma.double()),
            form(q, k, v, g, g_gamma=g_gamma),
            REF_TOL,
        )


# ---- bad input: one ValueError each --------------------------------------------------------


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda q, k, v, g: (q, k, v, g[:, :-1]), "g: expected shape"),
        (lambda q, k, v, g: (q, k, v, g[..., :1]), "g: expected shape"),
        (lambda q, k, v, g: (q, k, v, g.half()), "g: expected dtype"),
        (lambda q, k, v, g: (q, k, v, g.to(torch.int32)), "g: expected dtype"),
        (lambda q, k, v, g: (q, k, v, g.to("meta")), "g: expected device"),
        (lambda q, k, v, g: (q, k, v[:, :, :5], g[..., :5]), "multiple of"),
        (lambda q, k, v, g: (q, k, v, torch.full_like(g, math.nan)), "finite"),
    ],
)
def test_bad_input_is_one_value_error(change, match):
    q, k, v, g, _ = inputs(1, 9, 2, 3)
    for form in (
        refs.gated_recurrent,
        partial(refs.gated_chunked, chunk=4),
        partial(refs.gated_kernel_mimic, chunk=4),
    ):
        with pytest.raises(ValueError, match=match):
            form(*change(q, k, v, g))


def test_bad_g_gamma_is_one_value_error():
    q, k, v, g, _ = inputs(1, 9, 2, 3)
    for bad, match in (
        (torch.zeros(5), "g_gamma: expected shape"),
        (torch.zeros(6, dtype=torch.float16), "dtype"),
    ):
        with pytest.raises(ValueError, match=match):
            refs.gated_chunked(q, k, v, g, 4, g_gamma=bad)


# ---- the backward, the gate's gradient included --------------------------------------------


def _autograd(q, k, v, g, g_gamma, h0, do, dht, **kw):
    leaves = [x.clone().double().requires_grad_() for x in (q, k, v, g, g_gamma, h0)]
    o, state = refs.gated_recurrent(
        *leaves[:4], g_gamma=leaves[4], initial_state=leaves[5], output_final_state=True, **kw
    )
    return torch.autograd.grad((o * do).sum() + (state * dht).sum(), leaves)


@pytest.mark.parametrize("groups, r", GROUPS)
@pytest.mark.parametrize("seqlen, chunk", [(37, 8), (16, 16), (1, 4), (64, 16)])
def test_backward_is_autograd_through_the_recurrence(seqlen, chunk, groups, r):
    q, k, v, g, gen = inputs(2, seqlen, groups, r, seed=seqlen)
    h = groups * r
    g_gamma = -torch.rand(h, generator=gen, dtype=F64)
    h0, dht = (torch.randn(2, h, 8, 6, generator=gen, dtype=F64) for _ in range(2))
    do = torch.randn(2, seqlen, h, 6, generator=gen, dtype=F64)
    want = _autograd(q, k, v, g, g_gamma, h0, do, dht, scale=0.3)
    got = refs.gated_chunked_backward(
        q, k, v, g, chunk, do, g_gamma=g_gamma, scale=0.3, initial_state=h0, dht=dht
    )
    for name, w, o in zip(("dq", "dk", "dv", "dg", "dg_gamma", "dh0"), want, got):
        assert o.shape == w.shape, name
        assert_close(name, w, o, REF_TOL)


def test_backward_packed_with_a_one_token_sequence():
    q, k, v, g, gen = inputs(1, 50, 2, 2, seed=9)
    cu = torch.tensor([0, 1, 17, 50])
    g_gamma = -torch.rand(4, generator=gen, dtype=F64)
    h0, dht = (torch.randn(3, 4, 8, 6, generator=gen, dtype=F64) for _ in range(2))
    do = torch.randn(1, 50, 4, 6, generator=gen, dtype=F64)
    want = _autograd(q, k, v, g, g_gamma, h0, do, dht, scale=0.5, cu_seqlens=cu)
    got = refs.gated_chunked_backward(
        q, k, v, g, 8, do, g_gamma=g_gamma, scale=0.5, initial_state=h0, dht=dht, cu_seqlens=cu
    )
    for name, w, o in zip(("dq", "dk", "dv", "dg", "dg_gamma", "dh0"), want, got):
        assert_close(f"packed {name}", w, o, REF_TOL)


def test_backward_at_extreme_gates_is_finite():
    q, k, v, _, gen = inputs(1, 130, 1, 2, seed=4)
    for lo, hi in ((1e-4, 1e-4), (20.0, 20.0), (1e-4, 20.0)):
        g = gates(1, 130, 2, gen=gen, lo=lo, hi=hi)
        do = torch.randn(1, 130, 2, 6, generator=gen, dtype=F64)
        got = refs.gated_chunked_backward(q, k, v, g, 64, do)
        assert all(bool(x.isfinite().all()) for x in got)
        want = _autograd(q, k, v, g, torch.zeros(2), torch.zeros(1, 2, 8, 6), do, torch.zeros(1, 2, 8, 6))
        assert_close(f"dg at gates -{lo}..-{hi}", want[3], got[3], REF_TOL)


# ---- fla as an outside oracle ----------------------------------------------------------------


def fla_naive():
    """fla's ``fla/ops/simple_gla/naive.py``, loaded by path: it needs torch and einops
    only, while importing the ``fla`` package needs triton (absent on a CPU machine)."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla (flash-linear-attention / fla-core) is not installed")
    pytest.importorskip("einops")
    path = Path(next(iter(spec.submodule_search_locations)), "ops", "simple_gla", "naive.py")
    module_spec = importlib.util.spec_from_file_location("fla_simple_gla_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("seqlen", [1, 63, 130])
def test_recurrent_matches_fla_naive_recurrent(seqlen):
    naive = fla_naive()
    q, k, v, g, gen = inputs(2, seqlen, 2, 2, dk=16, dv=8, seed=seqlen)
    h0 = torch.randn(2, 4, 16, 8, generator=gen)
    ref, ref_state = refs.gated_recurrent(q, k, v, g, scale=0.25, initial_state=h0, output_final_state=True)
    qh, kh = (x.repeat_interleave(2, dim=2) for x in (q, k))  # fla's simple_gla takes no groups
    out, state = naive.naive_recurrent_simple_gla(
        qh, kh, v, g, scale=0.25, initial_state=h0, output_final_state=True
    )
    assert_close("fla naive_recurrent_simple_gla vs A", ref, out, 1e-5)
    assert_close("fla naive_recurrent_simple_gla state vs A", ref_state, state, 1e-5)
