"""The decode step on a slot-indexed state pool (``kernel.decode``, ``kernel.ops.decode``).

Without a GPU: the configs and the rule, every bad input refused with one ``ValueError``
before anything is launched (meta tensors), the check of the slot values, and the kernel
compiled for sm_90a at odd head sizes without spills. On a GPU (marked ``gpu``): steps
chained against one step of reference A per call in fp64, with NaN in the output buffer
and in the pool's unused rows, padding and out-of-range slots skipped, prefill then decode
leaving the unused rows untouched, fla's ``fused_recurrent_simple_gla``, a captured CUDA
graph of a padded batch, and ``torch.compile(fullgraph=True)``."""

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

import refs
from kernel.arch import DEFAULT_ARCH, get_arch
from kernel.decode import (
    DECODE_KNOBS,
    RULE_BLOCKS_PER_SM,
    DecodeConfig,
    DecodeProblem,
    decode_choices,
    decode_config,
)
from kernel.ops import decode as ops_decode
from kernel.ops.decode import CHECK_VARIABLE, check_slot_values, checking, decay_decode

SMS = get_arch(DEFAULT_ARCH).sms


# --- configs and the rule -------------------------------------------------------------


def test_config_refuses_knobs_outside_the_table():
    for bad in ({"block_dv": 24}, {"threads": 96}, {"block_dv": True}):
        with pytest.raises(ValueError):
            DecodeConfig(**bad)
    assert DecodeConfig.from_dict(DecodeConfig(64, 256).to_dict()) == DecodeConfig(64, 256)
    assert DecodeConfig(64, 256).label == "64/256"


def test_problem_refuses_bad_fields():
    for bad in (
        {"dk": 100},
        {"dv": 512},
        {"dtype": "float32"},
        {"pool_dtype": "float16"},
        {"scale": float("nan")},
    ):
        with pytest.raises(ValueError):
            DecodeProblem(**({"heads": 8, "dk": 128, "dv": 128} | bad))
    p = DecodeProblem(8, 128, 64, scale=1)
    assert p.scale == 1.0 and isinstance(p.scale, float) and DecodeProblem.from_dict(p.to_dict()) == p


@pytest.mark.parametrize("dk,dv", [(64, 128), (128, 64), (128, 128), (256, 128), (256, 256), (16, 16)])
def test_rule_fills_the_sms_within_the_knobs(dk, dv):
    problem = DecodeProblem(8, dk, dv)
    choices = decode_choices(problem)
    for rows in (1, 8, 64, 512, 2048, 8192, 65536):
        config = decode_config(problem, rows, SMS)
        assert config in choices and config.fits_error(problem) is None
        narrowest = min(d for d in DECODE_KNOBS["block_dv"] if dv % d == 0)
        assert config.blocks(rows, dv) >= RULE_BLOCKS_PER_SM * SMS or config.block_dv == narrowest


def test_choices_keep_each_thread_s_state_in_registers():
    problem = DecodeProblem(8, 256, 128)
    assert DecodeConfig(128, 128).fits_error(problem)  # 256 elements a thread
    assert DecodeConfig(128, 256) in decode_choices(problem)
    assert DecodeConfig(8, 256).fits_error(DecodeProblem(1, 16, 16))  # threads idle


# --- bad input: one ValueError, nothing launched ----------------------------------------


def _meta(n=3, t=1, h=4, dk=64, dv=32, dtype=torch.float16, slots_n=None, pool_rows=8):
    q = torch.empty(n, t, h, dk, dtype=dtype, device="meta")
    k = torch.empty_like(q)
    v = torch.empty(n, t, h, dv, dtype=dtype, device="meta")
    pool = torch.empty(pool_rows, h, dk, dv, dtype=torch.float32, device="meta")
    slots = torch.empty(n if slots_n is None else slots_n, dtype=torch.int32, device="meta")
    return q, k, v, pool, slots


