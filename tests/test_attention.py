"""kernel.ops.attention without a GPU: the custom op's schema and fake implementation (what
torch.compile traces), and the checks that need no device."""

import math

import pytest
import torch
from helpers import dispatch_file
from torch._subclasses.fake_tensor import FakeTensorMode

from kernel.config import Call, KernelConfig, Problem, model_call
from kernel.ops.attention import decay_attention


def test_the_custom_op_is_registered_with_its_schema():
    schema = str(torch.ops.decay_tuner.decay_attention.default._schema)
    assert schema.startswith(
        "decay_tuner::decay_attention(Tensor q, Tensor k, Tensor v, Tensor? decay, float"
    )
    assert "Tensor? cu_seqlens" in schema
    assert schema.endswith("-> (Tensor, Tensor)")


@pytest.mark.parametrize("final", [True, False])
def test_fake_tensors_give_the_shapes_torch_compile_traces(final):
    with FakeTensorMode():
        q = torch.empty(2, 100, 4, 64, dtype=torch.bfloat16, device="cuda")
        v = torch.empty(2, 100, 4, 32, dtype=torch.bfloat16, device="cuda")
        o, state = decay_attention(q, q, v, torch.full((4,), 0.9, device="cuda"), output_final_state=final)
        assert o.shape == (2, 100, 4, 32) and o.dtype == torch.bfloat16
        assert (state.shape, state.dtype) == ((2, 4, 64, 32), torch.float32) if final else state is None


def test_fake_tensors_give_the_packed_shapes():
    """With cu_seqlens ``[N + 1]`` the final state is one per sequence, ``[N, H, DK, DV]``."""
    with FakeTensorMode():
        q = torch.empty(1, 700, 4, 64, dtype=torch.float16, device="cuda")
        cu = torch.empty(6, dtype=torch.int32, device="cuda")
        o, state = decay_attention(q, q, q, 0.9, output_final_state=True, cu_seqlens=cu)
        assert o.shape == (1, 700, 4, 64) and state.shape == (5, 4, 64, 64)


@pytest.mark.parametrize(
    "q, message",
    [
        (torch.randn(1, 8, 2, 64, dtype=torch.float16), "must be on a CUDA device"),
        (torch.randn(1, 8, 2, 64, dtype=torch.float16, requires_grad=True), "must be on a CUDA device"),
        (None, "q must be a 4-d tensor"),
        (torch.randn(8, 2, 64, dtype=torch.float16), "q must be a 4-d tensor"),
    ],
    ids=["cpu", "cpu, autograd", "none", "3-d"],
)
def test_a_wrong_q_is_refused_with_one_line(q, message):
    with pytest.raises(ValueError, match=message):
        decay_attention(q, q, q, 0.9)


