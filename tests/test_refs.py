"""The seed's validation layers for refs/ (sections 3, 4.4 and 6), its numbers as bounds.

Chain of trust: ``recurrent`` (A, the definition) checks ``chunked`` (B), ``kernel_mimic``
(C), ``factorised`` (D) and ``parallel``; at alpha = 1 they reduce to ``plain_chunked``,
which is itself checked against A. Every check goes through ``assert_close``.
"""

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch
from torch import Tensor

import refs
import refs.chunk

# fp64 forms of one sum. The seed measures 1.6-2.0e-16 at S = 12; here B and C stay below
# 4e-16 and D reaches 1.05e-15 at alpha = 0.5, C = 64 (its alpha^-63 ~ 9e18 costs bits).
REF_TOL = 2e-15
SEQLENS = [1, 4, 12, 15, 63, 130]  # 1 token, one chunk, ragged last chunks
CHUNKS = [1, 4, 16, 64]  # 64 > most S here: a single, partial chunk
DIMS = [(4, 4), (8, 5), (16, 32)]  # (DK, DV)
ALPHAS = [0.99, 0.9, 0.5]
SEED_ALPHAS = [0.99, 0.95, 0.9, 0.8, 0.5]  # the rows of the seed's tables
DECAY_FORMS: dict[str, Callable[..., Tensor]] = {
    "B chunked": refs.chunked,
    "C kernel_mimic": refs.kernel_mimic,
    "D factorised": refs.factorised,
}


def assert_close(name: str, ref: Tensor, out: Tensor, ratio: float) -> float:
    """Fail unless rel L2 of out against ref is <= ratio; NaN always fails."""
    err = refs.rel_l2(out, ref)
    print(f"{name}: rel L2 {err:.3e} (bound {ratio:.1e})")
    assert not math.isnan(err), f"{name}: rel L2 is NaN"
    assert err <= ratio, f"{name}: rel L2 {err:.3e} > {ratio:.1e}"
    return err


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tensors here are tiny: on the 2-core box, intra-op threads made the file 8x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_qkv(b: int, s: int, h: int, dk: int, dv: int, *, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=g, dtype=dtype) for d in (dk, dk, dv))


# ---- layer 1: A, B, C, D (and the matrix form) agree in fp64 ---------------------------


def test_seed_config_all_forms_agree():
    """Seed 4.4: B=2, H=2, N=12, D=4, C=4, alpha=0.9."""
    q, k, v = make_qkv(2, 12, 2, 4, 4)
    ref = refs.recurrent(q, k, v, 0.9)
    for name, form in DECAY_FORMS.items():
        assert_close(f"{name} vs A", ref, form(q, k, v, 0.9, 4), REF_TOL)
    assert_close("parallel vs A", ref, refs.parallel(q, k, v, 0.9), REF_TOL)


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("dk, dv", DIMS)
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("seqlen", SEQLENS)
def test_chunked_forms_agree_with_recurrent(seqlen, chunk, dk, dv, alpha):
    q, k, v = make_qkv(2, seqlen, 2, dk, dv, seed=seqlen)
    ref = refs.recurrent(q, k, v, alpha)
    for name, form in DECAY_FORMS.items():
        assert_close(f"{name} vs A", ref, form(q, k, v, alpha, chunk), REF_TOL)


@pytest.mark.parametrize("block_dv", [1, 2, 3, 5, 8, 100])
def test_kernel_mimic_block_dv_split(block_dv):
    """The DV split of the kernel grid, including a ragged last DV block."""
    q, k, v = make_qkv(2, 15, 2, 6, 8)
    ref = refs.chunked(q, k, v, 0.9, 4)
    out = refs.kernel_mimic(q, k, v, 0.9, 4, block_dv=block_dv)
    assert_close(f"C block_dv={block_dv} vs B", ref, out, REF_TOL)


