"""The backward pass (``kernel.ops.backward``): its three forward passes give autograd's
gradients through reference A and reference E's, in fp64 on the references (here), and
through ``decay_attention``'s autograd on the GPU kernel (marked ``gpu``)."""

import dataclasses
import itertools

import pytest
import torch
from helpers import selected

import refs
from kernel.config import Call, KernelConfig, Problem
from kernel.ops.backward import backward, pass_calls

F64 = torch.float64


def by_copies(forward):
    """A pass from a forward that runs forward in time only: reversed, it is the forward
    on reversed copies of the tokens, its output reversed back. Packed sequences reverse as
    a whole: the last sequence comes first, with offsets ``T - cu_seqlens`` reversed, and
    the states in reverse order."""

    def forward_pass(q, k, v, h0, want_final, cu_seqlens, reverse):
        if not reverse:
            return forward(q, k, v, h0, want_final, cu_seqlens)
        packed = cu_seqlens is not None
        order = (lambda states: states.flip(0)) if packed else (lambda states: states)
        rev_cu = None if cu_seqlens is None else cu_seqlens[-1] - cu_seqlens.flip(0)
        start = None if h0 is None else order(h0)
        o, final = forward(q.flip(1), k.flip(1), v.flip(1), start, want_final, rev_cu)
        return o.flip(1), (None if final is None else order(final))

    return forward_pass


DECAYS = [0.05, 0.5, 0.97, 1.0]  # one per head: small (alpha^C underflows), RetNet-like, none


def _ref_pass(decay: torch.Tensor, scale: float, chunk: int = 16):
    """The forward as reference B: what ``backward`` runs its passes with, here in fp64."""

    def forward(q, k, v, h0, want_final, cu):
        out = refs.chunked(
            q, k, v, decay, chunk, scale=scale, initial_state=h0, cu_seqlens=cu, output_final_state=want_final
        )
        return out if want_final else (out, None)

    return by_copies(forward)


def _inputs(b: int, s: int, h: int, dk: int, dv: int, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, s, h, dk, generator=gen, dtype=F64) for _ in range(2))
    v, do = (torch.randn(b, s, h, dv, generator=gen, dtype=F64) for _ in range(2))
    h0, dht = (torch.randn(n, h, dk, dv, generator=gen, dtype=F64) for _ in range(2))
    return q, k, v, do, h0, dht


def _autograd(q, k, v, h0, decay, scale, do, dht, cu):
    """Gradients of ``<o, do> + <final state, dht>`` by autograd through reference A, fp64."""
    leaves = [x.detach().to(F64).requires_grad_() for x in (q, k, v, h0)]
    o, final = refs.recurrent(
        *leaves[:3], decay, scale=scale, initial_state=leaves[3], cu_seqlens=cu, output_final_state=True
    )
    loss = (o * do).sum() + ((final * dht).sum() if dht is not None else 0)
    return torch.autograd.grad(loss, leaves)


PACKED = [1, 16, 17, 31, 5]  # lengths: one token, a whole chunk, one past it, ragged
CASES = [  # (batch, seqlen, DK, DV, cu_seqlens)
    (2, 70, 8, 5, None),
    (1, 1, 4, 4, None),
    (3, 16, 5, 8, None),
    (1, sum(PACKED), 8, 5, [0, *itertools.accumulate(PACKED)]),
]


@pytest.mark.parametrize("b,s,dk,dv,offsets", CASES)
@pytest.mark.parametrize("with_dht", [True, False])
def test_three_passes_give_autograd_s_gradients(b, s, dk, dv, offsets, with_dht):
    cu = None if offsets is None else torch.tensor(offsets)
    n = b if cu is None else len(offsets) - 1
    q, k, v, do, h0, dht = _inputs(b, s, len(DECAYS), dk, dv, n, seed=s + dk)
    dht = dht if with_dht else None
    decay, scale = torch.tensor(DECAYS, dtype=F64), 0.3
    got = backward(
        _ref_pass(decay, scale),
        q,
        k,
        v,
        do,
        decay,
        scale,
        initial_state=h0,
        dht=dht,
        cu_seqlens=cu,
        want_dh0=True,
    )
    want = _autograd(q, k, v, h0, decay, scale, do, dht, cu)
    reference_e = refs.chunked_backward(
        q, k, v, decay, 16, do, scale=scale, initial_state=h0, dht=dht, cu_seqlens=cu
    )
    for name, g, w, e in zip(("dq", "dk", "dv", "dh0"), got, want, reference_e):
        assert g.shape == w.shape, name
        assert refs.rel_l2(g, w) < 1e-12 and refs.rel_l2(g, e) < 1e-12, name


def test_no_initial_state_no_dh0():
    q, k, v, do, _, _ = _inputs(1, 20, 2, 4, 4, 1, seed=3)
    decay = torch.tensor([0.9, 0.5], dtype=F64)
    *grads, dh0 = backward(_ref_pass(decay, 1.0), q, k, v, do, decay, 1.0)
    assert dh0 is None and all(g.shape == x.shape for g, x in zip(grads, (q, k, v)))


