"""kernel.ops.dispatch: the table picks the nearest tuned shape and keeps its grid."""

import dataclasses
import json

import pandas as pd
import pytest
import torch
from helpers import DATA, SMALL_PROBLEM, best_config_file, dispatch_file

from kernel import KernelConfig, Problem
from kernel.environment import environment
from kernel.ops.deploy import ExportError
from kernel.ops.dispatch import DispatchEntry, load_dispatch, same_wave


def test_dispatch_picks_the_nearest_shape_and_keeps_its_grid(tmp_path):
    many = KernelConfig(64, 128, 2, 256)  # tuned at B*H = 128, S = 4096: 128 blocks
    few = KernelConfig(64, 128, 2, 256, segments=16)  # tuned at B*H = 8, S = 32768: 128 blocks
    narrow = KernelConfig(64, 32, 1, 128)  # tuned for DV = 64
    table = load_dispatch(
        dispatch_file(
            tmp_path,
            [
                (Problem(8, 16, 4096, 128, 128), many),
                (Problem(1, 8, 32768, 128, 128), few),
                (Problem(8, 16, 4096, 128, 64), narrow),
            ],
        )
    )
    pick = lambda *shape, dv=128: table.pick(Problem(*shape, 128, dv)).config
    segments = lambda config, n: dataclasses.replace(config, segments=n)
    assert pick(8, 16, 4096) == many and pick(1, 8, 32768) == few
    assert pick(2, 4, 16384) == few  # nearer in log2(B*H) + log2(S); B*H = 8 as tuned
    # Other B*H: the segment count that keeps about 128 blocks.
    assert pick(1, 4, 65536) == segments(few, 32) and pick(4, 16, 4096) == segments(many, 2)
    assert pick(16, 16, 2048) == many  # 256 blocks already with one segment
    assert pick(8, 16, 4096, dv=64) == narrow
    # 512 tokens hold 8 chunks: 2 stages leave at most 4 segments, 32 blocks.
    assert pick(1, 8, 512) == segments(few, 4)
    # Too short for any split: the nearest config as a single-pass kernel, pipeline shortened.
    assert table.pick(Problem(1, 1, 64, 128, 128)).config == KernelConfig(64, 128, 1, 256, segments=1)
    with pytest.raises(ExportError, match=r"no dispatch entry for dk=128, dv=32"):
        pick(8, 16, 4096, dv=32)
    with pytest.raises(ExportError, match="no dispatch entry"):
        table.pick(Problem(8, 16, 4096, 128, 128, "bfloat16"))


def test_the_fused_sweep_s_entries_serve_it_alone(tmp_path):
    """Entries of the fused dk and dv pass (``"sweep": "dkdv"``) are picked among
    themselves, as the forward's are, with the segment count of the same grid; a forward
    table has none (``fused``: None, the rule serves), and an unknown sweep is refused."""
    forward = KernelConfig(64, 128, 2, 256)
    fused = KernelConfig(64, 128, 1, 256, segments=4)  # at 2x16x16384: 128 blocks
    path = dispatch_file(
        tmp_path, [(Problem(8, 16, 4096, 128, 128), forward), (Problem(2, 16, 16384, 128, 128), fused)]
    )
    data = json.loads(path.read_text())
    data["entries"][1]["sweep"] = "dkdv"
    path.write_text(json.dumps(data))
    table = load_dispatch(path)
    # The forward's entries alone: its one entry, split to keep its 128 blocks.
    assert table.pick(Problem(2, 16, 16384, 128, 128)).config == dataclasses.replace(forward, segments=4)
    assert table.fused(Problem(2, 16, 16384, 128, 128)) == fused
    assert table.fused(Problem(8, 16, 4096, 128, 128)) == dataclasses.replace(fused, segments=1)
    assert table.fused(Problem(8, 16, 4096, 64, 64)) is None
    narrow = KernelConfig(64, 64, 2, 256)
    assert load_dispatch(dispatch_file(tmp_path, [(SMALL_PROBLEM, narrow)])).fused(SMALL_PROBLEM) is None
    data["entries"][1]["sweep"] = "dq"
    path.write_text(json.dumps(data))
    with pytest.raises(ExportError, match=r"malformed entry: sweep 'dq'"):
        load_dispatch(path)


