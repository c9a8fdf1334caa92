"""The kernel's config types and the GPU-free resource probe (real TileLang and nvcc)."""

import dataclasses
import json
import re
import subprocess
import sys

import pytest
from helpers import child_env

from kernel import SEED_CONFIG, KernelConfig, ProbeFailure, Problem, Resources
from kernel.arch import ARCHS
from kernel.config import HEADLINE, Call, dkdv_call, model_call, retnet_decay
from kernel.probe import RESOURCE_FIELDS, parse_ptxas, probe, read_resources


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"dk": 0}, "dk must be a positive integer"),
        ({"dk": 100}, "dk must be a multiple of 16"),
        ({"dv": 512}, r"dv must be a multiple of 16 in \[16, 256\]"),
        ({"alpha": 0.9}, "unexpected keyword argument 'alpha'"),
        ({"dtype": "float32"}, "dtype must be one of"),
        ({"seqlen": -3}, "seqlen must be a positive integer"),
        ({"batch": True}, "batch must be a positive integer"),
    ],
)
def test_problem_rejects(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        Problem(**(HEADLINE.to_dict() | kwargs))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"chunk": 48}, "power of two"),
        ({"chunk": 8}, "power of two >= 16"),
        ({"block_dv": 24}, "multiple of 16"),
        ({"threads": 96}, "multiple of 128"),
        ({"num_stages": 0}, "num_stages must be a positive integer"),
        ({"scores": "l2"}, "scores must be one of"),
    ],
)
def test_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KernelConfig(**kwargs)


def test_config_must_tile_problem():
    with pytest.raises(ValueError, match="block_dv must divide dv"):
        probe(Problem(1, 1, 64, 64, 96), KernelConfig(block_dv=64))


def test_round_trip_and_unknown_fields():
    config = KernelConfig(128, 64, 3, 256, "regs")
    assert KernelConfig.from_dict(config.to_dict()) == config
    assert Problem.from_dict(HEADLINE.to_dict()) == HEADLINE
    with pytest.raises(ValueError, match="unknown Problem fields"):
        Problem.from_dict(HEADLINE.to_dict() | {"decay": 0.9})
    with pytest.raises(ValueError, match="unknown KernelConfig fields"):
        KernelConfig.from_dict({"chunk": 64, "blockdv": 32})


def test_a_problem_written_with_one_alpha_reads_without_it():
    """Best-config files and dispatch tables from before the decay became a run-time input
    name one alpha: it is read and ignored, as the tuned config serves every decay."""
    assert Problem.from_dict(HEADLINE.to_dict() | {"alpha": 0.99}) == HEADLINE
    assert "alpha" not in HEADLINE.to_dict()


def test_the_model_form_is_retnets():
    """What the tuner measures: RetNet's gammas 1 - 2^(-5-h) (fla's chunk_retention), the
    query scale DK^-1/2 and the final state out, no state in."""
    assert retnet_decay(4) == (1 - 1 / 32, 1 - 1 / 64, 1 - 1 / 128, 1 - 1 / 256)
    assert all(0 < g < 1 for g in retnet_decay(16)) and retnet_decay(64)[-1] == 1.0  # 1 - 2^-68
    with pytest.raises(ValueError, match="heads must be a positive integer"):
        retnet_decay(0)
    call = model_call(Problem(2, 8, 100, 64, 128))
    assert call == Call(scale=0.125, initial_state=False, final_state=True)


@pytest.mark.parametrize(
    "chunk,block_dv,estimate",
    [(64, 16, 88), (64, 32, 112), (64, 64, 160), (64, 128, 256), (128, 32, 320), (128, 128, 512)],
)
def test_seed_register_arithmetic(chunk, block_dv, estimate):
    """The seed's fragment arithmetic, as printed in its section 5."""
    assert KernelConfig(chunk, block_dv).seed_register_estimate(HEADLINE) == estimate


def test_parse_ptxas():
    log = """ptxas info    : Compiling entry function 'main_kernel' for 'sm_90a'
    424 bytes stack frame, 564 bytes spill stores, 460 bytes spill loads
ptxas info    : Used 240 registers, used 4 barriers, 1024 bytes smem"""
    assert parse_ptxas(log) == {
        "registers": 240,
        "stack_frame": 424,
        "spill_stores": 564,
        "spill_loads": 460,
        "static_smem": 1024,
    }
    with pytest.raises(ValueError, match="registers"):
        parse_ptxas("nothing here")


