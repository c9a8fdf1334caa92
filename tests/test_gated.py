"""The gated forward (kernel.gated, kernel.gated_build), dense and packed: its input checks
and its sm_90a compiles here; on a GPU (marked ``gpu``), its outputs and final states
against references B and C in fp64, on fresh random inputs into NaN-filled outputs, for
gates from -1e-4 to -20 per token, fp16 and bf16, grouped q and k, odd sequence lengths,
packed sequences of one token beside long ones. The modes the gated backward's passes run
(``reverse``, the recurrence backwards in time, and fp32 outputs): their sm_90a compiles
here, their outputs on a GPU against the fp64 recurrence run on the reversed sequences."""

import itertools
import math
from itertools import accumulate

import pytest
import torch

import refs
from kernel.config import KernelConfig
from kernel.gated_build import check_call

# (B, S, G, r, DK, DV): one token, S < C, ragged last chunks, groups (Mamba2's G = 1), DK != DV
SHAPES = [
    (1, 1, 1, 1, 64, 64),
    (2, 17, 2, 1, 128, 128),
    (2, 300, 1, 3, 128, 64),
    (1, 1000, 2, 2, 64, 64),
    (3, 129, 4, 2, 128, 128),
]
GATES = {"-1e-4": (1e-4, 1e-4), "-20": (20.0, 20.0), "-1e-4..-20": (1e-4, 20.0)}
DTYPES = [torch.float16, torch.bfloat16]
CONFIGS = [KernelConfig(64, 64, 1, 128), KernelConfig(64, 64, 2, 256), KernelConfig(64, 128, 1, 128)]
FIRST = CONFIGS[0]  # the config the cases of every shape run
# packed sequences' lengths: one token first, between and last; a chunk and one; ragged
PACKED = [[1, 1, 130, 1, 64, 65, 7, 1], [300], [5, 1, 200, 63]]


def make(b, s, groups, r, dk, dv, *, gates, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, s, groups, dk, generator=gen) for _ in range(2))
    v = torch.randn(b, s, groups * r, dv, generator=gen)
    lo, hi = gates
    u = torch.rand(b, s, groups * r, generator=gen, dtype=torch.float64)
    g = -torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))
    g_gamma = -0.05 * torch.rand(groups * r, generator=gen)
    h0 = torch.randn(b, groups * r, dk, dv, generator=gen)
    q, k, v = (x.to(device=device, dtype=dtype) for x in (q, k, v))
    return q, k, v, g.float().to(device), g_gamma.to(device), h0.to(device)


# ---- the checks (no GPU) -------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda q, k, v, g, gg: (q, k, v, g, gg, torch.tensor([0.0, 5.0])), "cu_seqlens: expected int32"),
        (lambda q, k, v, g, gg: (q, k, v, g, gg, torch.tensor([[0, 5]])), "cu_seqlens: expected int32"),
        (
            lambda q, k, v, g, gg: (q, k, v, g, gg, torch.tensor([0, 5], device="meta")),
            "cu_seqlens: expected dev",
        ),
        (lambda q, k, v, g, gg: (q, k, v, g[:, :-1], gg), "g: expected shape"),
        (lambda q, k, v, g, gg: (q, k, v, g.double(), gg), "g: expected dtype"),
        (lambda q, k, v, g, gg: (q, k, v, g.to("meta"), gg), "g: expected device"),
        (lambda q, k, v, g, gg: (q, k, v, g, gg[:2]), "g_gamma: expected shape"),
        (lambda q, k, v, g, gg: (q, k, v[:, :, :5], g[..., :5], gg[:5]), "multiple of"),
    ],
)
def test_bad_input_is_one_value_error(change, match):
    q, k, v, g, gg, _ = make(1, 5, 2, 3, 64, 64, gates=(1e-4, 20), dtype=torch.float16, device="cpu", seed=0)
    with pytest.raises(ValueError, match=match):
        check_call(*change(q, k, v, g, gg))
    assert check_call(q, k, v, g, gg) == 3


