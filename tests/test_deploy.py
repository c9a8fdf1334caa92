"""kernel.ops.deploy: the best-config loader refuses a file measured elsewhere or for another problem."""

import pytest
from helpers import best_config_file

from kernel import KernelConfig, Problem
from kernel.environment import environment
from kernel.ops.deploy import ExportError, load_config, read_export


def test_loader_refuses_other_environment_or_problem(tmp_path):
    assert load_config(best_config_file(tmp_path))[1] == KernelConfig(64, 64, 1, 128)
    elsewhere = best_config_file(
        tmp_path,
        environment={
            "gpu": "NVIDIA H200",
            "capability": "9.0",
            "tilelang": "0.1.15",
            "torch": "2.11.0",
            "cuda": "13.0",
        },
    )
    with pytest.raises(ExportError, match="another environment"):
        load_config(elsewhere)
    edited = best_config_file(tmp_path, environment=environment() | {"kernel": "0" * 12})  # code changed
    with pytest.raises(ExportError, match="kernel: file '000000000000'"):
        load_config(edited)
    assert load_config(elsewhere, allow_mismatch=True)[1] == KernelConfig(64, 64, 1, 128)
    other = Problem(2, 2, 256, 64, 64)
    with pytest.raises(ExportError, match="was tuned for"):
        load_config(best_config_file(tmp_path), problem=other)
    with pytest.raises(ExportError, match="version"):
        load_config(best_config_file(tmp_path, version=99))
    with pytest.raises(ExportError, match="block_dv must divide dv"):
        load_config(best_config_file(tmp_path), problem=Problem(1, 2, 256, 64, 32), allow_mismatch=True)


def test_unreadable_or_foreign_files_are_export_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": ')
    with pytest.raises(ExportError, match="cannot read best-config file"):
        read_export(bad)
    with pytest.raises(ExportError, match="cannot read best-config file"):
        read_export(tmp_path / "missing.json")
    with pytest.raises(ExportError, match="is not a decay-tuner/best-configs file"):
        read_export(best_config_file(tmp_path, format="something/else"))
    with pytest.raises(ExportError, match="holds no configs"):
        read_export(best_config_file(tmp_path, configs=[]))
    with pytest.raises(ExportError, match="malformed entry"):
        load_config(best_config_file(tmp_path, configs=[{"config": {"chunk": 65}}]))
    for changes, said in (
        ({"problem": None}, "problem is not a JSON object: None"),
        ({"problem": {"batch": 1, "heads": 2, "seqlen": 64}}, "problem lacks dk, dv"),
        ({"configs": ["abc"]}, "configs\\[0\\] is not a JSON object: 'abc'"),
        ({"configs": [{"config": 3}]}, "configs\\[0\\].config is not a JSON object: 3"),
    ):
        with pytest.raises(ExportError, match=f"best.json: malformed entry: {said}$"):
            load_config(best_config_file(tmp_path, **changes), allow_mismatch=True)
    with pytest.raises(ExportError, match="a best-config file is named by a path .*, got 42"):
        load_config(42)
    with pytest.raises(ExportError, match="best.json: malformed environment: 'x'"):
        load_config(best_config_file(tmp_path, environment="x"), allow_mismatch=True)


def test_a_file_written_with_one_alpha_loads_without_it(tmp_path):
    """A best-config file from before the decay became a run-time input names one alpha in
    its problem: it is read and the alpha ignored (the config serves every decay)."""
    from helpers import SMALL_PROBLEM

    old = best_config_file(tmp_path, version=1, problem=SMALL_PROBLEM.to_dict() | {"alpha": 0.99})
    assert load_config(old) == (SMALL_PROBLEM, KernelConfig(64, 64, 1, 128))