def _bad_calls():
    q, k, v, pool, slots = _meta()
    cpu = torch.device("cpu")
    return {
        "T = 2": dict(zip("qkv", _meta(t=2)[:3])),
        "q on the CPU": {"q": torch.empty_like(q, device=cpu)},
        "k shaped apart": {"k": torch.empty(3, 1, 4, 32, dtype=torch.float16, device="meta")},
        "fp32 q": {"q": q.float(), "k": k.float(), "v": v.float()},
        "head size 24": dict(zip("qkv", _meta(dk=24)[:3])) | {"pool": _meta(dk=24)[3]},
        "pool of 3 dims": {"pool": pool[0]},
        "pool of other heads": {"pool": torch.empty(8, 2, 64, 32, device="meta")},
        "pool of other DK": {"pool": torch.empty(8, 4, 32, 32, device="meta")},
        "pool of no rows": {"pool": torch.empty(0, 4, 64, 32, device="meta")},
        "fp16 pool": {"pool": pool.half()},
        "pool on the CPU": {"pool": torch.empty(8, 4, 64, 32)},
        "pool not contiguous": {"pool": torch.empty(8, 4, 32, 64, device="meta").transpose(2, 3)},
        "pool a list": {"pool": [0.0]},
        "slots float": {"slots": slots.float()},
        "slots int16": {"slots": slots.short()},
        "slots of another N": {"slots": _meta(slots_n=4)[4]},
        "slots 2-d": {"slots": slots[:, None]},
        "slots on the CPU": {"slots": torch.zeros(3, dtype=torch.int32)},
        "slots a list": {"slots": [0, 1, 2]},
        "decay of 3 heads": {"decay": torch.ones(3, device="meta")},
        "decay 0": {"decay": 0.0},
        "decay None": {"decay": None},
        "scale NaN": {"scale": float("nan")},
        "g of T = 2": {"g": torch.empty(3, 2, 4, device="meta")},
        "g of 2 heads": {"g": torch.empty(3, 1, 2, device="meta")},
        "g fp16": {"g": torch.empty(3, 1, 4, dtype=torch.float16, device="meta")},
        "g on the CPU": {"g": torch.empty(3, 1, 4)},
        "g a float": {"g": -0.5},
    }


@pytest.mark.parametrize("name", list(_bad_calls()))
def test_bad_input_is_one_value_error_before_any_launch(name, monkeypatch):
    launched = []
    monkeypatch.setattr(ops_decode, "kernel_for", lambda *a: launched.append(a))
    q, k, v, pool, slots = _meta()
    call = {"q": q, "k": k, "v": v, "decay": 0.9, "pool": pool, "slots": slots, "scale": None}
    call |= _bad_calls()[name]
    with pytest.raises(ValueError):
        decay_decode(call.pop("q"), call.pop("k"), call.pop("v"), call.pop("decay"), **call)
    # The implementation, which eager calls run, checks the same before it looks up a kernel.
    if name not in ("decay 0", "decay None", "scale NaN", "q on the CPU"):
        bad = _bad_calls()[name]
        args = (bad.get("q", q), bad.get("k", k), bad.get("v", v), bad.get("decay"), 0.9, 0.125)
        with pytest.raises(ValueError):
            ops_decode._decode(*args, bad.get("pool", pool), bad.get("slots", slots), bad.get("g"))
    assert not launched


