"""tuner.export: a study's best configs as the files a deployment loads."""

import pytest
from helpers import GRID, SMALL_PROBLEM, gpu_study

from kernel.environment import environment
from kernel.ops.deploy import load_config, read_export
from kernel.ops.dispatch import load_dispatch
from tuner import space
from tuner.export import export_best, export_dispatch


def test_best_configs_are_written_best_first(tmp_path):
    study = gpu_study([0.5, None, 0.2, 0.3], env=environment())
    data = export_best(study, tmp_path / "best.json", top=2)
    assert read_export(tmp_path / "best.json") == data
    configs = GRID
    assert [c["trial"] for c in data["configs"]] == [2, 3]
    assert [c["median_ms"] for c in data["configs"]] == [0.2, 0.3]
    assert data["configs"][0]["config"] == configs[2].to_dict()
    assert data["mode"] == "gpu" and data["problem"] == SMALL_PROBLEM.to_dict()
    assert load_config(tmp_path / "best.json") == (SMALL_PROBLEM, configs[2])  # this environment


def test_nothing_feasible_is_nothing_written(tmp_path):
    with pytest.raises(LookupError, match="no feasible, correct trial"):
        export_best(gpu_study([None]), tmp_path / "best.json")
    with pytest.raises(LookupError, match="no feasible, correct trial"):
        export_dispatch([gpu_study([None])], tmp_path / "dispatch.json")
    assert list(tmp_path.iterdir()) == []


def test_dispatch_table_takes_each_studys_best(tmp_path):
    env = environment()
    studies = [gpu_study([0.5, 0.2], env=env), gpu_study([0.1, 0.3], env=env)]
    export_dispatch(studies, tmp_path / "dispatch.json")
    table = load_dispatch(tmp_path / "dispatch.json")
    configs = GRID
    assert [(e.config, e.median_ms) for e in table.entries] == [(configs[1], 0.2), (configs[0], 0.1)]


def test_a_fused_sweep_study_s_best_is_marked_in_the_table(tmp_path):
    """Each entry names its sweep: a study of the backward's fused pass (``--sweep dkdv``)
    is served to the fused pass (``Dispatch.fused``) and not to the forward."""
    env = environment()
    forward, fused = gpu_study([0.5, 0.2], env=env), gpu_study([0.1, 0.3], env=env, sweep="dkdv")
    data = export_dispatch([forward, fused], tmp_path / "dispatch.json")
    assert [e["sweep"] for e in data["entries"]] == ["forward", "dkdv"]
    table = load_dispatch(tmp_path / "dispatch.json")
    assert table.pick(SMALL_PROBLEM).config == GRID[1]
    assert table.fused(SMALL_PROBLEM) == space.search_space(SMALL_PROBLEM, "dkdv").grid[0]


def test_dispatch_refuses_compile_only_and_mixed_studies(tmp_path):
    compile_only = gpu_study([0.5])
    compile_only.set_user_attr("mode", "compile-only")
    with pytest.raises(LookupError, match="compile-only"):
        export_dispatch([compile_only], tmp_path / "dispatch.json")
    here, there = environment(), environment() | {"gpu": "NVIDIA H200"}
    with pytest.raises(LookupError, match="different environments"):
        export_dispatch([gpu_study([0.5], env=here), gpu_study([0.5], env=there)], tmp_path / "dispatch.json")
    assert list(tmp_path.iterdir()) == []