class _RefAttention(torch.autograd.Function):
    """Reference B forward, ``kernel.ops.backward`` backward: what gradcheck differentiates."""

    @staticmethod
    def forward(ctx, q, k, v, h0, decay, scale, cu):
        ctx.save_for_backward(q, k, v, h0, decay, cu)
        ctx.scale = scale
        return refs.chunked(
            q, k, v, decay, 4, scale=scale, initial_state=h0, cu_seqlens=cu, output_final_state=True
        )

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, h0, decay, cu = ctx.saved_tensors
        forward_pass = _ref_pass(decay, ctx.scale, chunk=4)
        grads = backward(
            forward_pass,
            q,
            k,
            v,
            do,
            decay,
            ctx.scale,
            initial_state=h0,
            dht=dht,
            cu_seqlens=cu,
            want_dh0=True,
        )
        return *grads, None, None, None


@pytest.mark.parametrize("offsets", [None, [0, 3, 4, 11]])
def test_gradcheck(offsets):
    cu = None if offsets is None else torch.tensor(offsets)
    b, n = (2, 2) if cu is None else (1, 3)
    q, k, v, _, h0, _ = _inputs(b, 11, 2, 3, 2, n, seed=5)
    leaves = [x.requires_grad_() for x in (q, k, v, h0)]
    decay = torch.tensor([0.8, 0.3], dtype=F64)
    assert torch.autograd.gradcheck(lambda *x: _RefAttention.apply(*x, decay, 0.7, cu), leaves)


@pytest.mark.parametrize("fused", [False, True])
def test_pass_calls_are_the_kernel_calls_backward_makes(fused):
    """What ``pass_calls`` lists (for compiling and tuning) is what ``backward`` calls,
    with dk and dv in two passes or in one (``fused``, here the two reference passes)."""
    problem = Problem(2, 4, 20, 16, 32)
    q, k, v, do, h0, dht = _inputs(2, 20, 4, 16, 32, 2, seed=1)
    decay = torch.tensor(DECAYS, dtype=F64)
    for initial, final in itertools.product([False, True], repeat=2):
        made: list[tuple[Problem, Call]] = []
        forward_pass = _ref_pass(decay, 0.5)

        def record(q_, v_, call, made=made):
            b, s, h, dk_ = q_.shape
            made.append((Problem(b, h, s, dk_, v_.shape[-1]), call))

        def recording(q_, k_, v_, h0_, want_final, cu, reverse, forward_pass=forward_pass):
            record(q_, v_, Call(0.5, h0_ is not None, want_final, reverse=reverse))
            return forward_pass(q_, k_, v_, h0_, want_final, cu, reverse)

        def dkdv(q_, k_, v_, do_, start, want_final, cu, forward_pass=forward_pass):
            record(q_, v_, Call(0.5, start is not None, want_final, reverse=True, dkdv=True))
            start_t = None if start is None else start.transpose(-1, -2)
            dk_, _ = forward_pass(v_, do_, q_, start_t, False, cu, True)
            return dk_, *forward_pass(k_, q_, do_, start, want_final, cu, True)

        state, grad = (h0 if initial else None), (dht if final else None)
        backward(
            recording, q, k, v, do, decay, 0.5, initial_state=state, dht=grad, want_dh0=initial,
            fused=dkdv if fused else None,
        )  # fmt: skip
        assert made == pass_calls(problem, Call(0.5, initial, final), fused), (initial, final)


# ---- on the GPU: decay_attention's autograd, the kernel's passes --------------------------


def _gpu_case(b: int, s: int, h: int, dk: int, dv: int, dtype: str, lengths: list[int] | None):
    from kernel.validate import random_qkv

    q, k, v = random_qkv(Problem(b, h, s, dk, dv, dtype), seed=s + dk)
    cu = None
    if lengths is not None:
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    n = b if cu is None else len(lengths)
    gen = torch.Generator(device="cuda").manual_seed(s)
    do = torch.randn(v.shape, generator=gen, device="cuda").to(v.dtype)
    h0, dht = (torch.randn(n, h, dk, dv, generator=gen, device="cuda") for _ in range(2))
    return q, k, v, do, h0, dht, cu


def _poison_allocator() -> None:
    """Leave NaN in the memory the caching allocator hands out next, so that a gradient
    element the kernels never write shows as NaN."""
    torch.full((1 << 28,), float("nan"), device="cuda")
    torch.cuda.synchronize()


GPU_CASES = [  # (b, s, h, dk, dv, dtype, packed lengths)
    (2, 300, 4, 128, 128, "float16", None),
    (1, 1000, 4, 64, 128, "bfloat16", None),
    (3, 65, 4, 128, 64, "float16", None),
    (2, 1, 4, 128, 128, "bfloat16", None),
    (1, 1 + 63 + 64 + 65 + 300 + 17, 4, 128, 128, "float16", [1, 63, 64, 65, 300, 17]),
    (1, 2 + 1000 + 5, 4, 128, 128, "bfloat16", [2, 1000, 5]),
    (2, 700, 2, 128, 256, "bfloat16", None),  # fla's RetNet: DV = 2 DK, the dq and dk passes at DK = 256
]