def test_packed_batch_is_one():
    q, k, v, g, gg, _ = make(2, 5, 2, 3, 64, 64, gates=(1e-4, 20), dtype=torch.float16, device="cpu", seed=0)
    with pytest.raises(ValueError, match="batch of 1"):
        check_call(q, k, v, g, gg, torch.tensor([0, 5]))


@pytest.mark.parametrize("packed", [False, True, "pool"], ids=["dense", "packed", "pool"])
def test_compiles_for_sm_90a(packed):
    """One config lowers and compiles with nvcc on a machine without a GPU, without spills;
    the pool's kernel reads and writes its states under run-time conditions."""
    from kernel.gated import gated_fwd, packed_gated_fwd
    from kernel.probe import ProbeFailure, probe_funcs

    knobs = dict(
        heads=4, groups=2, dk=64, dv=64, dtype="float16", chunk=64, block_dv=64, num_stages=1,
        threads=128, arch="sm_90a", scale=0.125,
    )  # fmt: skip
    if packed == "pool":
        make_func = lambda: [packed_gated_fwd(slots="int64", **knobs)]
    else:
        kernel = packed_gated_fwd if packed else gated_fwd
        make_func = lambda: [kernel(**knobs, initial_state=True, final_state=True)]
    found = probe_funcs(make_func, arch="sm_90a")
    assert not isinstance(found, ProbeFailure), found
    assert found.spill_bytes == 0 and found.fits_smem


def test_dense_source_scans_by_rows():
    """The gates are scanned per row, not by ``T.cumsum``, into a register (see
    kernel.gated.gate_weights_macro): no shared-memory store inside the scan's loop."""
    from kernel.gated import gated_fwd
    from kernel.probe import compile_funcs

    func = gated_fwd(
        heads=4, groups=2, dk=64, dv=64, dtype="float16", chunk=64, block_dv=64, num_stages=2, threads=256,
        arch="sm_90a", scale=0.125, initial_state=True, final_state=True,
    )  # fmt: skip
    (kernel,) = compile_funcs([func], "sm_90a")
    source = kernel.get_kernel_source()
    assert "exp2f" in source and "CumSum" not in source
    scan = source[source.index("for (int t = 0; t < 64; ++t)") :]
    scan = scan[: scan.index("\n      }\n")]
    assert "G_f[0] = (G_f[0] +" in scan and "G_s" not in scan, scan


# (H, G, DK, DV): Mamba2's heads of one group (DK != DV), and no groups
BACKWARD_SHAPES = [(24, 1, 128, 64), (16, 16, 128, 128)]
# the backward's modes: the reversed pass (dk and dv), fp32 outputs (dq), and both (dk)
MODES = {
    "reverse": dict(reverse=True),
    "fp32-out": dict(out_dtype="float32"),
    "reverse-fp32-out": dict(reverse=True, out_dtype="float32"),
}


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("shape", BACKWARD_SHAPES, ids=str)
def test_backward_modes_compile_for_sm_90a(shape, packed):
    """The reversed kernel and the fp32 output lower and compile with nvcc for sm_90a (64-token
    chunks, value blocks of 64, one stage, 256 threads), with states in and out, with no
    spill beyond the forward's at the same config and in the block's shared memory. At
    block_dv 128 (DK = DV = 128) the forward itself spills under the 128-register cap
    (164 to 188 bytes) and each mode's spills move by up to 16 bytes either way with
    ptxas's allocation: no bound is asserted there."""
    from kernel.gated import gated_fwd, packed_gated_fwd
    from kernel.probe import ProbeFailure, probe_funcs

    heads, groups, dk, dv = shape
    knobs = dict(
        heads=heads, groups=groups, dk=dk, dv=dv, dtype="float16", chunk=64, block_dv=64, num_stages=1,
        threads=256, arch="sm_90a", scale=dk**-0.5, initial_state=True, final_state=True,
    )  # fmt: skip
    kernel = packed_gated_fwd if packed else gated_fwd
    found = {
        name: probe_funcs(lambda mode=mode: [kernel(**knobs, **mode)], arch="sm_90a")
        for name, mode in {"forward": {}, **MODES}.items()
    }
    for name, result in found.items():
        assert not isinstance(result, ProbeFailure), (name, result)
        print(name, shape, "packed" * packed, result.registers, result.spill_bytes, result.smem_bytes)
    for name in MODES:
        assert found[name].spill_bytes <= found["forward"].spill_bytes, (name, found[name], found["forward"])
        assert found[name].fits_smem, (name, found[name])