def meta(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


Q = meta(1, 8, 2, 64)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: decay_attention(meta(8, 2, 64), Q, Q, 0.9), "q must be a 4-d tensor"),
        (lambda: decay_attention(torch.tensor(1.0), Q, Q, 0.9), "q must be a 4-d tensor"),
        (lambda: decay_attention(Q.float(), Q.float(), Q.float(), 0.9), "q must be float16 or bfloat16"),
        (lambda: decay_attention(Q, meta(1, 9, 2, 64), Q, 0.9), "k must be shaped as q"),
        (lambda: decay_attention(Q, Q, Q, meta(3)), r"decay must be a float or a tensor of 2 alphas \[H\]"),
        (lambda: decay_attention(Q, Q, Q, meta(2, dtype=torch.int32)), "decay must be a floating-point"),
        (lambda: decay_attention(Q, Q, Q, 1.5), r"decay must be in \(0, 1\], got 1.5"),
        (
            lambda: decay_attention(Q, Q, Q, None),
            r"a tensor \[H\] of them \(1.0 for no decay\), got NoneType",
        ),
        (lambda: decay_attention(Q, Q, Q, [0.9, 0.9]), "decay must be a float .* got list"),
        (lambda: decay_attention(Q, Q, Q, True), "decay must be a float .* got bool"),
        (lambda: decay_attention(Q, Q, Q, 0.9, scale=True), "scale wants a finite number, got True"),
        (
            lambda: decay_attention(Q, Q, Q, 0.9, output_final_state="no"),
            "output_final_state must be True or",
        ),
        (lambda: decay_attention(Q, Q, Q, 0.9, initial_state=[0]), "initial_state must be a tensor or None"),
        (lambda: decay_attention(Q, Q, Q, 0.9, initial_state=meta(3, 3)), "initial_state must be float32"),
        (lambda: decay_attention(Q, Q, Q, 0.9, cu_seqlens=[0, 8]), "cu_seqlens must be a tensor or None"),
        (
            lambda: decay_attention(Q, Q, Q, 0.9, cu_seqlens=meta(3, dtype=torch.float32)),
            "cu_seqlens must be an int32 or int64 tensor",
        ),
        (
            lambda: decay_attention(meta(2, 8, 2, 64), *[meta(2, 8, 2, 64)] * 2, 0.9, cu_seqlens=meta(3)),
            "with cu_seqlens, q, k, v must be",
        ),
        # sizes the kernels refuse on a GPU (a Problem's checks)
        (lambda: decay_attention(*[meta(1, 8, 2, 20)] * 3, 0.9), "dk must be a multiple of 16 .* got 20"),
        (lambda: decay_attention(*[meta(1, 8, 2, 512)] * 3, 0.9), "dk must be a multiple of 16 .* got 512"),
        (lambda: decay_attention(*[meta(1, 0, 2, 64)] * 3, 0.9), "seqlen must be a positive integer"),
        (lambda: decay_attention(*[meta(0, 8, 2, 64)] * 3, 0.9), "batch must be a positive integer"),
        (lambda: decay_attention(*[meta(1, 8, 0, 64)] * 3, 0.9), "heads must be a positive integer"),
        # more (batch, head) pairs than CUDA's grid takes along y
        (
            lambda: decay_attention(*[meta(4096, 1, 16, 64)] * 3, 0.9),
            r"batch x heads = 4096 x 16 = 65536: the kernels take at most 65535 \(batch, head\) pairs",
        ),
        (
            lambda: decay_attention(
                *[meta(1, 8192, 16, 64)] * 3, 0.9, cu_seqlens=meta(4097, dtype=torch.int32)
            ),
            r"sequences x heads = 4096 x 16 = 65536: .* split the sequences",
        ),
    ],
)
def test_a_wrong_argument_is_one_value_error_traced_or_not(call, message):
    """On meta tensors (what a traced call sees) the op's checks that need no values run as
    they do on a GPU's: every wrong type or shape is one ValueError."""
    with pytest.raises(ValueError, match=message):
        call()


def test_meta_tensors_give_the_shapes_and_a_numpy_decay_is_a_float():
    import numpy as np

    o, state = decay_attention(Q, Q, meta(1, 8, 2, 32), np.float32(0.9), output_final_state=True)
    assert o.shape == (1, 8, 2, 32) and state.shape == (1, 2, 64, 32)


@pytest.mark.parametrize("scale", ["x", None.__class__, math.nan, math.inf])
def test_a_scale_that_is_no_finite_number_is_refused_naming_it(scale):
    q = torch.randn(1, 8, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"^scale wants a finite number, got "):
        decay_attention(q, q, q, 0.9, scale=scale)