@pytest.fixture(scope="module")
def compiled(request) -> None:
    """Compile every kernel the selected GPU cases call, forward and passes, in parallel
    processes."""
    from kernel.builder import cuda_arch, precompile
    from kernel.ops.serve import training_jobs
    from kernel.probe import Resources

    jobs = set()
    names = ("b", "s", "h", "dk", "dv", "dtype", "lengths", "with_state")
    for b, s, h, dk, dv, dtype, lengths, with_state in selected(request, *names):
        problem, n = Problem(b, h, s, dk, dv, dtype), b if lengths is None else len(lengths)
        call = Call(0.1, with_state, with_state, lengths is not None)
        jobs |= training_jobs(problem, call, n)
    for res in precompile(sorted(jobs, key=str), arch=cuda_arch()):
        assert isinstance(res, Resources), res


@pytest.mark.gpu
@pytest.mark.usefixtures("compiled")
@pytest.mark.parametrize("b,s,h,dk,dv,dtype,lengths", GPU_CASES, ids=str)
@pytest.mark.parametrize("with_state", [True, False])
def test_decay_attention_gradients_match_autograd_through_a(b, s, h, dk, dv, dtype, lengths, with_state):
    from kernel.ops.attention import decay_attention

    q, k, v, do, h0, dht, cu = _gpu_case(b, s, h, dk, dv, dtype, lengths)
    decay = torch.tensor(DECAYS[:h], device="cuda")
    leaves = [x.clone().requires_grad_() for x in (q, k, v, h0)]
    state = leaves[3] if with_state else None
    o, final = decay_attention(
        *leaves[:3], decay, scale=0.1, initial_state=state, output_final_state=with_state, cu_seqlens=cu
    )
    _poison_allocator()
    loss = (o.float() * do.float()).sum() + ((final * dht).sum() if with_state else 0)
    got = torch.autograd.grad(loss, leaves[:4] if with_state else leaves[:3])
    want = _autograd(
        q, k, v, h0 if with_state else torch.zeros_like(h0), decay, 0.1, do, dht if with_state else None, cu
    )
    for name, g, w, x in zip(("dq", "dk", "dv", "dh0"), got, want, leaves):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        assert not g.isnan().any() and refs.rel_l2(g, w) < refs.TOLERANCE, (name, refs.rel_l2(g, w))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[4]], ids=str)
def test_a_final_state_no_gradient_reaches_runs_the_passes_warmup_compiled(case):
    """``output_final_state`` with a loss of ``o`` alone: no zeros are made for the state's
    gradient, the reversed passes start from a kept zero state, twice alike, on the kernels
    a final state's backward compiles (``training_jobs``), and nothing else compiles."""
    from kernel.builder import build, compiles, cuda_arch, precompile
    from kernel.ops.attention import decay_attention
    from kernel.ops.serve import training_jobs

    b, s, h, dk, dv, dtype, lengths = case
    q, k, v, do, h0, _, cu = _gpu_case(b, s, h, dk, dv, dtype, lengths)
    n = b if lengths is None else len(lengths)
    jobs = sorted(
        training_jobs(Problem(b, h, s, dk, dv, dtype), Call(0.1, False, True, cu is not None), n), key=str
    )
    precompile(jobs, arch=cuda_arch())
    for job in jobs:  # loaded into this process: ``compiles`` counts loads from the disk cache too
        build(*job)
    decay = torch.tensor(DECAYS[:h], device="cuda")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    before = compiles()
    grads = []
    for _ in range(2):
        o, final = decay_attention(*leaves, decay, scale=0.1, output_final_state=True, cu_seqlens=cu)
        _poison_allocator()
        grads.append(torch.autograd.grad((o.float() * do.float()).sum(), leaves))
    assert compiles() == before
    want = _autograd(q, k, v, torch.zeros_like(h0), decay, 0.1, do, None, cu)
    for name, g, again, w in zip(("dq", "dk", "dv"), *grads, want):
        assert torch.equal(g, again), name
        assert not g.isnan().any() and refs.rel_l2(g, w) < refs.TOLERANCE, (name, refs.rel_l2(g, w))


@pytest.mark.gpu
def test_training_step_under_torch_compile_fullgraph():
    """The loss compiled whole, with ``fullgraph=True``: its backward graph (which AOTAutograd
    builds from the op's autograd rule) gives eager's gradients: dk, dv and dH0 bit for bit;
    dq to within 1e-2, since the eager call's dq pass reads the split forward's states
    (``kernel.ops.attention._forward``) where the custom op computes them again,
    the same sums in another order. (Dynamo does not trace ``torch.autograd.grad`` itself,
    so the step calls it outside.)"""
    from kernel.ops.attention import decay_attention

    q, k, v, do, h0, _, _ = _gpu_case(2, 500, 4, 64, 64, "bfloat16", None)
    decay = torch.tensor(DECAYS, device="cuda")

    def loss(q, k, v, h0):
        o, final = decay_attention(q, k, v, decay, initial_state=h0, output_final_state=True)
        return (o.float() * do.float()).sum() + final.square().sum()

    leaves = [x.clone().requires_grad_() for x in (q, k, v, h0)]
    eager = torch.autograd.grad(loss(*leaves), leaves)
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(*leaves), leaves)
    assert refs.rel_l2(compiled[0], eager[0]) < 1e-2
    for e, c in zip(eager[1:], compiled[1:]):
        assert torch.equal(e, c)


