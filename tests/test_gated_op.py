"""decay_attention's gated calls (kernel.ops.gated): without a GPU, the custom op's schema,
its fake implementation's shapes (what torch.compile traces) and one ValueError per bad
input, nothing launched; on a GPU (marked ``gpu``), the op against references B and C in
fp64 (dense and packed, groups, g with a decay beside it or not, states in and out),
eagerly through a kept plan and under ``torch.compile(fullgraph=True)``, and against fla's
``chunk_simple_gla`` where fla is installed."""

import itertools
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import refs
from kernel.config import KernelConfig, Problem
from kernel.ops.attention import decay_attention


def meta(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


Q, V, G = meta(1, 8, 2, 64), meta(1, 8, 6, 32), meta(1, 8, 6, dtype=torch.float32)


def test_the_custom_op_is_registered_with_its_schema():
    schema = str(torch.ops.decay_tuner.gated_attention.default._schema)
    assert schema.startswith(
        "decay_tuner::gated_attention(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? decay"
    )
    assert schema.endswith("-> (Tensor, Tensor)")


@pytest.mark.parametrize("final", [True, False])
@pytest.mark.parametrize("decay", [None, 0.9, "tensor"])
def test_fake_tensors_give_the_shapes_torch_compile_traces(final, decay):
    with FakeTensorMode():
        q = torch.empty(2, 100, 2, 128, dtype=torch.bfloat16, device="cuda")
        v = torch.empty(2, 100, 8, 64, dtype=torch.bfloat16, device="cuda")
        g = torch.empty(2, 100, 8, device="cuda")
        alphas = torch.full((8,), 0.9, device="cuda") if decay == "tensor" else decay
        o, state = decay_attention(q, q, v, alphas, g=g, output_final_state=final)
        assert o.shape == (2, 100, 8, 64) and o.dtype == torch.bfloat16
        assert (state.shape, state.dtype) == ((2, 8, 128, 64), torch.float32) if final else state is None


def test_fake_tensors_give_the_packed_shapes_and_groups_without_g():
    with FakeTensorMode():
        q = torch.empty(1, 700, 1, 64, dtype=torch.float16, device="cuda")
        v = torch.empty(1, 700, 4, 64, dtype=torch.float16, device="cuda")
        cu = torch.empty(6, dtype=torch.int32, device="cuda")
        g = torch.empty(1, 700, 4, device="cuda")
        o, state = decay_attention(q, q, v, g=g, output_final_state=True, cu_seqlens=cu)
        assert o.shape == (1, 700, 4, 64) and state.shape == (5, 4, 64, 64)
        o, state = decay_attention(
            q, q, v, 0.9, initial_state=torch.empty(5, 4, 64, 64, device="cuda"), cu_seqlens=cu
        )
        assert o.shape == (1, 700, 4, 64) and state is None


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: decay_attention(Q, Q, V, g=meta(1, 8, 5, dtype=torch.float32)),
            r"g must be shaped \[B, S, H\]",
        ),
        (lambda: decay_attention(Q, Q, V, g=meta(1, 8, 6)), "g must be float32"),
        (lambda: decay_attention(Q, Q, V, g=torch.zeros(1, 8, 6)), "g is on cpu but q is on meta"),
        (lambda: decay_attention(Q, Q, V, g=[0.0] * 8), "g must be a tensor"),
        (
            lambda: decay_attention(Q, Q, meta(1, 8, 5, 32), g=G),
            "multiple of q and k's groups G = 2, got H = 5",
        ),
        (
            lambda: decay_attention(Q, Q, meta(1, 8, 5, 32), 0.9),
            "multiple of q and k's groups G = 2, got H = 5",
        ),
        (lambda: decay_attention(Q, meta(1, 8, 3, 64), V, g=G), "k must be shaped as q"),
        (lambda: decay_attention(Q, Q, meta(1, 9, 6, 32), g=G), "k must be shaped as q"),
        (lambda: decay_attention(Q, Q, V, 1.5, g=G), r"decay must be in \(0, 1\]"),
        (lambda: decay_attention(Q, Q, V, meta(2), g=G), r"decay must be a float or a tensor of 6 alphas"),
        (lambda: decay_attention(Q, Q, V, None), "decay must be a float"),
        (
            lambda: decay_attention(Q, Q, V, g=G, initial_state=meta(1, 2, 64, 32)),
            "initial_state must be float32",
        ),
        (
            lambda: decay_attention(Q, Q, V, g=G, cu_seqlens=meta(3, dtype=torch.float32)),
            "cu_seqlens must be an int32",
        ),
        (
            lambda: decay_attention(Q, Q, V, g=G, pool=meta(4, 6, 64, 32), slots=meta(1), from_pool=meta(1)),
            "a pool call .* takes no g",
        ),
        (lambda: decay_attention(Q, Q, V, g=G, scale=math.nan), "scale wants a finite number"),
        (
            lambda: decay_attention(*[meta(1, 8, 2, 20)] * 2, meta(1, 8, 4, 32), 0.9),
            "dk must be a multiple of 16",
        ),
    ],
)
def test_a_wrong_argument_is_one_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_meta_tensors_give_the_shapes():
    o, state = decay_attention(Q, Q, V, 0.9, g=G, output_final_state=True)
    assert o.shape == (1, 8, 6, 32) and state.shape == (1, 6, 64, 32)