# What the compiler for sm_90a says of the seed's configs (registers, spills, shared memory).
def test_probe_c64_bdv32_does_not_spill():
    res = probe(HEADLINE, KernelConfig(64, 32, 2, 128))
    assert isinstance(res, Resources), res
    assert res.spill_bytes == 0 and res.stack_frame == 0
    assert res.fits_smem and 0 < res.smem_bytes <= ARCHS["sm_90a"].smem_per_block == res.smem_limit
    assert res.threads_launched == 256  # 128 consumers + TileLang's producer warp group
    assert res.registers <= 255 and res.seed_register_estimate == 112


def test_probe_c64_bdv128_spills():
    res = probe(HEADLINE, KernelConfig(64, 128, 2, 128))
    assert isinstance(res, Resources), res
    assert res.spill_stores > 0 and res.spill_loads > 0
    assert res.fits_smem


def test_probe_c128_bdv128_exceeds_shared_memory():
    res = probe(HEADLINE, KernelConfig(128, 128, 2, 128))
    assert isinstance(res, Resources), res
    assert not res.fits_smem and res.smem_bytes > res.smem_limit == ARCHS["sm_90a"].smem_per_block


@pytest.mark.parametrize(
    "config", [KernelConfig(32, 32, 2, 128, "regs"), KernelConfig(64, 32, 2, 256, "regs")]
)
def test_probe_reports_layout_failure_as_value(config):
    """TileLang 0.1.15 cannot lay out register scores at C = 32 or 256 threads."""
    res = probe(Problem(1, 2, 256, 64, 64), config)
    assert isinstance(res, ProbeFailure)
    assert res.stage == "lower"
    assert "Layout infer conflict" in res.message


def test_scores_in_smem_unlock_the_layout_failures():
    res = probe(Problem(1, 2, 256, 64, 64), KernelConfig(32, 32, 2, 256, "smem"))
    assert isinstance(res, Resources), res


def test_seed_config_is_the_seed():
    assert SEED_CONFIG == KernelConfig(64, 32, 2, 128, "regs")


def _tiles_released_under_a_pending_mma(source: str) -> list[str]:
    """Replay one kernel's generated CUDA in program order and return each stage buffer
    the consumer hands back to the TMA producer (``mbarrier[...].arrive()``) while a
    committed wgmma group that reads it may still run (no ``wait`` has retired it)."""
    token = re.compile(
        r"mbarrier\[\(\(\w+ & 1\) \+ (?P<wait>\d+)\)\]\.wait\("
        r"|tma_load\((?P<load>\w+)_desc"
        r"|initialize_wgmma_descriptor<[^>]*>\(\w+, \(&\(\(\(half_t\*\)(?P<operand>\w+)\)"
        r"|(?P<commit>warpgroup_commit_batch\(\))"
        r"|(?:wait_wgmma|warpgroup_wait)<(?P<keep>\d)>\(\)"
        r"|mbarrier\[\(\(\w+ & 1\) \+ (?P<release>\d+)\)\]\.arrive\(\)"
    )
    buffer_of: dict[str, str] = {}  # release barrier -> the buffer the producer refills
    last_wait, issued, pending, hazards = None, set(), [], []
    for m in token.finditer(source):
        if m["wait"]:
            last_wait = m["wait"]
        elif m["load"]:
            buffer_of[last_wait] = f"{m['load']}_s"
        elif m["operand"]:
            issued.add(m["operand"])
        elif m["commit"]:
            pending, issued = [*pending, issued], set()
        elif m["keep"] is not None:
            pending = pending[len(pending) - int(m["keep"]) :] if int(m["keep"]) else []
        elif m["release"] and any(buffer_of.get(m["release"]) in group for group in pending):
            hazards.append(buffer_of[m["release"]])
    return hazards


