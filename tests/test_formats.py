"""kernel.formats: one reader for the best-config file, the dispatch table and a study's
record, which brings each version-1 form up to the current one and refuses a newer one."""

import optuna
import pytest
from helpers import SMALL_PROBLEM, best_config_file, dispatch_file

from kernel import KernelConfig, formats
from kernel.environment import environment
from kernel.ops.deploy import ExportError, load_config
from kernel.ops.dispatch import load_dispatch
from reports.data import StudyInfo
from tuner import studies
from tuner.export import export_best
from tuner.options import UsageError
from tuner.trials import trial_config

# A config as files wrote it before the sequence split: no segments (it ran one pass).
UNSPLIT = {k: v for k, v in KernelConfig(64, 64, 1, 128).to_dict().items() if k != "segments"}
# An environment as files recorded it before its architecture: the GPU's capability alone.
BY_CAPABILITY = {k: v for k, v in environment("sm_90a").items() if k != "arch"} | {"capability": "9.0"}


def test_a_version_1_best_config_file_reads_in_the_current_form(tmp_path):
    """One alpha in its problem, a config without segments, no sweep, no arch: read as a
    forward file of the single-pass kernel for the arch of its capability."""
    path = best_config_file(
        tmp_path,
        version=1,
        problem=SMALL_PROBLEM.to_dict() | {"alpha": 0.99},
        environment=BY_CAPABILITY,
        configs=[{"config": UNSPLIT}],
    )
    data = formats.read_file(path, fmt=formats.BEST_CONFIGS, what="best-config file", items="configs")
    assert data["version"] == formats.VERSIONS[formats.BEST_CONFIGS] == 2
    assert data["problem"] == SMALL_PROBLEM.to_dict() and data["sweep"] == "forward"
    assert data["configs"][0]["config"] == KernelConfig(64, 64, 1, 128).to_dict()
    assert data["environment"]["arch"] == "sm_90a"
    assert load_config(path, allow_mismatch=True) == (SMALL_PROBLEM, KernelConfig(64, 64, 1, 128))
    # The current version names every knob: a config without segments is malformed there.
    with pytest.raises(ExportError, match="lacks segments"):
        load_config(best_config_file(tmp_path, configs=[{"config": UNSPLIT}]), allow_mismatch=True)


def test_a_version_1_dispatch_table_reads_in_the_current_form(tmp_path):
    entry = {"problem": SMALL_PROBLEM.to_dict() | {"alpha": 0.9}, "config": UNSPLIT, "median_ms": 0.1}
    path = dispatch_file(tmp_path, [], version=1, environment=BY_CAPABILITY, entries=[entry])
    table = load_dispatch(path, allow_mismatch=True)
    assert table.environment["arch"] == "sm_90a"
    [read] = table.entries
    assert (read.problem, read.config, read.sweep) == (SMALL_PROBLEM, KernelConfig(64, 64, 1, 128), "forward")


def test_a_version_1_study_reads_in_the_current_form(tmp_path):
    """A study from before the run-time decay and the fused pass: its alpha becomes its
    decays (and a run refuses it), its trials without segments ran one pass, its sweep is
    the forward's, what it exports is of the current version."""
    study = optuna.create_study(study_name="old")
    study.set_user_attr("problem", SMALL_PROBLEM.to_dict() | {"alpha": 0.99})
    assert formats.study_record(study.user_attrs, name="old")["sweep"] is None  # no trial: no run yet
    study.add_trial(
        optuna.trial.create_trial(
            params=UNSPLIT,
            distributions={k: optuna.distributions.CategoricalDistribution([v]) for k, v in UNSPLIT.items()},
            value=0.1,
            user_attrs={"status": "ok", "environment": environment("sm_90a")},
        )
    )
    record = formats.study_record(study.user_attrs, name="old", has_trials=lambda: True)
    assert record["problem"] == SMALL_PROBLEM.to_dict() and record["decays"] == [0.99]
    assert record["sweep"] == "forward"
    assert trial_config(study.trials[0]) == KernelConfig(64, 64, 1, 128)
    assert StudyInfo.from_attrs("old", study.user_attrs).decays == (0.99,)
    exported = export_best(study, tmp_path / "best.json")
    assert exported["version"] == 2 and exported["sweep"] == "forward"
    assert exported["problem"] == SMALL_PROBLEM.to_dict()
    with pytest.raises(UsageError, match=r"one compile-time alpha \(0.99\)"):
        studies.open_study(SMALL_PROBLEM, name="old", storage=study._storage)
    fresh = studies.open_study(SMALL_PROBLEM, name="new", storage=study._storage)
    assert fresh.user_attrs[formats.STUDY_VERSION_ATTR] == 2


def test_a_newer_version_is_one_clear_error(tmp_path):
    said = r"version 3; this decay-tuner reads versions 1 to 2: a newer decay-tuner wrote it"
    with pytest.raises(ExportError, match=said):
        load_config(best_config_file(tmp_path, version=3))
    entry = [(SMALL_PROBLEM, KernelConfig(64, 64, 1, 128))]
    with pytest.raises(ExportError, match=said):
        load_dispatch(dispatch_file(tmp_path, entry, version=3))
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    study = studies.open_study(SMALL_PROBLEM, name="next", storage=storage)
    study.set_user_attr(formats.STUDY_VERSION_ATTR, 3)
    with pytest.raises(UsageError, match=f"study 'next' has {formats.STUDY} {said}") as raised:
        studies.load_study("next", storage)
    assert "\n" not in str(raised.value)
    with pytest.raises(ExportError, match="version 'x'"):
        load_config(best_config_file(tmp_path, version="x"))