def test_the_default_config_compiles_for_sm_90a_without_spills():
    """The config a model's call runs where no table holds one (``kernel.rule.gated_config``)
    at a Mamba2 head layout: DK 128 (d_state), DV 64, one group, packed."""
    from kernel.gated import packed_gated_fwd
    from kernel.probe import ProbeFailure, probe_funcs
    from kernel.rule import gated_config

    config = gated_config(Problem(1, 24, 1, 128, 64, "bfloat16", "token", 1))
    make = lambda: [
        packed_gated_fwd(
            heads=24, groups=1, dk=128, dv=64, dtype="bfloat16", chunk=config.chunk, block_dv=config.block_dv,
            num_stages=config.num_stages, threads=config.threads, arch="sm_90a", scale=128**-0.5,
            initial_state=True, final_state=True,
        )
    ]  # fmt: skip
    found = probe_funcs(make, arch="sm_90a")
    assert not isinstance(found, ProbeFailure), found
    assert found.spill_bytes == 0 and found.fits_smem


@pytest.mark.parametrize(
    "dk, dv, block_dv, threads",
    [(64, 64, 64, 256), (128, 32, 32, 256), (256, 48, 48, 256), (128, 128, 128, 256), (64, 128, 64, 256)],
)
def test_the_default_config_fits_the_head_sizes(dk, dv, block_dv, threads):
    from kernel.rule import gated_config

    problem = Problem(1, 4, 1, dk, dv, gate="token")
    assert gated_config(problem) == KernelConfig(64, block_dv, 1, threads, "smem", 1)


# ---- on the GPU ------------------------------------------------------------------------------


def inputs(b, s, groups, r, dk, dv, *, dtype, seed, lengths=None):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, s, groups, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, s, groups * r, dv, generator=gen)
    u = torch.rand(b, s, groups * r, generator=gen, dtype=torch.float64)
    g = -torch.exp(math.log(1e-4) + u * (math.log(20.0) - math.log(1e-4)))  # -1e-4 .. -20
    n = b if lengths is None else len(lengths)
    h0 = torch.randn(n, groups * r, dk, dv, generator=gen)
    q, k, v = (x.to("cuda", dtype) for x in (q, k, v))
    return q, k, v, g.float().cuda(), h0.cuda()


def check(label, want, got):
    err = refs.rel_l2(got, want)
    print(f"{label}: rel L2 {err:.3e}")
    assert bool(got.isfinite().all()), f"{label}: non-finite"
    assert err < refs.TOLERANCE, f"{label}: rel L2 {err:.3e}"