@pytest.mark.parametrize("heads", [4, 6])
def test_reverse_source_reads_its_gates_one_token_ahead_and_stores_fp32(heads):
    """The reversed kernel reads each chunk's gates one token ahead: by TMA, one row past Q's
    tile, where H is a multiple of 4 (``kernel.gated.GATE_BOX``); else by scalar loads under a
    bound on the sequence's end (``s_end``). The fp32 output tile leaves by a TMA store of fp32."""
    from kernel.gated import gated_fwd
    from kernel.probe import compile_funcs

    func = gated_fwd(
        heads=heads, groups=2, dk=64, dv=64, dtype="float16", chunk=64, block_dv=64, num_stages=1,
        threads=256, arch="sm_90a", scale=0.125, initial_state=True, final_state=True, reverse=True,
        out_dtype="float32",
    )  # fmt: skip
    (kernel,) = compile_funcs([func], "sm_90a")
    lines = kernel.get_kernel_source().splitlines()
    if heads % 4 == 0:
        (gate,) = [line for line in lines if "tma_load(Gate_desc" in line]
        (query,) = [line for line in lines if "tma_load(Q_desc" in line]
        assert "(c * 64)) - 63)" in gate and "(c * 64)) - 64)" in query, (gate, query)
    else:
        reads = [n for n, line in enumerate(lines) if "Gate[" in line]
        assert reads and all(
            lines[n - 1].lstrip().startswith("if (") and "s_end" in lines[n - 1] for n in reads
        )
    assert any("tl::tma_store(O_desc, (&(((float*)O_s)" in line for line in lines)


# ---- on the GPU ------------------------------------------------------------------------------


def run_case(shape, gates, dtype, config, *, seed, gamma=True, states=True):
    from kernel.gated_build import gated_forward

    b, s, groups, r, dk, dv = shape
    q, k, v, g, gg, h0 = make(*shape, gates=gates, dtype=dtype, device="cuda", seed=seed)
    out = torch.full_like(v, math.nan)
    kw = dict(g_gamma=gg if gamma else None, scale=dk**-0.5, initial_state=h0 if states else None)
    o, ht = gated_forward(q, k, v, g, **kw, output_final_state=True, config=config, out=out)
    torch.cuda.synchronize()
    assert o is out
    ref_c, state_c = refs.gated_kernel_mimic(
        q, k, v, g, config.chunk, block_dv=config.block_dv, **kw, output_final_state=True
    )
    ref_b = refs.gated_chunked(q, k, v, g, config.chunk, **kw)
    label = f"{shape} gates {gates} {dtype} {config}"
    for name, want, got in (("o vs C", ref_c, o), ("o vs B", ref_b, o), ("state vs C", state_c, ht)):
        err = refs.rel_l2(got, want)
        print(f"{label} {name}: rel L2 {err:.3e}")
        assert bool(got.isfinite().all()), f"{label} {name}: non-finite"
        assert err < refs.TOLERANCE, f"{label} {name}: rel L2 {err:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gates", GATES.values(), ids=GATES.keys())
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_references(shape, gates, dtype):
    run_case(shape, gates, dtype, FIRST, seed=sum(shape))


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("shape", [(2, 300, 2, 2, 128, 128), (2, 200, 1, 4, 64, 64)], ids=str)
def test_configs_match_references(shape, config):
    if config.block_dv > shape[-1]:
        pytest.skip("block_dv wider than DV")
    run_case(shape, (1e-4, 20.0), torch.float16, config, seed=1)


@pytest.mark.gpu
@pytest.mark.parametrize("gamma, states", itertools.product((False, True), (False, True)))
def test_without_g_gamma_or_states(gamma, states):
    run_case((2, 100, 2, 2, 64, 64), (1e-3, 2.0), torch.bfloat16, FIRST, seed=2, gamma=gamma, states=states)


