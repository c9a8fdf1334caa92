"""tuner.bench on the CPU: the HBM floor's bytes, the packed batch, and where a row's
config came from (the bench itself times kernels on a GPU: ``test_bench_gpu``)."""

import importlib.util
import json

import pytest
from helpers import dispatch_file

from kernel import KernelConfig, Problem
from kernel.ops.dispatch import load_dispatch
from tuner.bench import served_by
from tuner.bench_rows import backward_bytes, ratios
from tuner.occupancy import traffic_bytes
from tuner.options import BENCH_PACKED, Packed


def test_traffic_of_the_headline_shape():
    # 537 MB of Q, K, V and O at B=8, H=16, S=4096, DK=DV=128, fp16, and the fp32 final
    # state [8, 16, 128, 128] of the model form: 8.4 MB
    assert traffic_bytes(Problem(8, 16, 4096, 128, 128)) == 536_870_912 + 8_388_608
    # A packed batch of 64 sequences is one [1, T, H, D] call with 64 final states.
    packed = Problem(1, 16, 117_671, 128, 128)
    assert traffic_bytes(packed, sequences=64) == 117_671 * 16 * 512 * 2 + 64 * 16 * 128 * 128 * 4


def test_backward_traffic_of_the_headline_shape():
    # Q, K, V and dO read, dQ, dK and dV written: 7 tensors of 134 MB (fp16), 940 MB; with
    # DV = 2 DK, the three of width DV are twice as wide.
    assert backward_bytes(Problem(8, 16, 4096, 128, 128)) == 7 * 134_217_728
    assert backward_bytes(Problem(1, 1, 1, 64, 128)) == (4 * 64 + 3 * 128) * 2


def test_the_packed_batch_is_seeded_and_spans_its_lengths():
    lengths = BENCH_PACKED.lengths()
    assert len(lengths) == 64 and (min(lengths), max(lengths)) == (100, 8000)
    assert lengths == BENCH_PACKED.lengths() and lengths != sorted(lengths)  # seeded, shuffled
    offsets = BENCH_PACKED.cu_seqlens()
    assert offsets[0] == 0 and offsets[-1] == sum(lengths) == 117_671 and len(offsets) == 65
    assert Packed(sequences=1).lengths() == [100]


def test_bench_rows_say_which_entry_served_a_shape(tmp_path):
    table = load_dispatch(
        dispatch_file(tmp_path, [(Problem(1, 8, 32768, 128, 128), KernelConfig(64, 128, 2, 256))])
    )
    assert served_by(table, Problem(1, 8, 32768, 128, 128)) == "dispatch table: tuned at this shape"
    assert served_by(table, Problem(1, 4, 65536, 128, 128)).endswith("the entry tuned at 1x8x32768")


def test_ratios_hold_the_goals_per_shape_and_pass():
    """Out of the box over tuned, and fla over out of the box, per shape and pass, from
    the rows' medians; None where a side was not timed (here: no tuned backward)."""
    shape = {"batch": 2, "heads": 4, "seqlen": 512, "dk": 64, "dv": 64}
    rows = [
        shape | {"impl": "floor", "median_ms": 0.01},
        shape | {"impl": "out of the box", "median_ms": 0.2},
        shape | {"impl": "tuned", "median_ms": 0.1},
        shape | {"impl": "fla chunk_simple_gla", "median_ms": 0.5},
        shape | {"impl": "torch chunked", "rel_l2": 0.5},  # incorrect: never timed
        shape | {"pass": "fwd+bwd", "impl": "out of the box fwd+bwd", "median_ms": 1.0},
        shape | {"pass": "fwd+bwd", "impl": "fla chunk_simple_gla fwd+bwd", "median_ms": 3.5},
        shape | {"packed": "3 sequences", "impl": "out of the box", "median_ms": 0.4},
    ]
    assert ratios(rows) == [
        {
            "shape": "2x4x512 64/64",
            "pass": "forward",
            "out_of_box_over_tuned": 2.0,
            "fla_over_out_of_box": 2.5,
        },
        {
            "shape": "2x4x512 64/64",
            "pass": "fwd+bwd",
            "out_of_box_over_tuned": None,
            "fla_over_out_of_box": 3.5,
        },
        {
            "shape": "packed 2x4x512 64/64",
            "pass": "forward",
            "out_of_box_over_tuned": None,
            "fla_over_out_of_box": None,
        },
    ]


@pytest.mark.gpu
def test_bench_gpu(tmp_path):
    """A small bench end to end: every implementation in the model form (RetNet's decays,
    scale, final state) within tolerance of C on the output and the state, and timed;
    then a packed batch (ours where decay_attention takes cu_seqlens) against fla; then
    the backward and forward plus backward, gradients within tolerance of reference E."""
    import inspect

    import refs
    from kernel.ops.attention import decay_attention
    from tuner.bench import bench_and_write

    packed = Packed(sequences=5, shortest=1, longest=700, heads=4)
    bench_and_write([(2, 4, 512)], tmp_path, dk=64, dv=64, packed=packed)
    rows = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    assert (tmp_path / "bench.csv").exists() and (tmp_path / "bench.html").exists()
    impls = {(r["impl"], bool(r.get("packed"))) for r in rows}
    assert {("seed config", False), ("torch chunked", False)} <= impls
    for r in rows:
        assert r["rel_l2"] < refs.TOLERANCE and r.get("state_rel_l2", 0) <= r["rel_l2"], r
        assert r["median_ms"] > 0 and r["x_floor"] > 0.5 and r["decay"] == "retnet", r
        assert r["host_ms"] > 0, r
    assert {"out of the box", "out of the box backward", "out of the box fwd+bwd"} <= {
        impl for impl, _ in impls
    }
    packed_impls = {impl for impl, is_packed in impls if is_packed}
    if importlib.util.find_spec("fla") is not None:
        assert ("fla chunk_simple_gla", False) in impls and "fla chunk_simple_gla" in packed_impls
    if "cu_seqlens" in inspect.signature(decay_attention).parameters:
        assert "out of the box" in packed_impls


@pytest.mark.gpu
def test_host_ahead_times_the_gpu_alone():
    """A call whose host side outlasts its kernel (a 3 ms host sleep, then a small copy):
    timed plainly it takes the host's 3 ms; with host_ahead the copy's time alone, and the
    host's time per call beside it."""
    import time

    import torch

    from kernel.timing import time_gpu

    src = torch.randn(1 << 20, device="cuda")
    dst = torch.empty_like(src)

    def slow_host():
        time.sleep(3e-3)
        dst.copy_(src)

    plain, ahead = time_gpu(slow_host, rep_ms=30), time_gpu(slow_host, rep_ms=30, host_ahead=True)
    assert plain.median_ms > 2.5 and plain.host_ms is None
    assert ahead.median_ms < 0.5 and ahead.host_ms > 2.5
    assert torch.equal(dst, src)