@pytest.mark.gpu
def test_the_backward_op_passes_torch_s_opcheck():
    q, k, v, do, h0, dht, cu = _gpu_case(1, 130, 4, 64, 64, "float16", [1, 60, 69])
    decay = torch.tensor(DECAYS, device="cuda")
    op = torch.ops.decay_tuner.decay_attention_backward.default
    torch.library.opcheck(op, (q, k, v, do, decay, 1.0, 0.125, h0, dht, cu))
    torch.library.opcheck(op, (q, k, v, do, None, 0.9, 0.125, None, None, None))


def test_the_dq_pass_reads_the_forward_s_states_where_they_cut_alike():
    """The dq pass (DK and DV swapped) reads a split forward's states, transposed, only
    where both cut the sequence into the same segments (``kernel.variants.same_segments``):
    so the default configs do at DK = DV and DK != DV alike."""
    from kernel.rule import default_config
    from kernel.variants import same_segments

    for b, h, s, dk, dv in [(2, 16, 16384, 128, 128), (1, 4, 1000, 64, 128), (2, 4, 300, 128, 128)]:
        forward, dq = (default_config(Problem(b, h, s, x, y), "sm_90a", 132) for x, y in ((dk, dv), (dv, dk)))
        assert forward.segments > 1 and same_segments(forward, dq, s), (forward, dq)
    split = KernelConfig(64, 128, 2, 256, "smem", 4)
    assert not same_segments(split, dataclasses.replace(split, segments=8), 16384)
    assert not same_segments(split, dataclasses.replace(split, chunk=128), 1100)  # 320 and 384 tokens
    assert not same_segments(dataclasses.replace(split, segments=1), split, 1000)


def test_the_passes_compile_for_hopper_and_ampere():
    """Each pass of a backward with DK != DV, state in and out, compiles with the default
    config for its shape (the dq and dk passes at (DV, DK)), for sm_90a and for sm_80; the
    compile pool says as each job ends (``warmup``'s progress bar)."""
    from kernel.builder import precompile
    from kernel.probe import Resources
    from kernel.rule import default_config

    problem = Problem(1, 2, 200, 64, 128)
    calls = pass_calls(problem, Call(0.125, True, True))
    jobs = [(p, default_config(p, "sm_90a", 132), c) for p, c in calls]
    for arch in ("sm_90a", "sm_80"):
        ended: list[None] = []
        for job, res in zip(jobs, precompile(jobs, arch=arch, done=lambda: ended.append(None)), strict=True):
            assert isinstance(res, Resources) and res.spill_stores == 0 and res.fits_smem, (arch, job, res)
        assert len(ended) == len(jobs)


def test_dispatch_backward_tunes_dk_and_dv_swapped(tmp_path, capsys):
    """``dispatch --backward`` tunes the shapes of the backward's passes: DK x DV and DV x DK
    (here compile-only for sm_80, as on a machine without its GPU)."""
    from tuner.cli import main

    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    argv = ["dispatch", "--shapes", "1x2x256", "--dk", "64", "--dv", "128", "--arch", "sm_80", "--backward"]
    assert main([*argv, "--n-trials", "2", "--storage", storage, "--workers", "2", "--no-progress"]) == 0
    found = [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("sm_80 ")]
    assert found == ["64x128", "128x64"]


# The kernel backwards in time (Call.reverse) on every chunk step and both variants:
# ragged chunks, a ragged last segment, S < C, packed sequences, a state in and out.
FP16, BF16 = Problem(2, 4, 300, 128, 128), Problem(1, 4, 1000, 64, 128, "bfloat16")
REVERSE = Call(0.1, True, True, reverse=True)
REVERSE_CASES = [
    (FP16, KernelConfig(64, 128, 2, 256), REVERSE),  # the transposed step
    (FP16, KernelConfig(64, 64, 2, 256), REVERSE),  # the async step
    (FP16, KernelConfig(32, 32, 2, 128), Call(0.1, False, True, reverse=True)),  # the sync step
    (FP16, KernelConfig(64, 32, 1, 128, "regs"), Call(0.1, True, False, reverse=True)),
    (FP16, KernelConfig(64, 128, 2, 256, segments=4), REVERSE),  # the split, carry launched
    (FP16, KernelConfig(64, 64, 1, 128, segments=2), Call(0.1, False, True, reverse=True)),  # no carry
    (BF16, KernelConfig(64, 128, 2, 256, segments=4), Call(0.1, False, True, reverse=True)),
    (BF16, KernelConfig(32, 64, 2, 128, segments=8), REVERSE),
    (Problem(2, 4, 63, 128, 128), KernelConfig(64, 128, 1, 256), REVERSE),
    (Problem(1, 4, 1, 128, 128), KernelConfig(64, 128, 2, 256), Call(0.1, True, True, True, True)),
    (Problem(1, 4, 1, 64, 128, "bfloat16"), KernelConfig(64, 64, 2, 256), Call(0.1, True, True, True, True)),
    (
        Problem(2, 2, 1000, 256, 128, "bfloat16"),
        KernelConfig(64, 64, 2, 256, segments=2),
        REVERSE,
    ),  # DK = 256
    (Problem(2, 2, 1000, 256, 128), KernelConfig(64, 64, 2, 256), REVERSE),
]
REVERSE_LENGTHS = [1, 63, 64, 65, 300, 17, 2]