@pytest.mark.gpu
def test_goal_shape_mamba2_heads():
    """A Mamba2 head layout at length: 24 heads of one group, DK = 128 (d_state), DV = 64."""
    run_case((1, 2048, 1, 24, 128, 64), (1e-4, 20.0), torch.bfloat16, FIRST, seed=3)


def packed_case(lengths, groups, r, dk, dv, gates, dtype, config, *, seed, gamma=True, states=True):
    """Packed sequences of ``lengths`` against references C and B (each sequence alone, from
    its own state), into NaN-filled outputs."""
    from kernel.gated_build import gated_forward

    t = sum(lengths)
    q, k, v, g, gg, _ = make(1, t, groups, r, dk, dv, gates=gates, dtype=dtype, device="cuda", seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    h0 = torch.randn(len(lengths), groups * r, dk, dv, generator=gen).cuda()
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    out = torch.full_like(v, math.nan)
    kw = dict(
        g_gamma=gg if gamma else None, scale=dk**-0.5, initial_state=h0 if states else None, cu_seqlens=cu
    )
    o, ht = gated_forward(q, k, v, g, **kw, output_final_state=True, config=config, out=out)
    torch.cuda.synchronize()
    assert o is out and ht.shape == (len(lengths), groups * r, dk, dv)
    ref_c, state_c = refs.gated_kernel_mimic(
        q, k, v, g, config.chunk, block_dv=config.block_dv, **kw, output_final_state=True
    )
    ref_b, state_b = refs.gated_chunked(q, k, v, g, config.chunk, **kw, output_final_state=True)
    label = f"packed {lengths} G {groups} r {r} {dk}x{dv} gates {gates} {dtype} {config}"
    for name, want, got in (
        ("o vs C", ref_c, o), ("o vs B", ref_b, o), ("state vs C", state_c, ht), ("state vs B", state_b, ht),
    ):  # fmt: skip
        err = refs.rel_l2(got, want)
        print(f"{label} {name}: rel L2 {err:.3e}")
        assert bool(got.isfinite().all()), f"{label} {name}: non-finite"
        assert err < refs.TOLERANCE, f"{label} {name}: rel L2 {err:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gates", GATES.values(), ids=GATES.keys())
@pytest.mark.parametrize("lengths", PACKED, ids=str)
def test_packed_matches_references(lengths, gates, dtype):
    packed_case(lengths, 2, 2, 128, 64, gates, dtype, FIRST, seed=len(lengths))


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_packed_configs_match_references(config):
    packed_case(PACKED[0], 1, 4, 64, 128, (1e-4, 20.0), torch.bfloat16, config, seed=4)


@pytest.mark.gpu
@pytest.mark.parametrize("gamma, states", itertools.product((False, True), (False, True)))
def test_packed_without_g_gamma_or_states(gamma, states):
    packed_case(
        PACKED[2], 2, 1, 64, 64, (1e-3, 2.0), torch.float16, FIRST, seed=5, gamma=gamma, states=states
    )


# ---- the backward's modes on the GPU -------------------------------------------------------------

MODE_TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # rel L2 of o and the final state