def test_a_table_without_the_problem_s_head_sizes_serves_the_default_config_with_a_warning():
    from kernel.config import KernelConfig, Problem
    from kernel.ops.dispatch import Dispatch, DispatchEntry
    from kernel.ops.serve import config_for
    from kernel.rule import default_config

    tuned = KernelConfig(64, 128, 3, 256, "smem", 1)
    table = Dispatch([DispatchEntry(Problem(8, 16, 4096, 128, 128), tuned)], {})
    same = Problem(8, 16, 4096, 128, 128)
    assert config_for(same, table, arch="sm_90a", sms=132) == tuned
    other = Problem(8, 16, 4096, 64, 64)
    with pytest.warns(UserWarning, match="python -m tuner dispatch --dk 64 --dv 64 --dtype float16"):
        assert config_for(other, table, arch="sm_90a", sms=132) == default_config(other, "sm_90a", 132)
    assert config_for(other, None, arch="sm_90a", sms=132) == default_config(other, "sm_90a", 132)


@pytest.mark.parametrize(
    "shape,block_dv,segments",
    [((8, 16, 4096), 128, 1), ((2, 16, 16384), 128, 4), ((1, 8, 32768), 128, 16), ((1, 1, 65), 64, 1)],
)
def test_the_default_config_launches_about_one_block_per_sm(shape, block_dv, segments):
    """The segment counts the H200's tuned tables chose at these shapes (128 blocks on 132
    SMs), and the single-pass kernel, at half the block_dv, where a sequence has too few
    chunks to split."""
    from kernel.config import Problem
    from kernel.rule import default_config

    config = default_config(Problem(*shape, 128, 128), "sm_90a", 132)
    assert (config.chunk, config.block_dv, config.threads, config.segments) == (64, block_dv, 256, segments)