def test_a_call_like_a_checked_one_but_for_one_thing_is_still_refused(monkeypatch):
    """The checks passed for a call's signature are skipped on a repeat; any change is checked."""
    launched = []

    class Fake:
        def run(self, *args, **kwargs):
            launched.append(args)

    monkeypatch.setattr(ops_decode, "_SERVED", {})
    monkeypatch.setattr(ops_decode, "kernel_for", lambda *a: Fake())
    q, k, v, pool, slots = _meta()
    for _ in range(2):
        ops_decode._decode(q, k, v, None, 0.9, 0.125, pool, slots)
    assert len(launched) == 2 and len(ops_decode._SERVED) == 1
    for name, bad in _bad_calls().items():
        if name in ("decay 0", "decay None", "scale NaN"):
            continue
        args = (bad.get("q", q), bad.get("k", k), bad.get("v", v), bad.get("decay"), 0.9, 0.125)
        with pytest.raises(ValueError):
            ops_decode._decode(*args, bad.get("pool", pool), bad.get("slots", slots), bad.get("g"))
    assert len(launched) == 2


def test_a_good_traced_call_gives_the_output_shape():
    q, k, v, pool, slots = _meta()
    o = decay_decode(q, k, v, torch.full((4,), 0.9, device="meta"), pool=pool, slots=slots)
    assert o.shape == (3, 1, 4, 32) and o.dtype == torch.float16 and o.is_meta


def _symbolic(mode, shape, dtype=torch.float32):
    """A fake CUDA tensor of ``shape`` with every size symbolic, as opcheck's
    test_aot_dispatch_dynamic and torch.compile's dynamic shapes trace it."""
    dims = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * len(shape))
    fake = mode.from_tensor(torch.empty(shape, dtype=dtype, device="meta"), symbolic_context=dims)
    fake.fake_device = torch.device("cuda")
    return fake


def test_the_fake_implementation_takes_symbolic_sizes():
    """Traced with every size symbolic, the fake implementation checks what needs no
    concrete sizes and builds no problem of symbolic ones ("heads must be a positive
    integer, got s36", opcheck on a GPU)."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    q, k, v = (_symbolic(mode, (3, 1, 4, 64), torch.float16) for _ in range(3))
    pool, slots = _symbolic(mode, (9, 4, 64, 64)), _symbolic(mode, (3,), torch.int32)
    with mode:
        for decay in (_symbolic(mode, (4,)), None):
            o = torch.ops.decay_tuner.decay_decode.default(q, k, v, decay, 0.9, 0.125, pool, slots)
            assert o.dtype == torch.float16 and o.dim() == 4 and o.device.type == "cuda"


def test_slot_values_checked_on_request(monkeypatch):
    check_slot_values(torch.tensor([-1, 0, 7, -1, 3]), 8)  # padding twice is no repeat
    for bad in ([0, 8], [-2, 1], [3, 1, 3], [2**40, 0]):
        with pytest.raises(ValueError):
            check_slot_values(torch.tensor(bad), 8)
    monkeypatch.delenv(CHECK_VARIABLE, raising=False)
    assert not checking()
    for value, on in (("1", True), ("on", True), ("0", False), ("", False), ("No", False)):
        monkeypatch.setenv(CHECK_VARIABLE, value)
        assert checking() is on
    monkeypatch.setenv(CHECK_VARIABLE, "maybe")
    with pytest.raises(ValueError):
        checking()


# --- compiled for sm_90a without a GPU --------------------------------------------------


# The rule's configs at a small and a large batch, at odd head sizes, a bf16 pool and
# int64 slots, and the widest tile a thread may hold.
PROBED = [
    (DecodeProblem(8, 128, 128, scale=128**-0.5), DecodeConfig(8, 64)),
    (DecodeProblem(8, 128, 128, "bfloat16", "bfloat16", "int64"), DecodeConfig(128, 256)),
    (DecodeProblem(16, 64, 128), DecodeConfig(64, 128)),
    (DecodeProblem(8, 128, 64), DecodeConfig(16, 64)),
    (DecodeProblem(4, 256, 128), DecodeConfig(128, 256)),
    (DecodeProblem(1, 128, 128), DecodeConfig(64, 64)),  # 128 elements a thread
    (DecodeProblem(8, 128, 128, "bfloat16", gated=True), DecodeConfig(32, 128)),  # a gate per token
    (DecodeProblem(1, 128, 128, gated=True), DecodeConfig(64, 64)),
]


@pytest.mark.parametrize("problem,config", PROBED, ids=str)
def test_compiles_for_hopper_without_spills(problem, config):
    from kernel.decode_build import probe_decode
    from kernel.probe import Resources

    res = probe_decode(problem, config, arch="sm_90a")
    assert isinstance(res, Resources), res
    assert res.spill_bytes == 0 and res.stack_frame == 0, res
    assert res.registers <= 200, res
    assert res.smem_bytes <= 4096, res  # the reduction's scratch only
    assert res.threads_launched == config.threads, res


# --- on a GPU ---------------------------------------------------------------------------

DECAYS = [1 - 2 ** (-5 - h) for h in range(16)]


def _inputs(n, h, dk, dv, dtype, *, seed, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    return tuple(
        torch.randn(n, 1, h, d, generator=g, device=device, dtype=torch.float32).to(dtype)
        for d in (dk, dk, dv)
    )


def _pool(rows, h, dk, dv, dtype, *, seed):
    """A pool of random states (never zeros), its rows NaN-poisoned where a test leaves them unused."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(rows, h, dk, dv, generator=g, device="cuda") * 0.5).to(dtype)