def mode_case(shape, dtype, config, *, seed, lengths=None, reverse=True, out_dtype=None):
    """``kernel.gated``'s kernel in one of the backward's modes, compiled for this GPU and
    called on fresh inputs into NaN-filled outputs and final states, against the fp64
    references (``refs.gated_reversed`` where ``reverse``, else ``refs.gated_recurrent``):
    dense ``shape`` (B, S, G, r, DK, DV), or packed sequences of ``lengths`` (B = 1, S their
    sum), with states in and out and gates from -1e-4 to -20 per token."""
    from kernel.arch import get_arch
    from kernel.builder import cuda_arch
    from kernel.gated import gated_fwd, packed_gated_fwd
    from kernel.gated_build import TORCH_DTYPES
    from kernel.probe import compile_funcs

    arch = cuda_arch()
    if lengths is not None and not get_arch(arch).symbolic_shapes:
        pytest.skip(f"{arch} compiles per shape: no packed gated kernel")
    b, s, groups, r, dk, dv = shape
    heads, scale = groups * r, dk**-0.5
    q, k, v, g, gg, h0 = make(*shape, gates=GATES["-1e-4..-20"], dtype=dtype, device="cuda", seed=seed)
    if lengths is not None:
        h0 = torch.randn(len(lengths), heads, dk, dv, generator=torch.Generator().manual_seed(seed)).cuda()
    knobs = dict(
        heads=heads, groups=groups, dk=dk, dv=dv, dtype=TORCH_DTYPES[dtype], chunk=config.chunk,
        block_dv=config.block_dv, num_stages=config.num_stages, threads=config.threads, arch=arch,
        scale=scale, initial_state=True, final_state=True, reverse=reverse, out_dtype=out_dtype,
    )  # fmt: skip
    func = gated_fwd(**knobs, batch=b, seqlen=s) if lengths is None else packed_gated_fwd(**knobs)
    (kernel,) = compile_funcs([func], arch)
    out = torch.full(v.shape, math.nan, dtype=torch.float32 if out_dtype else dtype, device="cuda")
    ht = torch.full((h0.shape[0] * heads, 1, dk, dv), math.nan, device="cuda")
    args = [q, k, v, g, gg, h0.reshape(-1, 1, dk, dv).contiguous(), out, ht]
    if lengths is not None:
        args.append(torch.tensor([0, *accumulate(lengths)], dtype=torch.int32, device="cuda"))
    kernel(*args)
    torch.cuda.synchronize()
    lg = g.double() + gg.double()
    cu = None if lengths is None else args[-1].cpu()
    kw = dict(scale=scale, initial_state=h0.cpu(), cu_seqlens=cu, output_final_state=True)
    inputs = [x.cpu() for x in (q, k, v, lg)]
    want_o, want_s = (
        refs.gated_reversed(*inputs, 64, **kw) if reverse else refs.gated_recurrent(*inputs, **kw)
    )
    bound = MODE_TOLERANCE[dtype]
    label = f"{shape if lengths is None else lengths} {dtype} {config} reverse={reverse} out={out_dtype}"
    for name, want, got in (("o", want_o, out), ("state", want_s, ht.view(want_s.shape))):
        err = refs.rel_l2(got.cpu().double(), want)
        print(f"{label} {name}: rel L2 {err:.3e}")
        assert bool(got.isfinite().all()), f"{label} {name}: non-finite"
        assert err < bound, f"{label} {name}: rel L2 {err:.3e}"


# (B, S, G, r, DK, DV): one token, S < C, ragged last chunks, groups (Mamba2's), DK != DV
MODE_SHAPES = [
    (1, 1, 1, 1, 64, 64),
    (2, 17, 2, 1, 128, 128),
    (2, 300, 1, 3, 128, 64),
    (1, 1000, 1, 24, 128, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", MODE_SHAPES, ids=str)
def test_reverse_matches_the_reversed_recurrence(shape, dtype):
    mode_case(shape, dtype, FIRST, seed=sum(shape))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lengths", PACKED, ids=str)
def test_packed_reverse_matches_the_reversed_recurrence(lengths, dtype):
    """Packed: each sequence's gates stop at its end (the chunk's tile reaches into the next)."""
    mode_case((1, sum(lengths), 2, 2, 128, 64), dtype, FIRST, seed=len(lengths), lengths=lengths)


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_reverse_configs_match(config, packed):
    lengths = PACKED[0] if packed else None
    shape = (1, sum(PACKED[0]), 2, 2, 128, 128) if packed else (2, 300, 2, 2, 128, 128)
    mode_case(shape, torch.float16, config, seed=9, lengths=lengths)


@pytest.mark.gpu
@pytest.mark.parametrize("reverse", [True, False], ids=["reverse", "forward"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_fp32_outputs_match(packed, reverse):
    """fp32 O (the backward's dq and dk), fp16 inputs, within fp16's rounding of fp64."""
    lengths = PACKED[2] if packed else None
    shape = (1, sum(PACKED[2]), 1, 24, 128, 64) if packed else (2, 300, 1, 3, 128, 64)
    mode_case(shape, torch.float16, FIRST, seed=11, lengths=lengths, reverse=reverse, out_dtype="float32")
