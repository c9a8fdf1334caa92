"""tuner.peers: the plain-torch peer against reference A, in the model form (the fla peer
needs a GPU: ``test_bench_gpu`` checks it)."""

import pytest
import torch

import refs
from kernel.config import retnet_decay
from tuner.peers import torch_chunked

DECAYS = {
    "one alpha": [0.9] * 3,
    "retnet": list(retnet_decay(3)),
    "mixed": [1.0, 0.99, 0.5],
}


@pytest.mark.parametrize("decay", DECAYS.values(), ids=DECAYS.keys())
def test_torch_chunked_matches_recurrence(decay):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 192, 3, 32, generator=gen) for _ in range(2))
    v = torch.randn(2, 192, 3, 16, generator=gen)
    decay = torch.tensor(decay)
    o, state = torch_chunked(q, k, v, decay, scale=32**-0.5, chunk=64)
    ref, ref_state = refs.recurrent(q, k, v, decay, scale=32**-0.5, output_final_state=True)
    assert refs.rel_l2(o, ref) < 1e-6 and refs.rel_l2(state, ref_state) < 1e-6
    assert state.dtype == torch.float32 and state.shape == (2, 3, 32, 16)


def test_torch_chunked_rejects_ragged():
    q = torch.randn(1, 100, 1, 16)
    with pytest.raises(ValueError, match="multiple of chunk"):
        torch_chunked(q, q, q, torch.tensor([0.9]), scale=1.0)