@pytest.mark.parametrize("seqlen", SEQLENS)
def test_parallel_form_per_token_alpha(seqlen):
    """Seed 4.4: alpha_t ~ U(0.85, 0.999), matrix vs vector form; every Gamma entry <= 1."""
    q, k, v = make_qkv(2, seqlen, 2, 4, 4, seed=seqlen)
    g = torch.Generator().manual_seed(seqlen)
    alpha_t = 0.85 + (0.999 - 0.85) * torch.rand(2, seqlen, 2, generator=g, dtype=torch.float64)
    ref = refs.recurrent(q, k, v, alpha_t)
    assert_close("parallel vs A, alpha_t", ref, refs.parallel(q, k, v, alpha_t), REF_TOL)

    gamma = refs.decay_mask(alpha_t)  # [B, H, S, S]
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
    assert bool((gamma[..., causal] > 0).all()) and bool((gamma[..., causal] <= 1).all())
    assert bool((gamma[..., ~causal] == 0).all())
    assert bool((gamma.diagonal(dim1=-2, dim2=-1) == 1).all())


def test_constant_alpha_equals_per_token_alpha():
    q, k, v = make_qkv(2, 15, 2, 4, 5)
    alpha_t = torch.full((2, 15, 2), 0.9, dtype=torch.float64)
    for form in (refs.recurrent, refs.parallel):
        assert_close(f"{form.__name__} float vs tensor", form(q, k, v, 0.9), form(q, k, v, alpha_t), 0.0)


# ---- model-ready: fla's chunk_simple_gla keywords (per-head decay, scale, state, varlen) --

TOKENS = [1, 15, 63, 300]  # fla's odd sizes: 1 token, ragged chunks, several chunks
HEAD_DECAYS = {  # alpha_h = exp(g_gamma_h)
    "retnet": [1 - 2.0 ** (-5 - h) for h in range(8)],
    "lightning": [math.exp(-(2.0 ** (-8 * (h + 1) / 8))) for h in range(8)],
    "small": [0.05, 0.5, 0.95, 1.0],
}


def all_forms(chunk: int, block_dv: int | None = None) -> dict[str, Callable[..., Any]]:
    """A, the matrix form, B, C, D with one call signature ``form(q, k, v, alpha, **kw)``."""
    return {
        "A recurrent": refs.recurrent,
        "parallel": refs.parallel,
        "B chunked": partial(refs.chunked, chunk=chunk),
        "C kernel_mimic": partial(refs.kernel_mimic, chunk=chunk, block_dv=block_dv),
        "D factorised": partial(refs.factorised, chunk=chunk),
    }