@pytest.mark.parametrize(
    "config,step",
    [
        (KernelConfig(64, 128, 2, 256), "transposed"),
        (KernelConfig(64, 64, 2, 256), "async"),
        (KernelConfig(32, 64, 2, 128), "sync"),
    ],
    ids=lambda x: x.label if isinstance(x, KernelConfig) else x,
)
@pytest.mark.parametrize("segments", [1, 4])
def test_chunk_step_never_hands_back_a_tile_an_mma_still_reads(config, step, segments):
    """TileLang's pipeliner releases a stage buffer after the last statement naming it; for
    an async wgmma that is its issue, so the async steps name each tile again after the
    wait that covers it. Checked on the generated CUDA of the kernel that runs the chunk
    step (single-pass, or the split's outputs kernel: lowered, the CUDA nvcc would compile),
    and the checker itself on a copy of that CUDA with the waits deleted."""
    from kernel.probe import lower
    from kernel.variants import prim_funcs

    config = dataclasses.replace(config, segments=segments)
    source = lower(prim_funcs(Problem(1, 2, 1024, 128, 128), config, arch="sm_90a")[-1]).kernel_source
    assert ("wait_wgmma" in source) == (step != "sync")
    assert ("wgmma_rs" in source) == (step == "transposed")  # the state as a register operand
    assert ("S_s" in source) == (step != "transposed")
    assert _tiles_released_under_a_pending_mma(source) == []
    if step != "sync":
        unsafe = re.sub(r"tl::(wait_wgmma|warpgroup_wait)<\d>\(\);", "", source)
        assert set(_tiles_released_under_a_pending_mma(unsafe)) == {"Q_s", "K_s", "V_s"}


@pytest.mark.parametrize(
    "config",
    [KernelConfig(64, 128, 1, 256), KernelConfig(64, 64, 1, 256), KernelConfig(32, 32, 1, 128)],
    ids=lambda c: c.label,
)
def test_no_two_shared_buffers_share_memory(config):
    """With one chunk the loop is unrolled and TileLang, judging lifetimes by the statements
    that name a buffer, gave Kw_s's memory to O_s while the state's wgmma still read Kw_s
    (kernel.variants.PASS_CONFIGS): every buffer must own its bytes. One chunk, a ragged
    one and many are one program on sm_90a (S symbolic), lowered once."""
    from kernel.probe import lower
    from kernel.variants import prim_funcs

    funcs = [
        prim_funcs(Problem(2, 8, s, 128, 128), config, Call(0.125, True, True), arch="sm_90a")
        for s in (1, 63, 1000)
    ]
    assert len({f.script() for (f,) in funcs}) == 1
    source = lower(funcs[0][0]).kernel_source
    offsets = re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", source)
    assert len(offsets) >= 5 and len({offset for _, offset in offsets}) == len(offsets), offsets


@pytest.mark.parametrize(
    "config,transposed",
    [
        (KernelConfig(64, 128, 2, 256), True),  # 64 rows of S^T per consumer warpgroup
        (KernelConfig(64, 64, 2, 128), True),  # one consumer warpgroup, 64 rows
        (KernelConfig(128, 128, 1, 256, segments=2), True),
        (KernelConfig(64, 64, 2, 256), False),  # two warpgroups would get 32 rows each
        (KernelConfig(64, 64, 1, 128, "regs"), False),  # the scores MMA reads shared memory
        (KernelConfig(32, 64, 2, 128), False),  # 32-row chunks take the sync step
    ],
    ids=lambda c: c.label if isinstance(c, KernelConfig) else "",
)
def test_configs_without_the_transposed_layout_fall_back_and_compile(config, transposed):
    """The transposed step needs 64 rows of S^T per consumer warpgroup and the scores in
    shared memory; every other config compiles with the async (or sync) step instead."""
    from kernel.probe import compile_kernel
    from kernel.scalar_decay import transposes

    knobs = config.to_dict()
    assert transposes(**{k: knobs[k] for k in ("chunk", "block_dv", "threads", "scores")}) == transposed
    source = compile_kernel(Problem(1, 2, 1024, 128, 128), config)[-1].get_kernel_source()
    assert ("ST_h" in source, "S_s" in source) == (transposed, not transposed)  # S^T in registers
    assert ("wait_wgmma" in source) == (config.chunk >= 64)


