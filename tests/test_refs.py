"""The seed's validation layers for refs/ (sections 3, 4.4 and 6), its numbers as bounds.

Chain of trust: ``recurrent`` (A, the definition) checks ``chunked`` (B), ``kernel_mimic``
(C), ``factorised`` (D) and ``parallel``; at alpha = 1 they reduce to ``plain_chunked``,
which is itself checked against A. Every check goes through ``assert_close``.
"""

import math
from collections.abc import Callable

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
        return w._replace(**{weight: getattr(w, weight) * alpha})

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
    assert refs.gamma_table(0.8, 128, torch.float16)[-1, 0] == 0


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


def test_rel_l2_propagates_nan():
    ref = torch.ones(4)
    assert refs.rel_l2(ref, ref) == 0.0
    assert refs.rel_l2(torch.tensor([1.0, 1.0, 1.0, 3.0]), ref) == pytest.approx(1.0)
    assert math.isnan(refs.rel_l2(torch.tensor([1.0, math.nan, 1.0, 1.0]), ref))