@pytest.fixture(scope="module")
def compiled_reverse(request) -> None:
    from kernel.builder import cuda_arch, precompile
    from kernel.probe import Resources

    for res in precompile(selected(request, "problem", "config", "call"), arch=cuda_arch()):
        assert isinstance(res, Resources), res


@pytest.mark.gpu
@pytest.mark.usefixtures("compiled_reverse")
@pytest.mark.parametrize("problem,config,call", REVERSE_CASES, ids=str)
def test_the_kernel_runs_backwards_in_time(problem, config, call):
    """Against reference B on reversed copies (``by_copies``), outputs and final state
    NaN-filled first."""
    from kernel.builder import TORCH_DTYPES, build
    from kernel.validate import random_qkv

    p = problem
    lengths = REVERSE_LENGTHS if call.packed else None
    seqlen = sum(lengths) if lengths else p.seqlen
    q, k, v = random_qkv(dataclasses.replace(p, seqlen=seqlen), seed=seqlen)
    cu = None
    if lengths:
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    n = len(lengths) if lengths else p.batch
    decay = torch.tensor(DECAYS[: p.heads], device="cuda")
    h0 = torch.randn(n, p.heads, p.dk, p.dv, device="cuda") if call.initial_state else None
    final = torch.full((n, p.heads, p.dk, p.dv), float("nan"), device="cuda") if call.final_state else None
    out = torch.full_like(v, float("nan"))
    build(p, config, call)(q, k, v, decay=decay, initial_state=h0, final_state=final, out=out, cu_seqlens=cu)

    def forward(q_, k_, v_, h0_, want_final, cu_):
        res = refs.chunked(
            q_, k_, v_, decay, 64, scale=0.1, initial_state=h0_, cu_seqlens=cu_, output_final_state=want_final
        )
        return res if want_final else (res, None)

    want_o, want_final = by_copies(forward)(q, k, v, h0, call.final_state, cu, True)
    assert out.dtype == TORCH_DTYPES[p.dtype] and not out.isnan().any()
    assert refs.rel_l2(out, want_o) < refs.TOLERANCE
    if call.final_state:
        assert not final.isnan().any() and refs.rel_l2(final, want_final) < refs.TOLERANCE


class _ReferencePass:
    """A kernel of the backward's passes run by reference A in fp64 (``kernel.ops.attention``
    hands each pass's tensors to ``run``), so that the wiring around the kernels is checked
    where no GPU runs them."""

    config = None

    def __init__(self, problem: Problem, call: Call):
        self.problem, self.call = problem, call

    def run(self, q, k, v, decay, h0, final, out, offsets, states):
        p, reverse = self.problem, self.call.reverse
        start = None if h0 is None else h0.reshape(-1, p.heads, p.dk, p.dv).clone()
        q, k, v = (x.flip(1) if reverse else x for x in (q, k, v))
        o, last = refs.recurrent(
            q, k, v, decay, scale=self.call.scale, initial_state=start, output_final_state=True
        )
        if final is not None:
            final.copy_(last)
        return (o.flip(1) if reverse else o), None