def make_state(n: int, h: int, dk: int, dv: int, *, seed: int = 1, dtype=torch.float32) -> Tensor:
    return torch.randn(n, h, dk, dv, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("seqlen", TOKENS)
def test_per_head_alpha_is_the_float_alpha_of_each_head(seqlen):
    alpha = torch.tensor([0.99, 0.7, 0.3])
    q, k, v = make_qkv(2, seqlen, 3, 8, 5, seed=seqlen)
    s0 = make_state(2, 3, 8, 5)
    for name, form in all_forms(16, block_dv=2).items():
        out, state = form(q, k, v, alpha, initial_state=s0, output_final_state=True)
        for h in range(3):
            one = (x[:, :, h : h + 1] for x in (q, k, v))
            o_h, s_h = form(*one, alpha[h].item(), initial_state=s0[:, h : h + 1], output_final_state=True)
            assert_close(f"{name} head {h} vs float alpha", o_h, out[:, :, h : h + 1], REF_TOL)
            assert_close(f"{name} head {h} state vs float alpha", s_h, state[:, h : h + 1], REF_TOL)


@pytest.mark.parametrize("decays", HEAD_DECAYS.values(), ids=HEAD_DECAYS.keys())
@pytest.mark.parametrize("seqlen", TOKENS)
def test_model_head_decays_all_forms_agree(seqlen, decays):
    """RetNet's gammas, Lightning's slopes and a fast 0.05 head; D's alpha^-63 <= 1e82 here."""
    h = len(decays)
    alpha = torch.tensor(decays, dtype=torch.float64)
    assert bool(((alpha > 0) & (alpha <= 1)).all())
    q, k, v = make_qkv(2, seqlen, h, 16, 12, seed=seqlen)
    s0 = make_state(2, h, 16, 12)
    ref, ref_state = refs.recurrent(q, k, v, alpha, initial_state=s0, output_final_state=True)
    tol = REF_TOL * (2 if seqlen > 150 else 1)  # the parallel form's state: 2.1e-15 at T = 300
    for name, form in list(all_forms(64).items())[1:]:
        out, state = form(q, k, v, alpha, initial_state=s0, output_final_state=True)
        assert bool(out.isfinite().all()) and bool(state.isfinite().all())
        for i in range(h):  # per head: a fast-decaying head's error is not hidden by the others
            assert_close(f"{name} head {i} vs A", ref[:, :, i], out[:, :, i], tol)
            assert_close(f"{name} head {i} state vs A", ref_state[:, i], state[:, i], tol)


@pytest.mark.parametrize("scale", [0.25, 16**-0.5, -3.0])
def test_scale_is_scaling_the_queries(scale):
    q, k, v = make_qkv(2, 37, 3, 16, 6)
    alpha = torch.tensor([0.9, 0.99, 0.5])
    for name, form in all_forms(16, block_dv=4).items():
        out = form(q, k, v, alpha, scale=scale)
        assert_close(f"{name} scale={scale:.3f}", form(q.double() * scale, k, v, alpha), out, REF_TOL)


@pytest.mark.parametrize("cuts", [[0, 63], [0, 20, 63], [0, 17, 18, 63], [0, 1, 50, 63]])
def test_state_carries_a_sequence_cut_into_pieces(cuts):
    """Final state of one piece as initial_state of the next == one call, for every form."""
    q, k, v = make_qkv(2, 63, 3, 8, 6, seed=7)
    alpha = torch.tensor([0.95, 0.6, 1.0])
    s0 = make_state(2, 3, 8, 6)
    for name, form in all_forms(16, block_dv=4).items():
        whole, whole_state = form(q, k, v, alpha, initial_state=s0, output_final_state=True)
        outs, state = [], s0
        for a, e in zip(cuts, cuts[1:]):
            out, state = form(
                q[:, a:e], k[:, a:e], v[:, a:e], alpha, initial_state=state, output_final_state=True
            )
            outs.append(out)
        assert_close(f"{name} {cuts} outputs", whole, torch.cat(outs, dim=1), REF_TOL)
        assert_close(f"{name} {cuts} final state", whole_state, state, REF_TOL)
        assert state.dtype == torch.float64 and tuple(state.shape) == (2, 3, 8, 6)


def test_initial_state_matters_and_zero_is_none():
    q, k, v = make_qkv(2, 15, 2, 4, 5)
    s0 = make_state(2, 2, 4, 5, dtype=torch.bfloat16)  # any float dtype, used in fp64
    for name, form in all_forms(4).items():
        plain = form(q, k, v, 0.9)
        assert_close(f"{name} zero state vs none", plain, form(q, k, v, 0.9, initial_state=0 * s0), 0.0)
        err = refs.rel_l2(form(q, k, v, 0.9, initial_state=s0), plain)
        print(f"{name}: initial state moves the output by rel L2 {err:.3e}")
        assert err > 1e-2
        assert_close(
            f"{name} bf16 state",
            form(q, k, v, 0.9, initial_state=s0.double()),
            form(q, k, v, 0.9, initial_state=s0),
            0.0,
        )


def test_final_state_is_the_definition():
    """S_T = prod(alpha) S_0 + sum_t alpha^(T-1-t) k_t^T v_t, per head, with a ragged last chunk."""
    q, k, v = make_qkv(1, 21, 2, 4, 3, dtype=torch.float64)
    alpha = torch.tensor([0.8, 0.97], dtype=torch.float64)
    s0 = make_state(1, 2, 4, 3, dtype=torch.float64)
    w = alpha[None, :] ** torch.arange(20, -1, -1, dtype=torch.float64)[:, None]  # [T, H]
    expected = alpha[:, None, None] ** 21 * s0 + torch.einsum("th,bthk,bthv->bhkv", w, k, v)
    for name, form in all_forms(8).items():
        _, state = form(q, k, v, alpha, initial_state=s0, output_final_state=True)
        assert_close(f"{name} final state", expected, state, REF_TOL)


VARLEN = {  # sequence lengths: 1 token, ragged and whole chunks (C = 16)
    "ragged": [1, 15, 17, 64, 3],
    "single": [63],
    "ones": [1, 1, 1],
    "long": [300, 1, 33],
}


@pytest.mark.parametrize("lengths", VARLEN.values(), ids=VARLEN.keys())
def test_cu_seqlens_is_each_sequence_on_its_own(lengths):
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    n, t = len(lengths), sum(lengths)
    q, k, v = make_qkv(1, t, 3, 8, 6, seed=t)
    alpha = torch.tensor([0.95, 0.5, 0.999])
    s0 = make_state(n, 3, 8, 6)
    for name, form in all_forms(16, block_dv=4).items():
        out, state = form(q, k, v, alpha, initial_state=s0, cu_seqlens=cu, output_final_state=True)
        assert (tuple(out.shape), tuple(state.shape)) == ((1, t, 3, 6), (n, 3, 8, 6))
        for i, (a, e) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
            one = (x[:, a:e] for x in (q, k, v))
            o_i, s_i = form(*one, alpha, initial_state=s0[i : i + 1], output_final_state=True)
            assert_close(f"{name} sequence {i} output", o_i, out[:, a:e], REF_TOL)
            assert_close(f"{name} sequence {i} state", s_i, state[i : i + 1], REF_TOL)
        assert_close(
            f"{name} no initial state",
            refs.recurrent(q, k, v, alpha, cu_seqlens=cu),
            form(q, k, v, alpha, cu_seqlens=cu),
            REF_TOL,
        )


def test_cu_seqlens_no_leak():
    """New tokens and initial state in sequence 1 leave sequences 0 and 2 bit-identical."""
    cu = torch.tensor([0, 17, 18, 50])
    q, k, v = make_qkv(1, 50, 2, 8, 4)
    s0 = make_state(3, 2, 8, 4)
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    s2 = s0.clone()
    for x in (q2, k2, v2):
        x[:, 17] = 100.0
    s2[1] = -7.0
    keep = torch.ones(50, dtype=torch.bool)
    keep[17] = False
    for name, form in all_forms(16, block_dv=4).items():
        out, state = form(q, k, v, 0.9, initial_state=s0, cu_seqlens=cu, output_final_state=True)
        out2, state2 = form(q2, k2, v2, 0.9, initial_state=s2, cu_seqlens=cu, output_final_state=True)
        assert torch.equal(out[:, keep], out2[:, keep]), name
        assert torch.equal(state[[0, 2]], state2[[0, 2]]), name
        assert not torch.equal(out[:, 17], out2[:, 17]) and not torch.equal(state[1], state2[1]), name


def test_cu_seqlens_with_per_token_alpha():
    cu = torch.tensor([0, 5, 20])
    q, k, v = make_qkv(1, 20, 2, 4, 4)
    alpha_t = 0.8 + 0.2 * torch.rand(1, 20, 2, generator=torch.Generator().manual_seed(0))
    for form in (refs.recurrent, refs.parallel):
        out = form(q, k, v, alpha_t, cu_seqlens=cu)
        parts = [form(q[:, a:e], k[:, a:e], v[:, a:e], alpha_t[:, a:e]) for a, e in [(0, 5), (5, 20)]]
        assert_close(f"{form.__name__} alpha_t varlen", torch.cat(parts, dim=1), out, REF_TOL)


def test_recurrent_matches_fla_naive():
    """fla-core's own fp32 references (fla.ops.simple_gla.naive), where fla is installed."""
    naive = pytest.importorskip("fla.ops.simple_gla.naive")
    b, t, h, dk, dv = 2, 63, 4, 16, 8
    q, k, v = make_qkv(b, t, h, dk, dv)
    g_gamma = torch.log(torch.tensor([0.05, 0.9, 0.99, 1.0]))
    s0 = make_state(b, h, dk, dv)
    ref, ref_state = refs.recurrent(
        q, k, v, g_gamma.exp(), scale=dk**-0.5, initial_state=s0, output_final_state=True
    )
    g = g_gamma.expand(b, t, h)  # fla's per-token log decay
    out, state = naive.naive_recurrent_simple_gla(q, k, v, g, initial_state=s0, output_final_state=True)
    assert_close("fla naive_recurrent vs A", ref, out, 1e-5)
    assert_close("fla naive_recurrent state vs A", ref_state, state, 1e-5)
    out, state = naive.naive_chunk_simple_gla(
        q, k, v, g, initial_state=s0, output_final_state=True, chunk_size=16
    )
    assert_close("fla naive_chunk vs A", ref, out, 1e-5)
    assert_close("fla naive_chunk state vs A", ref_state, state, 1e-5)


# ---- layer 2: degeneration at alpha = 1, and why it is not enough alone ---------------


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("seqlen", SEQLENS)
def test_alpha_one_reduces_to_plain_chunked(seqlen, chunk):
    q, k, v = make_qkv(2, seqlen, 2, 8, 5, seed=seqlen)
    plain = refs.plain_chunked(q, k, v, chunk)
    assert_close("plain vs A(alpha=1)", refs.recurrent(q, k, v, 1.0), plain, REF_TOL)
    for name, form in DECAY_FORMS.items():
        assert_close(f"{name}(alpha=1) vs plain", plain, form(q, k, v, 1.0, chunk), REF_TOL)


def _exponent_plus_one(weight: str):
    """``chunk_weights`` with one weight's exponent off by one (multiplied by alpha)."""
    real = refs.chunk.chunk_weights

    def wrong(alpha, chunk, **kwargs):
        w = real(alpha, chunk, **kwargs)
        table, a = getattr(w, weight), torch.as_tensor(alpha, dtype=torch.float64)  # per head: [H]
        return w._replace(**{weight: table * a.reshape(a.shape + (1,) * (table.dim() - a.dim()))})

    return wrong


@pytest.mark.parametrize("form", ["chunked", "kernel_mimic"])
@pytest.mark.parametrize("weight", ["gamma", "w_decay", "w_query", "state_decay"])
def test_off_by_one_passes_alpha_one_but_fails_alpha_09(monkeypatch, form, weight):
    """Seed 4.4: e.g. w_decay = alpha^(C-r) instead of alpha^(C-1-r) is 1 at alpha = 1."""
    q, k, v = make_qkv(2, 12, 2, 4, 4)
    monkeypatch.setattr(refs.chunk, "chunk_weights", _exponent_plus_one(weight))
    fn = getattr(refs, form)
    plain = refs.plain_chunked(q, k, v, 4)
    assert_close(f"wrong {weight}: {form}(alpha=1) vs plain", plain, fn(q, k, v, 1.0, 4), REF_TOL)
    err = refs.rel_l2(fn(q, k, v, 0.9, 4), refs.recurrent(q, k, v, 0.9))
    print(f"wrong {weight}: {form}(alpha=0.9) vs A: rel L2 {err:.3e}")
    assert err > 1e-3  # a correct reference is at ~2e-16: the cross-check catches it


# ---- layer 3: the fp16 failure map of the factorised form (seed 3.1) ------------------


@pytest.mark.parametrize("alpha", SEED_ALPHAS)
def test_intra_chunk_fp16_failure_map(alpha):
    """C = 64, DK = DV = 64, fp16 storage + fp32 accumulation, median of 20 inputs."""
    q, k, v = make_qkv(20, 64, 1, 64, 64, dtype=torch.float64)
    ref = refs.recurrent(q, k, v, alpha)

    def median_rel_l2(out: Tensor) -> float:
        return torch.tensor([refs.rel_l2(out[b], ref[b]) for b in range(20)]).median().item()

    ratio = refs.intra_chunk(q, k, v, alpha, form="ratio")
    assert bool(ratio.isfinite().all())
    err = median_rel_l2(ratio)
    print(f"alpha={alpha} ratio form: median rel L2 {err:.3e}")
    assert 1e-4 <= err <= 1e-3  # seed: 4.1-4.6e-4 for every alpha

    fact = refs.intra_chunk(q, k, v, alpha, form="factorised")
    if alpha <= 0.8:  # alpha^-63 >= 1.27e6 > 65504: inf, then inf - inf / inf * 0
        assert bool(fact.isnan().any())
        assert math.isnan(refs.rel_l2(fact, ref))
    else:
        assert bool(fact.isfinite().all())
        err = median_rel_l2(fact)
        print(f"alpha={alpha} factorised form: median rel L2 {err:.3e}")
        assert err < 1e-3


# ---- the seed's arithmetic tables, with its rounding ----------------------------------


def printed_as(x: float, printed: float) -> bool:
    """Whether the seed's 3-significant-digit figure ``printed`` stands for x.

    Half a unit of the last digit, plus a tenth for the seed's double rounding: it prints
    0.9^127 = 1.5445e-6 as 1.55e-6 (1.5445 -> 1.545 -> 1.55).
    """
    unit = 10.0 ** (math.floor(math.log10(abs(printed))) - 2)
    return abs(x - printed) <= 0.55 * unit


@pytest.mark.parametrize(
    "alpha, peaks, fp16_limit, fp32_limit",
    [  # seed 3: alpha^-31, alpha^-63, alpha^-127 and the "C < limit" columns
        (0.99, (1.37, 1.88, 3.58), 1103, 8827),
        (0.95, (4.90, 25.3, 675), 216, 1729),
        (0.90, (26.2, 763, 6.47e5), 105, 842),
        (0.80, (1.01e3, 1.27e6, 2.03e12), 49, 397),
        (0.50, (2.15e9, 9.22e18, 1.70e38), 15, 127),
    ],
)
def test_factorised_overflow_table(alpha, peaks, fp16_limit, fp32_limit):
    assert all(printed_as(refs.factorised_peak(alpha, c), p) for c, p in zip((32, 64, 128), peaks))
    for dtype, limit in [(torch.float16, fp16_limit), (torch.float32, fp32_limit)]:
        assert refs.factorised_safe_chunk_limit(alpha, dtype) == limit
        # the exact edge: alpha^-limit is finite, alpha^-(limit+1) is not
        top = torch.finfo(dtype).max
        assert refs.factorised_peak(alpha, limit + 1) <= top < refs.factorised_peak(alpha, limit + 2)


@pytest.mark.parametrize(
    "alpha, pow64, tokens",
    [
        (0.999, 9.38e-1, 6904),
        (0.99, 5.26e-1, 687),
        (0.95, 3.75e-2, 135),
        (0.90, 1.18e-3, 66),
        (0.50, 5.42e-20, 10),
    ],
)
def test_effective_memory_length_table(alpha, pow64, tokens):
    """Seed 6: L = ln(1e-3) / ln(alpha), printed rounded to the nearest token."""
    assert printed_as(alpha**64, pow64)
    assert round(refs.effective_memory_length(alpha)) == tokens


@pytest.mark.parametrize(
    "alpha, corner64, class64, corner128, class128",
    [  # seed 3.2: alpha^(C-1) and its fate in fp16
        (0.99, 5.31e-1, "normal", 2.79e-1, "normal"),
        (0.95, 3.95e-2, "normal", 1.48e-3, "normal"),
        (0.90, 1.31e-3, "normal", 1.55e-6, "subnormal"),
        (0.80, 7.85e-7, "subnormal", 4.93e-13, "zero"),
        (0.50, 1.08e-19, "zero", 5.88e-39, "zero"),
    ],
)
def test_gamma_corner_in_fp16_table(alpha, corner64, class64, corner128, class128):
    for chunk, corner, fate in [(64, corner64, class64), (128, corner128, class128)]:
        assert printed_as(alpha ** (chunk - 1), corner)
        stats = refs.gamma_underflow(alpha, chunk, torch.float16)
        assert stats.corner_class == fate
        assert (stats.corner == 0) == (fate == "zero")
        assert stats.max == 1.0


@pytest.mark.parametrize("alpha, min_nonzero", [(0.99, 2.79e-1), (0.90, 1.55e-6), (0.50, 5.88e-39)])
def test_gamma_fp32_table_never_underflows(alpha, min_nonzero):
    """Seed 3.1: in fp32 at C = 128, max 1.000, smallest weight as printed, 0% underflow."""
    stats = refs.gamma_underflow(alpha, 128, torch.float32)
    assert (stats.max, stats.underflow_fraction) == (1.0, 0.0)
    assert printed_as(stats.min_nonzero, min_nonzero)
    # the seed calls 5.88e-39 "still normal in fp32"; it is below fp32's 1.18e-38: subnormal
    assert stats.corner_class == ("subnormal" if alpha == 0.5 else "normal")


def test_gamma_fp16_underflow_fraction():
    """0.8 at C = 128 in fp16: weights alpha^d below half the smallest subnormal round to 0."""
    stats = refs.gamma_underflow(0.8, 128, torch.float16)
    d0 = math.ceil(math.log(2.0**-25) / math.log(0.8))  # first distance that rounds to 0
    zeros = sum(128 - d for d in range(d0, 128))  # causal entries at distance i - j >= d0
    assert stats.underflow_fraction == pytest.approx(zeros / (128 * 129 / 2))
    assert refs.gamma_matrix(0.8, 128, torch.float16)[-1, 0] == 0


# ---- contracts: dtype, shape, validation, metric ---------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
def test_outputs_are_float64_in_kernel_layout(dtype):
    q, k, v = make_qkv(2, 7, 3, 4, 6, dtype=dtype)
    outs = [form(q, k, v, 0.9, 4) for form in DECAY_FORMS.values()]
    outs += [refs.recurrent(q, k, v, 0.9), refs.parallel(q, k, v, 0.9), refs.plain_chunked(q, k, v, 4)]
    for out in outs:
        assert (out.dtype, tuple(out.shape)) == (torch.float64, (2, 7, 3, 6))


def test_forms_stay_on_the_inputs_device():
    """Shape-only run on the meta device: any tensor made on the CPU would raise."""
    q, k, v = (torch.empty(2, 9, 2, d, device="meta") for d in (4, 4, 6))
    for out in [form(q, k, v, 0.9, 4) for form in DECAY_FORMS.values()] + [refs.plain_chunked(q, k, v, 4)]:
        assert (out.device.type, out.dtype, tuple(out.shape)) == ("meta", torch.float64, (2, 9, 2, 6))
    s0 = torch.empty(2, 2, 4, 6, device="meta")
    for form in all_forms(4, block_dv=4).values():
        out, state = form(q, k, v, 0.9, scale=0.5, initial_state=s0, output_final_state=True)
        assert (state.device.type, state.dtype, tuple(state.shape)) == ("meta", torch.float64, (2, 2, 4, 6))


_q, _k, _v = make_qkv(1, 8, 2, 4, 3)
BAD_CALLS = {
    "alpha 0": lambda: refs.chunked(_q, _k, _v, 0.0, 4),
    "alpha 1.5": lambda: refs.kernel_mimic(_q, _k, _v, 1.5, 4),
    "alpha nan": lambda: refs.recurrent(_q, _k, _v, math.nan),
    "alpha_t shape": lambda: refs.recurrent(_q, _k, _v, torch.full((1, 8, 3), 0.9)),
    "alpha_t value 0": lambda: refs.parallel(_q, _k, _v, torch.zeros(1, 8, 2)),
    "k shape": lambda: refs.chunked(_q, _k[:, :7], _v, 0.9, 4),
    "v shape": lambda: refs.factorised(_q, _k, _v[:, :, :1], 0.9, 4),
    "q 3 dims": lambda: refs.plain_chunked(_q[0], _k[0], _v[0], 4),
    "chunk 0": lambda: refs.chunked(_q, _k, _v, 0.9, 0),
    "block_dv 0": lambda: refs.kernel_mimic(_q, _k, _v, 0.9, 4, block_dv=0),
    "form": lambda: refs.intra_chunk(_q, _k, _v, 0.9, form="mixed"),
    "rel_l2 shapes": lambda: refs.rel_l2(_q, _v),
    "eps": lambda: refs.effective_memory_length(0.9, eps=1.0),
    "no tokens": lambda: refs.recurrent(_q[:, :0], _k[:, :0], _v[:, :0], 0.9),
    "alpha_h length": lambda: refs.chunked(_q, _k, _v, torch.full((3,), 0.9), 4),
    "alpha_h value 0": lambda: refs.kernel_mimic(_q, _k, _v, torch.tensor([0.9, 0.0]), 4),
    "alpha_h value 1.5": lambda: refs.factorised(_q, _k, _v, torch.tensor([1.5, 0.9]), 4),
    "alpha_h nan": lambda: refs.recurrent(_q, _k, _v, torch.tensor([0.9, math.nan])),
    "alpha_t in B": lambda: refs.chunked(_q, _k, _v, torch.full((1, 8, 2), 0.9), 4),
    "alpha 0-d tensor": lambda: refs.parallel(_q, _k, _v, torch.tensor(0.9)),
    "scale inf": lambda: refs.chunked(_q, _k, _v, 0.9, 4, scale=math.inf),
    "state DV": lambda: refs.chunked(_q, _k, _v, 0.9, 4, initial_state=torch.zeros(1, 2, 4, 4)),
    "state batch": lambda: refs.recurrent(_q, _k, _v, 0.9, initial_state=torch.zeros(2, 2, 4, 3)),
    "state 3 dims": lambda: refs.kernel_mimic(_q, _k, _v, 0.9, 4, initial_state=torch.zeros(2, 4, 3)),
    "state int": lambda: refs.factorised(
        _q, _k, _v, 0.9, 4, initial_state=torch.zeros(1, 2, 4, 3, dtype=int)
    ),
    "cu start": lambda: refs.chunked(_q, _k, _v, 0.9, 4, cu_seqlens=torch.tensor([1, 8])),
    "cu end": lambda: refs.kernel_mimic(_q, _k, _v, 0.9, 4, cu_seqlens=torch.tensor([0, 4, 7])),
    "cu past T": lambda: refs.recurrent(_q, _k, _v, 0.9, cu_seqlens=torch.tensor([0, 4, 9])),
    "cu empty sequence": lambda: refs.factorised(_q, _k, _v, 0.9, 4, cu_seqlens=torch.tensor([0, 4, 4, 8])),
    "cu decreasing": lambda: refs.parallel(_q, _k, _v, 0.9, cu_seqlens=torch.tensor([0, 5, 3, 8])),
    "cu float": lambda: refs.chunked(_q, _k, _v, 0.9, 4, cu_seqlens=torch.tensor([0.0, 8.0])),
    "cu 2 dims": lambda: refs.chunked(_q, _k, _v, 0.9, 4, cu_seqlens=torch.tensor([[0, 8]])),
    "cu one offset": lambda: refs.chunked(_q, _k, _v, 0.9, 4, cu_seqlens=torch.tensor([0])),
    "cu batch 2": lambda: refs.chunked(*make_qkv(2, 8, 2, 4, 3), 0.9, 4, cu_seqlens=torch.tensor([0, 8])),
    "cu state count": lambda: refs.kernel_mimic(
        _q, _k, _v, 0.9, 4, cu_seqlens=torch.tensor([0, 3, 8]), initial_state=torch.zeros(1, 2, 4, 3)
    ),
}


@pytest.mark.parametrize("call", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_bad_input_raises_value_error(call):
    with pytest.raises(ValueError, match="expected"):
        call()


@pytest.mark.gpu
def test_kernel_mimic_runs_on_cuda():
    q, k, v = make_qkv(2, 300, 2, 64, 48)
    out = refs.kernel_mimic(q.cuda(), k.cuda(), v.cuda(), 0.9, 64, block_dv=32)
    assert out.device.type == "cuda"
    assert_close("C on cuda vs A on cpu", refs.recurrent(q, k, v, 0.9), out.cpu(), REF_TOL)
    # the model-ready keywords: per-head decay, scale, initial state, packed sequences
    q, k, v = (x[:1] for x in (q, k, v))
    alpha, cu, s0 = torch.tensor([0.9, 0.5]), torch.tensor([0, 1, 100, 300]), make_state(3, 2, 64, 48)
    kw = dict(scale=0.125, initial_state=s0, cu_seqlens=cu, output_final_state=True)
    ref, ref_state = refs.recurrent(q, k, v, alpha, **kw)
    for name, form in list(all_forms(64, block_dv=32).items())[1:]:
        out, state = form(*(x.cuda() for x in (q, k, v)), alpha.cuda(), **{**kw, "initial_state": s0.cuda()})
        assert out.device.type == state.device.type == "cuda"
        assert_close(f"{name} on cuda vs A on cpu", ref, out.cpu(), REF_TOL)
        assert_close(f"{name} state on cuda vs A on cpu", ref_state, state.cpu(), REF_TOL)


def test_rel_l2_propagates_nan():
    ref = torch.ones(4)
    assert refs.rel_l2(ref, ref) == 0.0
    assert refs.rel_l2(torch.tensor([1.0, 1.0, 1.0, 3.0]), ref) == pytest.approx(1.0)
    assert math.isnan(refs.rel_l2(torch.tensor([1.0, math.nan, 1.0, 1.0]), ref))
