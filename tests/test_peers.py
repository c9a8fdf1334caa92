"""tuner.peers: the plain-torch peer against reference A (the fla peer needs a GPU: tuner
bench checks it)."""

import pytest
import torch

import refs
from tuner.peers import torch_chunked


@pytest.mark.parametrize("alpha", [1.0, 0.99, 0.9, 0.5])
def test_torch_chunked_matches_recurrence(alpha):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 192, 3, 32, generator=gen) for _ in range(2))
    v = torch.randn(2, 192, 3, 16, generator=gen)
    assert refs.rel_l2(torch_chunked(q, k, v, alpha, chunk=64), refs.recurrent(q, k, v, alpha)) < 1e-6


def test_torch_chunked_rejects_ragged():
    q = torch.randn(1, 100, 1, 16)
    with pytest.raises(ValueError, match="multiple of chunk"):
        torch_chunked(q, q, q, 0.9)