def test_a_final_state_no_gradient_reaches_starts_the_passes_from_a_kept_zero(monkeypatch):
    """``zero_start`` (an eager call's final state with no gradient): the passes' flags and
    gradients are those of a zero dHT, bitwise, and the kept zero stays zero."""
    import kernel.ops.attention as attention

    monkeypatch.setitem(attention.inputs.DTYPE_NAMES, F64, "float16")
    made = []  # the (problem, call) of each kernel looked up: what warmup must have compiled
    monkeypatch.setattr(
        attention, "kernel_for", lambda p, call, n: made.append((p, call)) or _ReferencePass(p, call)
    )
    monkeypatch.setattr(attention, "fuses_here", lambda p: False)
    q, k, v, do, _, _ = _inputs(2, 37, 3, 16, 32, 2, seed=5)
    decay = torch.tensor(DECAYS[:3], dtype=F64)
    grads = lambda dht: attention._Grads(q, k, v, do, decay, 1.0, 0.3, None, dht, None)
    zero_dht = attention._passes(grads(torch.zeros(2, 3, 16, 32, dtype=F64)), None, {})
    with_dht, made[:] = list(made), []
    kept: dict = {}
    for _ in range(2):
        got = attention._passes(grads(None), None, kept, zero_start=True)
        assert all(torch.equal(a, b) for a, b in zip(got[:3], zero_dht[:3]))
    assert made == with_dht and not kept["zero"].any()
    want = _autograd(q, k, v, torch.zeros(2, 3, 16, 32, dtype=F64), decay, 0.3, do, None, None)
    assert all(refs.rel_l2(g, w) < 1e-12 for g, w in zip(got[:3], want))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_decay_attention_autograd_wiring_on_meta_tensors(packed, with_state):
    """The autograd rule registered for the custom op, run on meta tensors (the ops' fake
    implementations; no GPU): a gradient of each input's shape and dtype for q, k, v and
    the initial state, none for the decay."""
    from kernel.ops.attention import decay_attention

    b, s, h, dk, dv = (1, 40, 4, 16, 32) if packed else (2, 40, 4, 16, 32)
    n = 3 if packed else b
    leaf = lambda *shape, dtype=torch.bfloat16: torch.empty(
        shape, device="meta", dtype=dtype
    ).requires_grad_()  # noqa: E731
    q, k, v = leaf(b, s, h, dk), leaf(b, s, h, dk), leaf(b, s, h, dv)
    h0 = leaf(n, h, dk, dv, dtype=torch.float32) if with_state else None
    decay = leaf(h, dtype=torch.float32)
    cu = torch.tensor([0, 1, 17, 40], device="meta") if packed else None
    o, final = decay_attention(q, k, v, decay, initial_state=h0, output_final_state=with_state, cu_seqlens=cu)
    loss = o.float().sum() + (final.sum() if with_state else 0)
    loss.backward()
    for x in (q, k, v, *([h0] if with_state else [])):
        assert x.grad is not None and x.grad.shape == x.shape and x.grad.dtype == x.dtype
    assert decay.grad is None


# ---- the reversed kernel's arithmetic, emulated in fp64 on the CPU ------------------------
# The chunk loop (kernel.scalar_decay) and the split's states and carry (kernel.seq_split)
# written out with the mirrored weights of ``Direction``, token rows past a chunk's end
# holding garbage as they do in a packed batch: it must equal the forward on reversed copies.