CASES = {  # (B, S, G, r, DK, DV, packed lengths or None)
    "dense groups": (2, 300, 2, 3, 128, 64, None),
    "dense one group, Mamba2": (1, 1000, 1, 8, 128, 64, None),
    "dense G = H": (3, 65, 4, 1, 64, 64, None),
    "packed": (1, 272, 2, 2, 64, 128, [1, 1, 130, 1, 64, 65, 9, 1]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("decay", [None, 0.97, "tensor"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_op_matches_references(case, dtype, decay):
    """Twice: the second call through the kept plan, into the same NaN-free checks."""
    *shape, lengths = case
    q, k, v, g, h0 = inputs(*shape, dtype=dtype, seed=sum(shape[:6]), lengths=lengths)
    heads = v.shape[2]
    alphas = torch.linspace(0.9, 1.0, heads, device="cuda") if decay == "tensor" else decay
    log_decay = torch.log(torch.as_tensor(1.0 if decay is None else alphas, device="cuda").float())
    g_gamma = log_decay.expand(heads).contiguous()
    cu = None
    if lengths is not None:
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    kw = dict(scale=q.shape[-1] ** -0.5, initial_state=h0, cu_seqlens=cu)
    want, want_state = refs.gated_chunked(q, k, v, g, 64, g_gamma=g_gamma, **kw, output_final_state=True)
    for attempt in range(2):
        with torch.no_grad():
            o, state = decay_attention(q, k, v, alphas, g=g, **kw, output_final_state=True)
        torch.cuda.synchronize()
        label = f"{case} {dtype} decay {decay} call {attempt}"
        check(f"{label} o", want, o)
        check(f"{label} state", want_state, state)


@pytest.mark.gpu
def test_groups_without_g_and_no_states():
    q, k, v, _, _ = inputs(2, 200, 2, 4, 64, 64, dtype=torch.float16, seed=7)
    with torch.no_grad():
        o, state = decay_attention(q, k, v, 0.95)
    want = refs.gated_chunked(q, k, v, None, 64, g_gamma=torch.full((8,), math.log(0.95)).cuda(), scale=0.125)
    assert state is None
    check("groups without g", want, o)


@pytest.mark.gpu
def test_op_under_torch_compile():
    q, k, v, g, h0 = inputs(2, 130, 2, 2, 64, 64, dtype=torch.bfloat16, seed=8)
    alphas = torch.full((4,), 0.9, device="cuda")

    @torch.compile(fullgraph=True)
    def step(q, k, v, g, h0):
        return decay_attention(q, k, v, alphas, g=g, initial_state=h0, output_final_state=True)

    with torch.no_grad():
        o, state = step(q, k, v, g, h0)
    want, want_state = refs.gated_chunked(
        q, k, v, g, 64, g_gamma=torch.log(alphas), scale=0.125, initial_state=h0, output_final_state=True
    )
    check("compiled o", want, o)
    check("compiled state", want_state, state)


@pytest.mark.gpu
def test_drop_in_for_fla_chunk_simple_gla():
    """fla's ``chunk_simple_gla(q, k, v, g=g, g_gamma=gg, scale, initial_state,
    output_final_state, cu_seqlens)`` and ours with ``decay = exp(gg)``, both against fp64."""
    fla = pytest.importorskip("fla.ops.simple_gla")
    q, k, v, g, h0 = inputs(1, 272, 4, 1, 128, 128, dtype=torch.bfloat16, seed=10, lengths=[1, 1, 130, 140])
    gg = -0.05 * torch.rand(4, device="cuda")
    cu = torch.tensor([0, 1, 2, 132, 272], device="cuda")
    kw = dict(scale=128**-0.5, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    with torch.no_grad():
        theirs, their_state = fla.chunk_simple_gla(q, k, v, g=g, g_gamma=gg, **kw)
        ours, our_state = decay_attention(q, k, v, torch.exp(gg), g=g, **kw)
    want, want_state = refs.gated_chunked(q, k, v, g, 64, g_gamma=gg, **kw)
    for name, o, s in (("fla", theirs, their_state), ("ours", ours, our_state)):
        print(f"{name}: o {refs.rel_l2(o, want):.3e} state {refs.rel_l2(s, want_state):.3e}")
    check("ours o", want, ours)
    check("ours state", want_state, our_state)
    assert refs.rel_l2(ours, want) <= 2 * refs.rel_l2(theirs, want) + 1e-3
