"""Reference E, the chunked backward, against autograd through reference A in float64:
per-head decays (one that underflows, one that does not decay), the query scale, a state
in and out, ragged chunks and packed sequences."""

import pytest
import torch

import refs

DECAYS = torch.tensor([0.9, 0.05, 1.0], dtype=torch.float64)


def _inputs(b: int, s: int, seed: int, *, dk: int = 8, dv: int = 5):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, s, 3, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v, do = (torch.randn(b, s, 3, dv, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v, do, gen


def _autograd(q, k, v, do, dht, h0, *, scale, cu_seqlens=None):
    leaves = [x.clone().requires_grad_() for x in (q, k, v, h0)]
    o, state = refs.recurrent(
        *leaves[:3],
        DECAYS,
        scale=scale,
        initial_state=leaves[3],
        cu_seqlens=cu_seqlens,
        output_final_state=True,
    )
    return torch.autograd.grad((o * do).sum() + (state * dht).sum(), leaves)


@pytest.mark.parametrize("seqlen,chunk", [(37, 8), (16, 16), (5, 8), (1, 4), (64, 16)])
def test_chunked_backward_is_autograd_through_the_recurrence(seqlen, chunk):
    q, k, v, do, gen = _inputs(2, seqlen, seed=seqlen)
    h0, dht = (torch.randn(2, 3, 8, 5, generator=gen, dtype=torch.float64) for _ in range(2))
    want = _autograd(q, k, v, do, dht, h0, scale=0.3)
    got = refs.chunked_backward(q, k, v, DECAYS, chunk, do, scale=0.3, initial_state=h0, dht=dht)
    for name, w, g in zip(("dq", "dk", "dv", "dh0"), want, got):
        assert refs.rel_l2(g, w) < 1e-12, name


def test_no_state_in_or_out_is_a_zero_state_and_no_final_gradient():
    q, k, v, do, _ = _inputs(1, 20, seed=1)
    zero = torch.zeros(1, 3, 8, 5, dtype=torch.float64)
    want = _autograd(q, k, v, do, zero, zero, scale=1.0)
    got = refs.chunked_backward(q, k, v, DECAYS, 8, do)
    for w, g in zip(want, got):
        assert refs.rel_l2(g, w) < 1e-12


def test_packed_sequences_keep_their_gradients_apart():
    q, k, v, do, gen = _inputs(1, 50, seed=2)
    cu = torch.tensor([0, 1, 17, 50])
    h0, dht = (torch.randn(3, 3, 8, 5, generator=gen, dtype=torch.float64) for _ in range(2))
    want = _autograd(q, k, v, do, dht, h0, scale=0.5, cu_seqlens=cu)
    got = refs.chunked_backward(q, k, v, DECAYS, 8, do, scale=0.5, initial_state=h0, dht=dht, cu_seqlens=cu)
    for w, g in zip(want, got):
        assert refs.rel_l2(g, w) < 1e-12


def test_the_recurrence_passes_gradcheck():
    """Autograd through reference A, the yardstick above, is itself checked by finite differences."""
    q, k, v, _, gen = _inputs(1, 6, seed=3, dk=3, dv=2)
    h0 = torch.randn(1, 3, 3, 2, generator=gen, dtype=torch.float64)
    leaves = [x.requires_grad_() for x in (q, k, v, h0)]

    def f(q, k, v, h0):
        return refs.recurrent(q, k, v, DECAYS, scale=0.7, initial_state=h0, output_final_state=True)

    assert torch.autograd.gradcheck(f, leaves)


def test_a_wrong_output_gradient_is_refused():
    q, k, v, do, _ = _inputs(1, 10, seed=4)
    with pytest.raises(ValueError, match="do: expected the shape of v"):
        refs.chunked_backward(q, k, v, DECAYS, 8, do[:, :5])