def _loop(q, k, v, alpha, scale, state, begin, end, chunk, reverse):
    """One block's chunk loop over tokens [begin, end) of [S, D] tiles: (outputs, state out)."""
    n = -(-(end - begin) // chunk)
    i, j = torch.arange(chunk)[:, None], torch.arange(chunk)[None, :]
    sees, dist = (j >= i, j - i) if reverse else (j <= i, i - j)
    gamma = torch.where(sees, scale * alpha ** dist.clamp(min=0).to(F64), 0.0)
    out = torch.zeros(end - begin, v.shape[1], dtype=F64)
    for c in range(n):
        s0 = begin + ((n - 1 - c) if reverse else c) * chunk
        m = max(min(chunk, end - s0), 0)
        qc, kc, vc = (x[s0 : s0 + chunk] for x in (q, k, v))
        scores = (qc @ kc.T) * gamma
        if reverse:
            scores = torch.where(j < m, scores, 0.0)
        r = torch.arange(chunk)
        query_power = (m - r).clamp(min=0) if reverse else r + 1
        o = (qc @ state) * (scale * alpha ** query_power.to(F64))[:, None] + scores @ vc
        out[s0 - begin : s0 - begin + m] = o[:m]
        key_power = r if reverse else m - 1 - r
        kw = torch.where((r < m)[:, None], kc * alpha ** key_power.clamp(min=0).to(F64)[:, None], 0.0)
        state = alpha**m * state + kw.T @ vc
    return out, state


def _split(q, k, v, alpha, scale, h0, s, chunk, length, reverse):
    """The split of ``s`` tokens over segments of ``length``: states kernel, carry, outputs."""
    p, states = -(-s // length), _split_states(k, v, alpha, h0, s, chunk, length, reverse)
    outs, final = [], None
    for bp in range(p):  # the outputs kernel
        o, st = _loop(
            q, k, v, alpha, scale, states[bp], bp * length, min(bp * length + length, s), chunk, reverse
        )
        outs.append(o)
        if bp == (0 if reverse else p - 1):
            final = st
    return torch.cat(outs), final


def _split_states(k, v, alpha, h0, s, chunk, length, reverse):
    """The split's states kernel and carry: the state entering each segment (from its end
    where ``reverse``)."""
    p = -(-s // length)
    last = s - (p - 1) * length
    states = [None] * p
    for bp in range(p - 1):  # the states kernel
        seg, slot = (bp + 1, bp) if reverse else (bp, bp + 1)
        acc = torch.zeros(k.shape[1], v.shape[1], dtype=F64)
        for c in range(length // chunk):
            s0 = seg * length + (c if reverse else length // chunk - 1 - c) * chunk
            r = torch.arange(chunk)
            power = chunk * c + r if reverse else chunk * c + chunk - 1 - r
            kw = k[s0 : s0 + chunk] * alpha ** power.to(F64)[:, None]
            if reverse:
                kw = torch.where((s0 + r < s)[:, None], kw, 0.0)
            acc = acc + kw.T @ v[s0 : s0 + chunk]
        states[slot] = acc
    states[p - 1 if reverse else 0] = h0
    order = range(p - 2, -1, -1) if reverse else range(1, p)
    for q_ in order:  # the carry
        prev = q_ + 1 if reverse else q_ - 1
        across = last if reverse and prev == p - 1 else length
        states[q_] = alpha**across * states[prev] + states[q_]
    return states


@pytest.mark.parametrize(
    "s,chunk,length",
    [(70, 16, None), (64, 16, None), (5, 16, None), (100, 16, 32), (97, 8, 32), (65, 16, 64)],
)
def test_the_mirrored_weights_run_the_recurrence_backwards(s, chunk, length):
    gen = torch.Generator().manual_seed(s)
    rows = s + (length or chunk)  # garbage past s, as far as a tile reaches
    q, k = (torch.randn(rows, 6, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(rows, 5, generator=gen, dtype=F64)
    h0 = torch.randn(6, 5, generator=gen, dtype=F64)
    alpha, scale = 0.9, 0.3
    if length is None:
        got, final = _loop(q, k, v, alpha, scale, h0, 0, s, chunk, reverse=True)
    else:
        got, final = _split(q, k, v, alpha, scale, h0, s, chunk, length, reverse=True)
    want, want_final = refs.recurrent(
        q[:s].flip(0)[None, :, None],
        k[:s].flip(0)[None, :, None],
        v[:s].flip(0)[None, :, None],
        alpha,
        scale=scale,
        initial_state=h0[None, None],
        output_final_state=True,
    )
    assert refs.rel_l2(got, want[0, :, 0].flip(0)) < 1e-12 and refs.rel_l2(final, want_final[0, 0]) < 1e-12
    if length is not None:  # the emulation's forward is the kernel's forward: the recurrence
        fwd, fwd_final = _split(q, k, v, alpha, scale, h0, s, chunk, length, reverse=False)
        want, want_final = refs.recurrent(
            q[None, :s, None],
            k[None, :s, None],
            v[None, :s, None],
            alpha,
            scale=scale,
            initial_state=h0[None, None],
            output_final_state=True,
        )
        assert refs.rel_l2(fwd, want[0, :, 0]) < 1e-12 and refs.rel_l2(fwd_final, want_final[0, 0]) < 1e-12


@pytest.mark.gpu
def test_a_training_step_runs_inside_a_captured_cuda_graph():
    """Forward and backward captured once, replayed on new inputs: eager's gradients."""
    from kernel.ops.attention import decay_attention
    from kernel.validate import random_qkv

    q, k, v, do, h0, _, _ = _gpu_case(1, 700, 4, 128, 128, "float16", None)
    decay = torch.tensor(DECAYS, device="cuda")
    leaves = [x.clone().requires_grad_() for x in (q, k, v, h0)]

    def step():
        o, final = decay_attention(*leaves[:3], decay, initial_state=leaves[3], output_final_state=True)
        return torch.autograd.grad((o.float() * do.float()).sum() + final.sum(), leaves)

    side = torch.cuda.Stream()  # warm up (and compile) outside the capture, as torch advises
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (30, 31):  # new inputs into the captured buffers, then a replay
        new = (*random_qkv(Problem(1, 4, 700, 128, 128), seed=seed), h0 * seed)
        with torch.no_grad():
            for dst, src in zip(leaves, new):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for c, e in zip(captured, step()):
            assert torch.equal(c, e)


FLA_CASE = (2, 1000, 4, 128)  # b, s, h, dk


@pytest.fixture(scope="module")
def compiled_for_fla(request) -> None:
    """Compile the selected fla comparisons' kernels in parallel processes: one after the
    other inside the test, their dozen split kernels did not finish in 150 s on the H200."""
    from kernel.builder import cuda_arch, precompile
    from kernel.ops.serve import training_jobs
    from kernel.probe import Resources

    b, s, h, dk = FLA_CASE
    jobs = set()
    for (dv,) in selected(request, "dv"):
        jobs |= training_jobs(Problem(b, h, s, dk, dv, "bfloat16"), Call(dk**-0.5, True, True), b)
    for res in precompile(sorted(jobs, key=str), arch=cuda_arch()):
        assert isinstance(res, Resources), res


@pytest.mark.gpu
@pytest.mark.usefixtures("compiled_for_fla")
@pytest.mark.parametrize("dv", [128, 256])  # 256: fla's RetNet layers (DV = 2 DK)
def test_gradients_match_fla_s_chunk_simple_gla(dv):
    """The same gradients as fla's autograd, with the same arguments (its g_gamma is the
    log of our decay), where fla is installed."""
    fla = pytest.importorskip("fla.ops.simple_gla")
    from kernel.ops.attention import decay_attention

    b, s, h, dk = FLA_CASE
    q, k, v, do, h0, dht, _ = _gpu_case(b, s, h, dk, dv, "bfloat16", None)
    decay = torch.tensor([1 - 2 ** (-5 - h) for h in range(4)], device="cuda")  # RetNet's
    grads = {}
    for name in ("ours", "fla"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, h0)]
        if name == "ours":
            o, final = decay_attention(*leaves[:3], decay, initial_state=leaves[3], output_final_state=True)
        else:
            o, final = fla.chunk_simple_gla(
                *leaves[:3], g_gamma=decay.log(), initial_state=leaves[3], output_final_state=True
            )
        loss = (o.float() * do.float()).sum() + (final * dht).sum()
        grads[name] = torch.autograd.grad(loss, leaves)
    for name, ours, theirs in zip(("dq", "dk", "dv", "dh0"), grads["ours"], grads["fla"]):
        assert refs.rel_l2(ours, theirs) < refs.TOLERANCE, name


def test_dispatch_backward_adds_the_fused_pass_s_studies():
    """``dispatch --backward`` adds a study of the fused dk and dv pass per shape where it
    serves the architecture (``--sweep dkdv`` alone: only those); none on sm_80."""
    from tuner.cli import build_parser
    from tuner.commands.args import options_of
    from tuner.commands.tune import dispatch_tasks
    from tuner.options import UsageError

    def tasks(*flags: str) -> list[tuple[str, int, int]]:
        args = build_parser().parse_args(["dispatch", "--shapes", "8x16x4096,2x16x16384", *flags])
        arch = args.arch or "sm_90a"
        return [(o.sweep, p.seqlen, p.dk) for p, o in dispatch_tasks(args, options_of(args), arch)]

    forward = [("forward", 4096, 128), ("forward", 16384, 128)]
    assert tasks() == forward
    assert tasks("--backward") == forward + [("dkdv", 4096, 128), ("dkdv", 16384, 128)]
    assert tasks("--backward", "--dk", "64") == [
        *[("forward", s, 64) for s in (4096, 16384)],
        *[("forward", s, 128) for s in (4096, 16384)],
        ("dkdv", 4096, 64),
        ("dkdv", 16384, 64),
    ]
    assert tasks("--sweep", "dkdv") == [("dkdv", 4096, 128), ("dkdv", 16384, 128)]
    assert tasks("--backward", "--arch", "sm_80") == forward
    with pytest.raises(UsageError, match="serves none of these shapes on sm_80"):
        tasks("--sweep", "dkdv", "--arch", "sm_80")


@pytest.mark.gpu
def test_gpu_dispatch_backward_tunes_the_fused_pass(tmp_path, monkeypatch):
    """On Hopper: ``dispatch --backward`` at one shape times the fused pass's configs (each
    trial's dK and dV checked against reference E), writes its entry to the table, and
    ``decay_attention``'s backward then runs the table's config for it, with autograd's
    gradients through reference A."""
    from kernel.builder import cuda_arch
    from kernel.config import dkdv_call
    from kernel.ops import decay_attention, serve
    from kernel.ops.dispatch import load_dispatch
    from kernel.rule import dkdv_config
    from tuner.cli import main

    problem = Problem(2, 4, 1024, 64, 64)
    if dkdv_config(problem, cuda_arch()) is None:
        pytest.skip(f"the fused pass does not serve {cuda_arch()}")
    monkeypatch.setattr("tuner.cli.STUDIES_DIR", tmp_path)
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    argv = [
        "dispatch",
        "--dk",
        "64",
        "--dv",
        "64",
        "--shapes",
        "2x4x1024",
        "--backward",
        "--storage",
        storage,
    ]
    argv += ["--n-trials", "3", "--workers", "4", "--no-progress", "--out", str(tmp_path / "dispatch.json")]
    assert main(argv) == 0
    table = load_dispatch(tmp_path / "dispatch.json")
    assert [e.sweep for e in table.entries] == ["forward", "dkdv"]
    fused = table.fused(problem)
    assert fused is not None and fused.block_dv == 64
    serve.use_table(table)
    try:
        assert serve.kernel_job(problem, dkdv_call(problem), problem.batch)[1] == fused
        q, k, v, do, h0, _, _ = _gpu_case(2, 1024, 4, 64, 64, "float16", None)
        decay = torch.tensor(DECAYS[:4], device="cuda")
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o, _ = decay_attention(*leaves, decay, scale=0.1)
        _poison_allocator()
        got = torch.autograd.grad(o, leaves, do)
        want = _autograd(q, k, v, torch.zeros_like(h0), decay, 0.1, do, None, None)
        for g, w in zip(got, want):
            assert not g.isnan().any() and refs.rel_l2(g, w) < refs.TOLERANCE
    finally:
        serve.use_table(None)
