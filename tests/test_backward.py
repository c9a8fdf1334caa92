"""The backward's first kernel (``kernel.backward.chunk_grads``): it compiles for Hopper
and for Ampere here, and on a GPU it matches reference E from the chunks' states."""

import pytest
import torch

import refs
from kernel.arch import target
from kernel.backward import chunk_grads
from kernel.config import Problem, retnet_decay
from kernel.resources import _ptxas, parse_ptxas
from kernel.variants import pass_configs


def _compile(arch: str, *, run_on: str | None = None, **shape):
    import tilelang

    func = chunk_grads(chunk=64, threads=256, scale=128**-0.5, arch=arch, **shape)
    return tilelang.compile(func, target=target(arch, run_on=run_on), pass_configs=pass_configs(arch))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_chunk_grads_compile_without_spilling(arch):
    kernel = _compile(arch, batch=2, heads=4, seqlen=300, dk=128, dv=128)
    ok, log = _ptxas(kernel.get_kernel_source(), arch)
    assert ok and parse_ptxas(log)["spill_stores"] == 0, log


def test_reference_e_hands_the_kernel_each_chunk_s_states():
    """The chunks' states reference E returns: the first is the initial state, the last
    gradient is the final state's, and each state follows from the one before."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 70, 2, 4, generator=gen, dtype=torch.float64) for _ in range(4))
    h0, dht = (torch.randn(1, 2, 4, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    decay = torch.tensor([0.9, 0.5], dtype=torch.float64)
    *_, states, dstates = refs.chunked_backward(
        q, k, v, decay, 32, do, initial_state=h0, dht=dht, chunk_states=True
    )
    assert states.shape == dstates.shape == (1, 2, 3, 4, 4)
    assert torch.equal(states[:, :, 0], h0) and torch.equal(dstates[:, :, -1], dht)
    _, after_two = refs.recurrent(
        q[:, :64], k[:, :64], v[:, :64], decay, initial_state=h0, output_final_state=True
    )
    assert refs.rel_l2(states[:, :, 2], after_two) < 1e-12
    with pytest.raises(ValueError, match="packed sequences"):
        refs.chunked_backward(q, k, v, decay, 32, do, cu_seqlens=torch.tensor([0, 70]), chunk_states=True)


@pytest.mark.gpu
@pytest.mark.parametrize("lowered_for", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("dtype,seqlen", [("float16", 300), ("bfloat16", 64), ("float16", 1000)])
def test_chunk_grads_match_reference_e(lowered_for, dtype, seqlen):
    from kernel.builder import TORCH_DTYPES, cuda_arch
    from kernel.validate import random_qkv

    b, h, d = 2, 4, 128
    problem = Problem(b, h, seqlen, d, d, dtype)
    q, k, v = random_qkv(problem, seed=seqlen)
    do = torch.randn_like(v, dtype=torch.float32).to(v.dtype)
    h0, dht = (torch.randn(b, h, d, d, device="cuda") for _ in range(2))
    decay = torch.tensor(retnet_decay(h), dtype=torch.float32, device="cuda")
    *want, states, dstates = refs.chunked_backward(
        q, k, v, decay, 64, do, scale=d**-0.5, initial_state=h0, dht=dht, chunk_states=True
    )
    here = cuda_arch()
    kernel = _compile(
        lowered_for, run_on=here if lowered_for != here else None, batch=b, heads=h, seqlen=seqlen, dk=d, dv=d
    )
    grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    n = states.shape[2]
    kernel(q, k, v, do, decay, *(x.float().reshape(b * h, n, d, d) for x in (states, dstates)), *grads)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        assert got.dtype == TORCH_DTYPES[dtype] and not got.isnan().any(), name
        assert refs.rel_l2(got, ref) < refs.TOLERANCE, name