def test_states_buffer_has_the_shape_the_split_kernels_declare():
    import torch

    from kernel.seq_split import prim_funcs
    from kernel.variants import states_buffer

    problem, config = Problem(2, 3, 1000, 64, 128), KernelConfig(64, 64, 2, 128, segments=4)
    buffer = states_buffer(problem, config, "cpu")
    for arch, rows in (("sm_90a", "batch * 3"), ("sm_80", "6")):  # B symbolic, or the problem's
        for func, arg in zip(prim_funcs(problem, config, arch=arch), (4, 2, 4)):  # states, carry, outputs
            declared = func.buffer_map[func.params[arg]]
            assert [str(n) for n in declared.shape] == [rows, *map(str, buffer.shape[1:])]
            assert buffer.shape[0] == problem.batch * problem.heads
            assert buffer.dtype == torch.float32 and str(declared.dtype) == "float32"


@pytest.mark.parametrize(
    "config, call",
    [
        (KernelConfig(64, 128, 2, 256, "smem"), model_call(Problem(1, 4, 64, 128, 128))),
        (KernelConfig(64, 64, 2, 128, "smem", segments=4), Call(0.125, True, True, reverse=True)),
        (KernelConfig(64, 128, 1, 256, "smem", segments=2), dkdv_call(Problem(1, 4, 64, 128, 128))),
    ],
    ids=["single-pass", "split-reversed", "dkdv-split"],
)
def test_one_kernel_serves_every_batch_and_length_where_shapes_are_symbolic(config, call):
    """On sm_90a the kernels of two shapes of one head count, DK, DV, dtype and chunk class
    (S a multiple of the chunk, or not) are the same program, so one compile serves both
    (``kernel.variants.shape_generic``); the other class, or another head count, is another
    program; on sm_80, where shapes stay static, every shape is its own."""
    from kernel.variants import prim_funcs, shape_generic

    a, b = Problem(2, 4, 1000, 128, 128), Problem(7, 4, 4097, 128, 128)  # ragged
    c, d = Problem(2, 4, 1024, 128, 128), Problem(3, 4, 4096, 128, 128)  # whole chunks
    other_heads = Problem(2, 8, 1000, 128, 128)

    def program(problem, arch):
        return [f.script() for f in prim_funcs(problem, config, call, arch=arch)]

    def key(problem, arch):
        return shape_generic(problem, config, arch)

    assert program(a, "sm_90a") == program(b, "sm_90a") != program(c, "sm_90a") == program(d, "sm_90a")
    assert program(a, "sm_90a") != program(other_heads, "sm_90a")
    assert key(a, "sm_90a") == key(b, "sm_90a") != key(c, "sm_90a") == key(d, "sm_90a")
    assert key(a, "sm_90a") != key(other_heads, "sm_90a")
    assert program(a, "sm_80") != program(b, "sm_80")
    assert key(a, "sm_80") == a


def test_unused_state_has_the_declared_shape_and_allocates_only_to_grow():
    """The placeholder H0 and HT of a call without states: the shape the single-pass
    kernel declares, fp32 whatever torch's default dtype, a prefix of one kept buffer."""
    import torch

    from kernel.scalar_decay import prim_func
    from kernel.variants import unused_state

    big, small = Problem(4, 3, 100, 64, 32), Problem(2, 3, 700, 64, 32)
    func = prim_func(small, KernelConfig(64, 32, 1, 128), arch="sm_90a")
    torch.set_default_dtype(torch.float64)
    try:
        first = unused_state(small, "cpu")
        grown, again = unused_state(big, "cpu"), unused_state(small, "cpu")
    finally:
        torch.set_default_dtype(torch.float32)
    for arg in (4, 6):  # H0, HT: [B*H, 1, DK, DV], B symbolic
        declared = func.buffer_map[func.params[arg]].shape
        assert first.shape[0] == small.batch * small.heads and str(declared[0]) == "batch * 3"
        assert tuple(first.shape[1:]) == tuple(int(n) for n in declared[1:])
    assert first.dtype == grown.dtype == torch.float32 and first.is_contiguous()
    assert grown.shape[0] == 12 and again.shape == first.shape
    assert again.data_ptr() == grown.data_ptr() != first.data_ptr()  # grew once, then reused