def test_a_picked_split_never_passes_the_grid_it_was_tuned_with():
    """An entry tuned at 128 blocks (2x16x16384 in 4 segments) serves 3x24x6000 (72 blocks
    unsplit) unsplit: split in two, its 144 blocks would pass the 132 SMs and run a second
    wave (docs/evidence.md#rule-family). A shape it can reach without passing is split."""
    entry = DispatchEntry(Problem(2, 16, 16384, 128, 128), KernelConfig(64, 128, 3, 256, segments=4))
    assert same_wave(entry, Problem(3, 24, 6000, 128, 128)).segments == 1
    assert same_wave(entry, Problem(1, 40, 8192, 128, 128)).segments == 2  # 80 blocks: nearer 128 than 40


def test_the_committed_table_serves_untuned_shapes_the_segment_count_measured_best():
    """The H200 table (retable) serves three shapes it was not tuned at (oos); for each,
    the pick's segment count is the fastest one the oos study measured with its other
    knobs, while the nearest entry's own count was 1.6x slower at two of them."""
    table = load_dispatch(DATA / "retable" / "dispatch.json", allow_mismatch=True)
    slower = 0
    for b, h, s in [(1, 16, 16384), (4, 8, 8192), (1, 4, 65536)]:
        problem = Problem(b, h, s, 128, 128)
        pick = table.pick(problem)
        trials = pd.read_csv(DATA / f"oos/studies/b{b}-h{h}-s{s}-dk128-dv128-a0.99-float16/trials.csv")
        ok = trials[trials.status == "ok"]
        knobs = pd.Series({k: v for k, v in pick.config.to_dict().items() if k != "segments"})
        same = ok[(ok[knobs.index] == knobs).all(axis=1)]
        by_segments = same.groupby("segments").median_ms.min()
        assert pick.config.segments == by_segments.idxmin(), (b, h, s, by_segments.to_dict())
        nearest = min(table.entries, key=lambda e: e.distance(problem))
        slower += by_segments[nearest.config.segments] > 1.5 * by_segments.min()
    assert slower == 2