def _reference(q, k, v, decay, state, scale):
    """One step of reference A in fp64: ``(o [N, 1, H, DV], state after [N, H, DK, DV])``."""
    return refs.recurrent(
        q.double(), k.double(), v.double(), decay.double(), scale=scale,
        initial_state=state.double(), output_final_state=True,
    )  # fmt: skip


def _rel(ref, got):
    return float((got.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def _unused_rows_untouched(before, after, used):
    keep = torch.ones(before.shape[0], dtype=torch.bool, device=before.device)
    keep[used] = False
    return torch.equal(_bits(before[keep]), _bits(after[keep]))


# (N, H, DK, DV, dtype, pool dtype, slot dtype): every N, H and head size the brief names.
GPU_CASES = [
    (1, 8, 128, 128, torch.float16, torch.float32, torch.int32),
    (3, 16, 128, 128, torch.bfloat16, torch.float32, torch.int64),
    (37, 1, 64, 128, torch.float16, torch.bfloat16, torch.int32),
    (256, 8, 128, 128, torch.bfloat16, torch.bfloat16, torch.int32),
    (37, 8, 128, 64, torch.float16, torch.float32, torch.int32),
    (3, 8, 256, 128, torch.bfloat16, torch.float32, torch.int32),
    (256, 16, 64, 64, torch.float16, torch.float32, torch.int64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_steps_chained_match_reference_a(case):
    n, h, dk, dv, dtype, pool_dtype, slot_dtype = case
    rows = 2 * n + 3
    pool = _pool(rows, h, dk, dv, pool_dtype, seed=1)
    slots = torch.randperm(rows, device="cuda")[:n].to(slot_dtype)
    pool[torch.ones(rows, dtype=torch.bool, device="cuda").index_fill_(0, slots.long(), False)] = float("nan")
    before = pool.clone()
    decay = torch.tensor(DECAYS[:h], device="cuda")
    state = pool[slots.long()].double()
    for step in range(4):
        q, k, v = _inputs(n, h, dk, dv, dtype, seed=10 + step)
        o = decay_decode(q, k, v, decay, pool=pool, slots=slots)
        ref_o, state = _reference(q, k, v, decay, state, dk**-0.5)
        assert o.shape == (n, 1, h, dv) and o.dtype == dtype
        assert not o.isnan().any()
        assert _rel(ref_o, o) < 1e-2, step
        tol = 1e-5 if pool_dtype == torch.float32 else 2e-2
        assert _rel(state, pool[slots.long()]) < tol, step
        state = pool[slots.long()].double()  # a bf16 pool rounds: chain from what it holds
    assert _unused_rows_untouched(before, pool, slots.long())


# (N, H, DK, DV, dtype, pool dtype, slot dtype, a decay beside the gate)
GATED_CASES = [
    (1, 8, 128, 128, torch.float16, torch.float32, torch.int32, True),
    (37, 8, 128, 64, torch.bfloat16, torch.float32, torch.int64, False),
    (256, 16, 64, 64, torch.float16, torch.bfloat16, torch.int32, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GATED_CASES, ids=str)
def test_gated_steps_chained_match_the_gated_reference_a(case):
    """``g`` per (sequence, head), from -1e-4 to -20 (a gate that empties the state), with
    or without a decay beside it; a padding row; the pool's unused rows NaN and untouched."""
    from refs.gated import gated_recurrent

    n, h, dk, dv, dtype, pool_dtype, slot_dtype, with_decay = case
    rows = 2 * n + 3
    pool = _pool(rows, h, dk, dv, pool_dtype, seed=3)
    slots = torch.randperm(rows, device="cuda")[:n].to(slot_dtype)
    if n > 1:
        slots[n // 2] = -1
    live = slots >= 0
    pool[torch.ones(rows, dtype=torch.bool, device="cuda").index_fill_(0, slots[live].long(), False)] = float(
        "nan"
    )
    before = pool.clone()
    decay = torch.tensor(DECAYS[:h], device="cuda") if with_decay else None
    gamma = None if decay is None else decay.double().log()
    state = pool[slots[live].long()].double()
    gen = torch.Generator(device="cuda").manual_seed(4)
    for step, (low, high) in enumerate([(-1e-4, -1e-4), (-20.0, -20.0), (-20.0, -1e-4), (-3.0, -0.01)]):
        q, k, v = _inputs(n, h, dk, dv, dtype, seed=20 + step)
        g = (torch.rand(n, 1, h, generator=gen, device="cuda") * (high - low) + low).float()
        o = decay_decode(q, k, v, decay, pool=pool, slots=slots, g=g)
        assert o.shape == (n, 1, h, dv) and o.dtype == dtype and not o.isnan().any()
        assert not o[~live].any()
        ref_o, state = gated_recurrent(
            q[live], k[live], v[live], g[live].double(), g_gamma=gamma, scale=dk**-0.5,
            initial_state=state, output_final_state=True,
        )  # fmt: skip
        assert _rel(ref_o, o[live]) < 1e-2, step
        tol = 1e-5 if pool_dtype == torch.float32 else 2e-2
        assert _rel(state, pool[slots[live].long()]) < tol, step
        state = pool[slots[live].long()].double()
    assert _unused_rows_untouched(before, pool, slots[live].long())


@pytest.mark.gpu
def test_every_config_writes_every_output_row_and_only_its_slots():
    from kernel.decode_build import build_decode

    problem = DecodeProblem(8, 128, 128, "float16", "float32", "int32", 0.125)
    configs = decode_choices(problem)
    _compile_all(problem, configs)
    n, rows, h = 37, 50, 8
    slots = torch.randperm(rows, device="cuda")[:n].int()
    slots[[0, 5, 36]] = torch.tensor([-1, -7, rows], dtype=torch.int32, device="cuda")  # skipped
    slots[9] = 2**31 - 1
    live = slots[(slots >= 0) & (slots < rows)].long()
    decay = torch.tensor(DECAYS[:h], device="cuda")
    q, k, v = _inputs(n, h, 128, 128, torch.float16, seed=3)
    for config in configs:
        pool = _pool(rows, h, 128, 128, torch.float32, seed=4)
        pool[torch.ones(rows, dtype=torch.bool, device="cuda").index_fill_(0, live, False)] = float("nan")
        before = pool.clone()
        out = torch.full((n, 1, h, 128), float("nan"), dtype=torch.float16, device="cuda")
        build_decode(problem, config).run(q, k, v, decay, slots, pool, out)
        ok = (slots >= 0) & (slots < rows)
        assert not out.isnan().any(), config
        assert (out[~ok] == 0).all(), config
        ref_o, ref_s = _reference(q[ok], k[ok], v[ok], decay, before[live].double(), 0.125)
        assert _rel(ref_o, out[ok]) < 1e-2, config
        assert _rel(ref_s, pool[live]) < 1e-5, config
        assert _unused_rows_untouched(before, pool, live), config


def _compile_all(problem, configs):
    """Compile the configs in threads (TileLang's cache is thread-safe; nvcc runs outside
    the GIL), so that the builds after are cache hits."""
    from kernel.builder import cuda_arch
    from kernel.decode import decode_step
    from kernel.probe import compile_funcs

    compile_funcs([decode_step(problem, c) for c in configs], cuda_arch())


@pytest.mark.gpu
def test_prefill_then_decode_leave_unused_slots_untouched():
    from kernel.ops import decay_attention

    h, dk, dv, rows, n = 8, 128, 128, 16, 5
    decay = torch.tensor(DECAYS[:h], device="cuda")
    pool = torch.full((rows, h, dk, dv), float("nan"), device="cuda")
    slots = torch.tensor([3, 11, 0, 7, 15], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(n, 100, h, d, generator=g, device="cuda").half() for d in (dk, dk, dv))
    o, state = decay_attention(q, k, v, decay, output_final_state=True)
    pool.index_copy_(0, slots.long(), state)  # the prefill writes its states into their slots
    before = pool.clone()
    ref_state = state.double()
    for step in range(3):
        qs, ks, vs = _inputs(n, h, dk, dv, torch.float16, seed=20 + step)
        o = decay_decode(qs, ks, vs, decay, pool=pool, slots=slots)
        ref_o, ref_state = _reference(qs, ks, vs, decay, ref_state, dk**-0.5)
        assert _rel(ref_o, o) < 1e-2
    assert _rel(ref_state, pool[slots.long()]) < 1e-4
    assert _unused_rows_untouched(before, pool, slots.long())
    assert pool[slots.long()].isfinite().all()


@pytest.mark.gpu
def test_checking_mode_refuses_bad_slots_before_the_pool_is_touched(monkeypatch):
    monkeypatch.setenv(CHECK_VARIABLE, "1")
    h, rows = 8, 6
    pool = _pool(rows, h, 64, 64, torch.float32, seed=2)
    before = pool.clone()
    q, k, v = _inputs(3, h, 64, 64, torch.float16, seed=2)
    for bad in ([0, 1, 6], [0, -2, 1], [4, 1, 4]):
        with pytest.raises(ValueError):
            decay_decode(q, k, v, 0.9, pool=pool, slots=torch.tensor(bad, dtype=torch.int32, device="cuda"))
        torch.cuda.synchronize()
        assert torch.equal(pool, before)
    decay_decode(q, k, v, 0.9, pool=pool, slots=torch.tensor([-1, 5, 0], dtype=torch.int32, device="cuda"))
    assert torch.equal(pool[1:5], before[1:5])


@pytest.mark.gpu
def test_matches_fla_fused_recurrent_simple_gla():
    fla = pytest.importorskip("fla.ops.simple_gla")
    n, h, dk, dv, rows = 37, 16, 128, 128, 64
    decay = torch.tensor(DECAYS[:h], device="cuda")
    pool = _pool(rows, h, dk, dv, torch.float32, seed=6)
    slots = torch.randperm(rows, device="cuda")[:n].int()
    h0 = pool[slots.long()].clone()
    q, k, v = _inputs(n, h, dk, dv, torch.bfloat16, seed=6)
    o = decay_decode(q, k, v, decay, pool=pool, slots=slots)
    o_fla, ht = fla.fused_recurrent_simple_gla(
        q, k, v, g_gamma=decay.log(), scale=dk**-0.5, initial_state=h0, output_final_state=True
    )
    assert _rel(o_fla.double(), o) < 1e-2
    assert _rel(ht.double(), pool[slots.long()]) < 1e-5


@pytest.mark.gpu
def test_captured_graph_of_a_padded_batch_replays_new_slots_and_inputs():
    h, dk, dv, rows, padded = 8, 128, 128, 32, 8
    decay = torch.tensor(DECAYS[:h], device="cuda")
    pool = _pool(rows, h, dk, dv, torch.float32, seed=7)
    q, k, v = (torch.zeros(padded, 1, h, d, dtype=torch.float16, device="cuda") for d in (dk, dk, dv))
    slots = torch.full((padded,), -1, dtype=torch.int32, device="cuda")
    o = decay_decode(q, k, v, decay, pool=torch.empty_like(pool), slots=slots)  # warm: compile, checks
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = decay_decode(q, k, v, decay, pool=pool, slots=slots)
    for step, live in enumerate(([4, 9, 30], [0, 1, 2, 3, 4], [31, 17, 9, 8, 2, 1, 0])):
        m = len(live)
        fresh = _inputs(padded, h, dk, dv, torch.float16, seed=30 + step)
        for buf, new in zip((q, k, v), fresh):
            buf.copy_(new)
        slots.fill_(-1)
        slots[:m] = torch.tensor(live, dtype=torch.int32, device="cuda")
        before = pool.clone()
        graph.replay()
        torch.cuda.synchronize()
        ref_o, ref_s = _reference(q[:m], k[:m], v[:m], decay, before[live].double(), dk**-0.5)
        assert _rel(ref_o, o[:m]) < 1e-2, step
        assert (o[m:] == 0).all(), step
        assert _rel(ref_s, pool[live]) < 1e-5, step
        assert _unused_rows_untouched(before, pool, torch.tensor(live, device="cuda")), step


@pytest.mark.gpu
def test_runs_under_torch_compile_fullgraph():
    h, dk, dv, rows, n = 8, 64, 128, 12, 5
    decay = torch.tensor(DECAYS[:h], device="cuda")
    pool = _pool(rows, h, dk, dv, torch.float32, seed=8)
    eager_pool = pool.clone()
    slots = torch.tensor([2, -1, 7, 11, 0], dtype=torch.int32, device="cuda")

    def step(q, k, v, pool, slots):
        return decay_decode(q * 1, k, v, decay, pool=pool, slots=slots) + 0

    compiled = torch.compile(step, fullgraph=True)
    for i in range(2):
        q, k, v = _inputs(n, h, dk, dv, torch.bfloat16, seed=40 + i)
        o = compiled(q, k, v, pool, slots)
        o_eager = step(q, k, v, eager_pool, slots)
        assert torch.equal(o, o_eager), i
        assert torch.equal(pool, eager_pool), i


@pytest.mark.gpu
def test_the_custom_op_passes_torch_s_opcheck():
    h, rows = 4, 9
    q, k, v = _inputs(3, h, 64, 64, torch.float16, seed=9)
    pool = _pool(rows, h, 64, 64, torch.float32, seed=9)
    slots = torch.tensor([4, -1, 0], dtype=torch.int32, device="cuda")
    op = torch.ops.decay_tuner.decay_decode.default
    torch.library.opcheck(op, (q, k, v, torch.full((h,), 0.8, device="cuda"), 1.0, 0.125, pool, slots))
    torch.library.opcheck(op, (q, k, v, None, 0.9, 0.125, pool, slots.long()))


def test_gpu_cases_cover_the_brief_s_sizes():
    assert {c[0] for c in GPU_CASES} == {1, 3, 37, 256}
    assert {c[1] for c in GPU_CASES} >= {1, 8, 16}
    assert set(itertools.chain.from_iterable((c[5], c[6]) for c in GPU_CASES)) >= {
        torch.float32,
        torch.bfloat16,
        torch.int32,
        torch.int64,
    }