def test_a_kernel_refuses_arguments_it_was_not_compiled_for():
    """Checked before any tensor reaches the GPU: a state or cu_seqlens the compiled call
    does not take, or one it needs and did not get."""
    from kernel.builder import ScalarDecayKernel
    from kernel.config import Call, KernelConfig, Problem

    problem, config = Problem(1, 2, 10, 64, 64), KernelConfig()
    plain = ScalarDecayKernel(problem, config, (), Call())
    packed = ScalarDecayKernel(problem, config, (), Call(packed=True))
    q = torch.zeros(1, 10, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="compiled without cu_seqlens"):
        plain(q, q, q, cu_seqlens=torch.tensor([0, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="compiled without initial_state"):
        plain(q, q, q, initial_state=torch.zeros(1, 2, 64, 64))
    with pytest.raises(ValueError, match="compiled with cu_seqlens"):
        packed(q, q, q)
    with pytest.raises(ValueError, match=r"cu_seqlens \[N \+ 1\]"):
        packed(q, q, q, cu_seqlens=torch.tensor([0], dtype=torch.int32))


@pytest.mark.parametrize("heads, dk, dv", [(16, 128, 128), (8, 128, 256), (32, 64, 64)])
def test_warmup_holds_the_kernel_of_every_call_of_its_head_size(heads, dk, dv):
    """Whatever batch size and length a call has, forward or backward, dense or packed, the
    kernel serving it (its ``shape_generic`` key) is one ``warmup_jobs`` compiles: after a
    warm-up no call compiles, on the H100 (its bandwidth) as on the H200."""
    import random

    from kernel.arch import get_arch
    from kernel.ops.serve import backward_jobs, kernel_job, warmup_jobs
    from kernel.variants import shape_generic

    arch, sms = "sm_90a", get_arch("sm_90a").sms
    warmed = {
        (shape_generic(p, c, arch), c, call)
        for p, c, call in warmup_jobs(heads, dk, dv, "bfloat16", backward=True, arch=arch)
    }
    rng = random.Random(0)
    chain = Problem(max(1, 64 // heads), heads, 8192, dk, dv, "bfloat16")  # where the H100's pick differs
    for rate in (3.35e12, 4.8e12):
        for p, c, call in [
            kernel_job(chain, model_call(chain), chain.batch, arch=arch, sms=sms, bandwidth=rate)
        ]:
            assert (shape_generic(p, c, arch), c, call) in warmed, (rate, c)
    for _ in range(60):
        batch, seqlen = rng.randint(1, max(1, 512 // heads)), rng.randint(1, 65536)
        p, n = Problem(batch, heads, seqlen, dk, dv, "bfloat16"), batch
        call = Call(dk**-0.5, False, rng.random() < 0.5, packed=rng.random() < 0.3)
        if call.packed:
            p, n = Problem(1, heads, seqlen, dk, dv, "bfloat16"), rng.randint(1, min(64, seqlen))
        rate = rng.choice([None, 3.35e12, 4.8e12])  # ahead, an H100's, an H200's
        for job in [
            kernel_job(p, call, n, arch=arch, sms=sms, bandwidth=rate),
            *backward_jobs(p, call, n, arch=arch, sms=sms, bandwidth=rate),
        ]:
            assert (shape_generic(job[0], job[1], arch), job[1], job[2]) in warmed, (p, call, job)


def test_warmup_refuses_an_architecture_that_compiles_per_shape_and_a_table_of_another(capsys, tmp_path):
    """The CLI and the Python function alike, before any compile: an architecture with no
    set of kernels to warm, counts that are no counts, and a table tuned for another
    architecture than the one compiled for (one line, exit 2)."""
    from kernel.ops.serve import warmup, warmup_jobs
    from tuner.cli import main

    assert main(["warmup", "--arch", "sm_80"]) == 2
    assert "compiled per shape" in capsys.readouterr().err
    with pytest.raises(ValueError, match="on sm_80 the kernels are compiled per shape"):
        warmup_jobs(16, 128, 128, "float16", backward=False, arch="sm_80")
    with pytest.raises(ValueError, match="sms wants a positive number of SMs, got -5"):
        warmup_jobs(16, 128, 128, "float16", backward=False, arch="sm_90a", sms=-5)
    with pytest.raises(ValueError, match="workers wants a positive number of processes, got 0"):
        warmup(16, 128, 128, "float16", backward=False, arch="sm_90a", workers=0)
    hopper = dispatch_file(tmp_path, [(Problem(1, 4, 4096, 64, 64), KernelConfig(64, 64, 2, 256))])
    args = ["warmup", "--heads", "4", "--dk", "64", "--dv", "64", "--dispatch", str(hopper)]
    assert main([*args, "--arch", "sm_100a"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was tuned for sm_90a, not for sm_100a" in err, err


def test_torch_compile_traces_the_checks_in_one_graph_without_a_warning():
    """``torch.compile(fullgraph=True)`` traces ``decay_attention``'s checks (on meta
    tensors, on the CPU): one graph, no warning, a wrong input's error names it, floats
    passed in trace, and so does a new length, symbolic (the fake implementation builds no
    ``Problem``, which takes ints)."""
    import traceback
    import warnings

    compiled = torch.compile(
        lambda q, d: decay_attention(q, q, q, d, output_final_state=True), backend="aot_eager", fullgraph=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o, state = compiled(Q, meta(2, dtype=torch.float32))
    assert o.shape == Q.shape and state.shape == (1, 2, 64, 64)
    with pytest.raises(Exception) as refused:
        compiled(Q[0], meta(2, dtype=torch.float32))
    assert "q must be a 4-d tensor" in "".join(traceback.format_exception(refused.value))
    # a scale and a decay passed in as floats (dynamo traces them, unspecialised) trace too
    scaled = torch.compile(
        lambda q, d, s: decay_attention(q, q, q, d, scale=s)[0], backend="aot_eager", fullgraph=True
    )
    for d, s in ((0.9, 0.125), (0.8, 0.25)):
        assert scaled(Q, d, s).shape == Q.shape
    # a new length recompiles with the length symbolic (torch's automatic dynamic shapes)
    for length in (64, 100, 257):
        q = meta(2, length, 2, 64)
        o, state = compiled(q, meta(2, dtype=torch.float32))
        assert o.shape == q.shape and state.shape == (2, 2, 64, 64)