def test_dispatch_loader_refuses_bad_tables(tmp_path):
    entry = [(SMALL_PROBLEM, KernelConfig(64, 64, 1, 128))]
    here = environment()
    with pytest.raises(ExportError, match="another environment"):
        load_dispatch(dispatch_file(tmp_path, entry, environment=here | {"gpu": "NVIDIA H200"}))
    assert load_dispatch(
        dispatch_file(tmp_path, entry, environment=here | {"gpu": "x"}), allow_mismatch=True
    ).entries
    # never served; nor a malformed arch or capability (once a TypeError)
    for unknown in (
        {"gpu": "x"},
        None,
        {"arch": "sm_91"},
        {"capability": "7.0"},
        {"arch": ["sm_90a"]},
        {"arch": {}},
        {"capability": "9"},
        {"capability": "9.0.1"},
    ):
        with pytest.raises(ExportError, match="does not say which architecture it was tuned for"):
            load_dispatch(dispatch_file(tmp_path, entry, environment=unknown), allow_mismatch=True)
    with pytest.raises(ExportError, match="version"):
        load_dispatch(dispatch_file(tmp_path, entry, version=99))
    with pytest.raises(ExportError, match="holds no entries"):
        load_dispatch(dispatch_file(tmp_path, []))
    with pytest.raises(ExportError, match="malformed entry"):
        load_dispatch(dispatch_file(tmp_path, entry, entries=[{"problem": {"batch": 1}}]))
    good = {"problem": SMALL_PROBLEM.to_dict(), "config": KernelConfig(64, 64, 1, 128).to_dict()}
    for broken in ({"sweep": [1]}, {"problem": None}, {"config": KernelConfig(64, 128, 1, 128).to_dict()}):
        with pytest.raises(
            ExportError, match=r"dispatch.json: malformed entry"
        ):  # dv 64: block_dv 128 cannot tile
            load_dispatch(dispatch_file(tmp_path, entry, entries=[good | broken]))
    hopper = {"gpu": "NVIDIA H200", "arch": "sm_90a"}  # even where another environment is allowed:
    for broken, said in (
        ({"median_ms": "fast"}, "median_ms 'fast', expected a time in ms"),
        ({"config": KernelConfig(64, 16, 1, 128).to_dict()}, "block_dv 16: on sm_90a a multiple of 32"),
        ({"problem": Problem(1, 2, 256, 48, 64).to_dict()}, "on sm_90a the kernels need DK a multiple of 64"),
        # a config no study compiled: over the shared memory of a block, outside the knobs,
        # or with a knob left out (not filled in with a default)
        (
            {
                "problem": Problem(8, 16, 4096, 256, 256).to_dict(),
                "config": KernelConfig(128, 128, 4).to_dict(),
            },
            "shared memory: at least 294912 B, over sm_90a's",
        ),
        (
            {"config": KernelConfig(64, 64, 1, 1024).to_dict()},
            r"\{'threads': 1024\} outside the kernels' knobs",
        ),
        (
            {"config": {"chunk": 64, "block_dv": 64, "num_stages": 1, "scores": "smem"}},
            "config lacks threads",
        ),
        ({"problem": SMALL_PROBLEM.to_dict() | {"batch": 10**400}}, "must be at most 2147483647"),
    ):
        bad = dispatch_file(tmp_path, entry, environment=hopper, entries=[good | broken])
        with pytest.raises(ExportError, match=f"dispatch.json: malformed entry: .*{said}"):
            load_dispatch(bad, allow_mismatch=True)
    with pytest.raises(ExportError, match="dispatch.json: malformed environment: 'x'"):
        load_dispatch(dispatch_file(tmp_path, entry, environment="x"), allow_mismatch=True)
    with pytest.raises(ExportError, match="is not a decay-tuner/dispatch file"):
        load_dispatch(best_config_file(tmp_path))
    with pytest.raises(ExportError, match="dispatch.json: entries is not a list, got 'x'"):
        load_dispatch(dispatch_file(tmp_path, entry, entries="x"))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ExportError, match="cannot read dispatch table .*deep.json"):
        load_dispatch(deep)


def test_a_table_written_with_one_alpha_serves_every_decay(tmp_path):
    """The committed H200 table names alpha = 0.99 in each entry's problem, as tables did
    before the decay became a run-time input: it loads, keyed by shape alone."""
    raw = json.loads((DATA / "retable" / "dispatch.json").read_text())
    assert all(e["problem"]["alpha"] == 0.99 for e in raw["entries"])
    table = load_dispatch(DATA / "retable" / "dispatch.json", allow_mismatch=True)
    assert all("alpha" not in e.problem.to_dict() for e in table.entries)
    assert table.pick(Problem(8, 16, 4096, 128, 128)).problem == Problem(8, 16, 4096, 128, 128)


def test_a_call_checks_a_float_decay_before_building(tmp_path):
    table = load_dispatch(
        dispatch_file(tmp_path, [(Problem(1, 2, 256, 64, 64), KernelConfig(64, 64, 1, 128))])
    )
    q = torch.zeros(1, 256, 2, 64, dtype=torch.float16)
    for bad in (1.5, 0.0, float("nan")):
        with pytest.raises(ValueError, match=r"decay must be in \(0, 1\]"):
            table(q, q, q, decay=bad)
    with pytest.raises(ValueError, match="q must be on a CUDA device"):  # decay_attention's checks
        table(q, q, q)
    with pytest.raises(ValueError, match="q must be a 4-d tensor"):
        table(torch.zeros(3, 3), q, q)