def test_the_package_exports_the_build_function_whatever_was_imported_first():
    """``kernel`` loads ``build`` lazily; no submodule of that name may shadow it."""
    import kernel.builder
    from kernel import build
    from kernel.probe import probe

    assert build is kernel.builder.build and callable(build) and callable(probe)


def test_the_packed_kernel_compiles_once_for_every_token_and_sequence_count():
    """Packed sequences: T and N are symbolic in the kernel's signature (one compile serves
    every packing), and the probe reads its resources from a grid that is symbolic too."""
    from kernel.variants import prim_funcs

    call = Call(scale=0.125, initial_state=True, final_state=True, packed=True)
    problem, config = Problem(1, 8, 1, 128, 128), KernelConfig(64, 128, 2, 256)
    (func,) = prim_funcs(problem, config, call, arch="sm_90a")
    q_shape = func.buffer_map[func.params[0]].shape
    offsets = func.buffer_map[func.params[-1]].shape
    assert [str(n) for n in q_shape] == ["1", "tokens", "8", "128"] and [str(n) for n in offsets] == [
        "offsets"
    ]
    res = probe(problem, config, call=call)
    assert isinstance(res, Resources) and res.threads_launched == 384 and res.spill_stores == 0
    with pytest.raises(ValueError, match="packed sequences run the single-pass kernel"):
        prim_funcs(problem, KernelConfig(64, 128, 2, 256, segments=2), call, arch="sm_90a")


def test_a_class_of_whole_chunks_that_does_not_lower_compiles_the_ragged_class_instead():
    """TileLang 0.1.15 fails to lower this split's kernels for whole chunks (a sync in a
    divergent region); ``compile_class`` then compiles the ragged class, which serves every
    length (``kernel.variants.shape_generic``)."""
    from kernel.builder import compile_class
    from kernel.probe import compile_kernel

    problem, config = Problem(2, 4, 64, 128, 128), KernelConfig(32, 32, 1, 128, "smem", segments=64)
    call = model_call(problem)
    with pytest.raises(Exception, match="ThreadSync"):
        compile_kernel(problem, config, "sm_90a", call)
    kernels = compile_class(problem, config, call, "sm_90a")
    assert len(kernels) == 3 and all(k.get_kernel_source() for k in kernels)


def test_a_resources_cache_entry_that_cannot_be_read_is_made_again(tmp_path):
    """A truncated, foreign or incomplete entry reads as none (the probe then makes it
    again), never as an error or as resources."""
    good = dict.fromkeys(RESOURCE_FIELDS, 1)
    path = tmp_path / "entry.json"
    assert read_resources(path) is None  # none yet
    path.write_text(json.dumps(good))
    assert read_resources(path) == good
    for bad in (
        json.dumps(good)[:-5],
        "[1]",
        json.dumps(good | {"registers": "many"}),
        json.dumps({"registers": 1}),
    ):
        path.write_text(bad)
        assert read_resources(path) is None, bad


def test_a_split_s_kernels_compiled_in_threads_are_those_lowered_one_at_a_time():
    """``probe`` and ``build`` compile a split's kernels in threads; with TileLang's cache
    off (a child process), each one's CUDA must be what a lowering of its own gives (the
    source nvcc then compiles: lowered alone, not compiled, to spare three nvcc runs)."""
    script = """
from kernel.config import KernelConfig, Problem, dkdv_call
from kernel.probe import _compile, lower, target
from kernel.variants import prim_funcs
p = Problem(1, 4, 1024, 64, 64)
for call in (None, dkdv_call(p)):
    funcs = prim_funcs(p, KernelConfig(64, 64, 2, 256, "smem", 4), *[call] * bool(call), arch="sm_90a")
    alone = [lower(f, arch="sm_90a").kernel_source for f in funcs]
    threaded = _compile(funcs, target("sm_90a"))
    assert len(funcs) == 3
    assert alone == [k.get_kernel_source() for k in threaded]
print("same")
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=child_env(TILELANG_DISABLE_CACHE="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("same"), out.stderr[-2000:]
