"""The latency model: the shipped file is what ``model fit`` makes of the package's sweeps
(``tuner/data/``), its JSON trees predict what scikit-learn's do, it keeps its held-out
accuracy, and it says so where it is not calibrated."""

import json
import math
from pathlib import Path

import numpy as np
import optuna
import pytest
from sklearn.ensemble import HistGradientBoostingRegressor

from kernel.config import KernelConfig, Problem
from tuner import fit_data, latency, latency_fit, occupancy, space
from tuner.cli import main
from tuner.latency import LatencyModel
from tuner.occupancy import BlockResources
from tuner.options import UsageError

TRAIN = fit_data.path(fit_data.RULE_GRID)  # 16 heads
# what the shipped model was fitted to, less the shapes held out (docs/tuning.md)
SWEEPS = [fit_data.path(name) for name in fit_data.MODEL_GRIDS]
EIGHT_HEADS = fit_data.path("sweep-128x128_128x256-bfloat16-heldout.jsonl")
HELD_OUT = fit_data.MODEL_HELD_OUT


def bhs(s: latency_fit.Sample) -> str:
    return f"{s.problem.batch}x{s.problem.heads}x{s.problem.seqlen}"


@pytest.fixture(scope="module")
def samples() -> tuple[list, list]:
    """The sweeps' timings: those the shipped model was fitted to, and those held out."""
    every = [s for path in SWEEPS for s in latency_fit.from_sweep(path)[0]]
    held = HELD_OUT.split(",")
    return [s for s in every if bhs(s) not in held], [s for s in every if bhs(s) in held]


def test_the_shipped_model_is_what_model_fit_makes_of_the_package_s_sweeps(tmp_path, capsys):
    out = tmp_path / "model.json"
    assert main(["model", "fit", *fit_data.model_fit_args(), "--out", str(out)]) == 0
    made, shipped = json.loads(out.read_text()), json.loads(latency.MODEL_FILE.read_text())
    assert made["trees"] == shipped["trees"] and made["interval"] == shipped["interval"]
    names = lambda trained: [Path(p).name for p in trained.pop("data")]  # noqa: E731
    assert names(made["trained"]) == names(shipped["trained"]) and made["trained"] == shipped["trained"]
    how, named = made["trained"]["judged_on"].split(": ")
    assert how == "held out" and set(named.split(",")) == set(HELD_OUT.split(","))
    assert "spearman" in capsys.readouterr().out


def test_the_json_trees_predict_what_scikit_learn_does(samples):
    train, held = samples
    model = latency_fit.fit(train, gpu="NVIDIA H200", bandwidth=latency.MODEL_BANDWIDTH, trained={})
    x = lambda rows: np.array([s.features() for s in rows])  # noqa: E731
    y = [s.log_ratio(latency.MODEL_BANDWIDTH) for s in train]
    reference = HistGradientBoostingRegressor(**latency_fit.TREE_PARAMS, random_state=0).fit(x(train), y)
    ours = [model.log_ratio(list(row)) for row in x(held)]
    np.testing.assert_allclose(ours, reference.predict(x(held)), rtol=0, atol=1e-5)


def test_the_shipped_model_keeps_its_held_out_accuracy(samples):
    """Judged now, on the held-out shapes, the shipped model scores what it recorded: a
    change to the features that is not refitted fails here. And it ranks far better than
    chance: its top 5 miss a config within 1.03x of the best only at 3x12x6000's forward,
    whose best splits into three waves, as no shape fitted does."""
    model = latency.latency_model()
    rows = latency_fit.judge(model, samples[1])
    assert latency_fit.summary(rows) == model.trained["held_out"]
    assert model.trained["held_out"]["spearman_median"] >= 0.9
    missed = {(r["shape"], r["sweep"]) for r in rows if r["top5_best_over_best"] > 1.03}
    assert missed <= {("3x12x6000", "forward")}


def test_a_prediction_is_calibrated_only_on_the_model_s_architecture():
    model = latency.latency_model()
    problem, config = Problem(4, 16, 8192, 128, 128, "bfloat16"), KernelConfig(64, 128, 3, 256, "smem", 2)
    resources = BlockResources(registers=168, smem_bytes=189_440, threads=384)
    here = model.predict(problem, config, resources, arch="sm_90a")
    assert (
        here.calibrated
        and here.low < here.ratio < here.high
        and here.ms == pytest.approx(here.ratio * occupancy.floor_bytes(problem) / model.bandwidth * 1e3)
    )
    elsewhere = model.predict(problem, config, resources, arch="sm_80")
    assert not elsewhere.calibrated and elsewhere.ms is None and math.isnan(elsewhere.low)
    assert elsewhere.record()["predicted_by"] == "analytic part alone: uncalibrated for sm_80"
    # 128 blocks on 108 SMs of one block each: two waves, the second of 20
    assert elsewhere.ratio == pytest.approx(2 * 108 / 128)


def test_fewer_waves_predict_faster_on_the_h200():
    """The grid the H200 sweeps found best at 4x8x8192 (one wave) ranks above the split into
    twice the blocks (two waves), as measured there (0.118 against 0.139 ms)."""
    model = latency.latency_model()
    problem, resources = Problem(4, 8, 8192, 128, 128, "bfloat16"), BlockResources(168, 189_440, 384)
    one, two = (
        model.predict(problem, KernelConfig(64, 128, 3, 256, "smem", n), resources, arch="sm_90a")
        for n in (4, 8)
    )
    assert one.ratio < two.ratio


def test_bad_model_input_is_one_line(tmp_path, monkeypatch, capsys):
    fit = ["model", "fit", "--data", str(TRAIN), "--hold-out", "1x8x256"]
    for extra, said in (
        (["--out", str(tmp_path)], "--out wants a .json file path"),  # refused before the fit
        (["--out", str(TRAIN / "m.json")], "is a file, not a folder"),
        (["--bandwidth", "0"], "--bandwidth wants the GPU's copy rate in bytes/s (finite, > 0), got 0.0"),
        (["--bandwidth", "nan"], "--bandwidth wants"),
        (["--bandwidth", "inf"], "--bandwidth wants"),
        (["--hold-out", ""], "--hold-out wants BxHxS"),  # not the leave-each-out fit
        (["--storage", ""], "--storage wants"),
    ):
        assert main([*fit, *extra]) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err
    assert main(["model", "fit", "--data", str(tmp_path / "none.jsonl"), "--hold-out", "1x8x256"]) == 2
    assert "none.jsonl" in capsys.readouterr().err
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        '{"kind": "env", "env": {"gpu": "G", "arch": "sm_90a"}}\n{"kind": "time", "median_ms": 1}\n'
    )
    assert main(["model", "fit", "--data", str(rows), "--hold-out", "1x8x256"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {rows}: not a sweep's JSON lines: KeyError") and err.count("\n") == 1
    lines = TRAIN.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if json.loads(line)["kind"] == "time")
    for field, value, said in (
        ("median_ms", "0.1", "median_ms '0.1', expected a time in ms"),
        ("median_ms", None, "median_ms None"),
        ("median_ms", 0, "median_ms 0"),
        ("median_ms", math.nan, "median_ms nan"),
        ("median_ms", True, "median_ms True"),
        ("config", "64/64/9/999/xx", "its config 64/64/9/999/xx: scores"),  # no --enqueue: a field
    ):
        row = json.loads(lines[at]) | {field: value}
        rows.write_text("\n".join([*lines[:at], json.dumps(row), *lines[at + 1 :]]))
        assert main(["model", "fit", "--data", str(rows), "--hold-out", "1x8x256"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {rows}: not a sweep's JSON lines") and said in err, err
        assert err.count("\n") == 1
    fits = ["model", "fit", "--data", str(TRAIN), "--hold-out", "1x16x512", "--out", "/proc/m.json"]
    assert main(fits) == 2  # after the fit: one line, no traceback
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: cannot write /proc/m.json") and not any("Traceback" in e for e in err)


def _shipped_with(**changes) -> str:
    return json.dumps(json.loads(latency.MODEL_FILE.read_text()) | changes)


def _shipped_domain_with(**changes) -> dict:
    return json.loads(latency.MODEL_FILE.read_text())["domain"] | changes


@pytest.mark.parametrize(
    "content",
    [
        None,  # no file
        '{"format": "decay-tuner-latency-model", "trees": [',
        "[1]",
        _shipped_with(bandwidth=0),
        _shipped_with(interval="ab"),
        _shipped_with(domain=[]),
        _shipped_with(trees=[[[0, 1.5, 1, 9, 0]]]),  # a child the tree lacks
        _shipped_with(trees=[[[0, 1.5, 0, 0, 0]]]),  # a node that is its own child: a loop
        _shipped_with(trees=[[]]),
        _shipped_with(trees=[]),  # no trees: every prediction the baseline's
        _shipped_with(baseline=math.nan),  # Optuna would refuse every prediction
        _shipped_with(trees=[[[-1, 0, 0, 0, math.inf]]]),
        _shipped_with(domain=_shipped_domain_with(chunk=64)),  # a value, not a list of them
        _shipped_with(domain=_shipped_domain_with(dk_dv=None)),
        _shipped_with(domain=_shipped_domain_with(dk_dv=[128, 128])),
    ],
)
def test_a_model_file_missing_or_corrupt_falls_back_to_the_analytic_part(
    content, tmp_path, monkeypatch, capsys
):
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    monkeypatch.setenv(latency.MODEL_VARIABLE, str(bad))
    model = latency.latency_model()
    assert latency.latency_model() is model  # read, and warned about, once
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"warning: {bad}: cannot read the latency model")
    problem, config = Problem(8, 16, 4096, 128, 128), KernelConfig(64, 128, 3, 256, "smem")
    resources = occupancy.estimated_resources(problem, config, "forward", "sm_90a")
    prediction = model.predict(problem, config, resources, arch="sm_90a")
    assert not prediction.calibrated and prediction.ms is None
    assert prediction.ratio == occupancy.analytic_ratio(problem, config, resources, "sm_90a")
    assert prediction.record()["predicted_by"] == "analytic part alone: no latency model could be read"
    assert main(["model", "show"]) == 2  # asked for by name: refused
    assert "bad.json" in capsys.readouterr().err


def test_a_model_file_without_a_field_names_it(tmp_path):
    data = json.loads(latency.MODEL_FILE.read_text())
    del data["trained"]
    (tmp_path / "m.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"m\.json: cannot read the latency model: no field 'trained'$"):
        LatencyModel.load(tmp_path / "m.json")


def test_a_model_round_trips_through_its_file(tmp_path):
    model = latency.latency_model()
    model.save(tmp_path / "m.json")
    again = LatencyModel.load(tmp_path / "m.json")
    assert again.trees == model.trees and again.trained == model.trained and again.gpu == "NVIDIA H200"
    assert Path(tmp_path / "m.json").stat().st_size < 100_000


def test_a_storage_s_gpu_trials_are_timings_to_fit_to(tmp_path, samples):
    """The held-out sweep's timings as the GPU trials of studies in a real storage, one study
    per shape as the tuner writes them: read back, they are the same timings, and the
    shipped model judges them as it judges the sweep."""
    storage = f"sqlite:///{tmp_path / 'gpu.db'}"
    by_study: dict[str, list] = {}
    for s in samples[1]:
        by_study.setdefault("-".join(map(str, s.shape)), []).append(s)
    for name, found in by_study.items():
        study = optuna.create_study(storage=storage, study_name=name)
        study.set_user_attr("problem", found[0].problem.to_dict())
        study.set_user_attr("mode", "gpu")
        study.set_user_attr("sweep", found[0].sweep)
        for s in found:
            f = s.resources
            study.add_trial(
                optuna.trial.create_trial(
                    params=s.config.to_dict(),
                    distributions=space.search_space(s.problem, s.sweep).distributions,
                    value=s.median_ms,
                    user_attrs={
                        "status": "ok",
                        "median_ms": s.median_ms,
                        "arch": s.arch,
                        "environment": {"gpu": "NVIDIA H200"},
                        "registers": f.registers,
                        "static_smem": 0,
                        "dynamic_smem": f.smem_bytes,
                        "threads_launched": f.threads,
                    },
                )
            )
    old = optuna.create_study(storage=storage, study_name="older")  # trials without resources: skipped
    old.set_user_attr("problem", samples[1][0].problem.to_dict())
    old.set_user_attr("mode", "gpu")
    distributions = space.search_space(samples[1][0].problem).distributions
    old.add_trial(
        optuna.trial.create_trial(
            params=samples[1][0].config.to_dict(),
            distributions=distributions,
            value=0.1,
            user_attrs={"status": "ok", "median_ms": 0.1},
        )
    )
    read, gpu = latency_fit.from_storage(storage)
    assert gpu == "NVIDIA H200" and sorted(read, key=repr) == sorted(samples[1], key=repr)
    with pytest.raises(UsageError, match="no storage at"):
        latency_fit.from_storage(str(tmp_path / "typo.db"))
    assert not (tmp_path / "typo.db").exists()  # reading never creates a storage
    model = latency.latency_model()
    assert latency_fit.summary(latency_fit.judge(model, read)) == model.trained["held_out"]
    broken = optuna.create_study(storage=storage, study_name="broken")
    broken.set_user_attr("mode", "gpu")
    broken.set_user_attr("problem", {"batch": 1})
    with pytest.raises(UsageError, match="study 'broken' records a malformed problem"):
        latency_fit.from_storage(storage)


def test_a_study_measures_first_what_the_model_predicts_fastest(samples):
    """Before any compile, the model's 4 fastest configs (``space.predicted_first``) hold one
    within 1.03x of the best the H200 measured at every held-out shape but 3x12x6000 (whose
    best splits into three waves, as no shape fitted does); they are configs of the knobs
    it was fitted to that fit a block, and none are proposed where the model is not
    calibrated."""
    groups: dict[tuple, dict] = {}
    for s in samples[1]:
        groups.setdefault(s.shape, {})[s.config] = s.median_ms
    checked, missed = 0, set()
    model = latency.latency_model()
    for (dk, dv, sweep, b, h, seqlen), timed in groups.items():
        problem = Problem(b, h, seqlen, dk, dv, "bfloat16")
        first = space.predicted_first(space.search_space(problem, sweep=sweep, arch="sm_90a"), model)
        assert len(first) == 4 and all(model.covers(problem, c) for c in first)
        assert all(not space.violated(problem, c, "sm_90a", sweep) for c in first)
        if len(timed) >= 3:
            if min(timed[c] for c in first if c in timed) > 1.03 * min(timed.values()):
                missed.add(f"{b}x{h}x{seqlen}")
            checked += 1
    assert checked == 12 and missed <= {"3x12x6000"}
    assert (
        space.predicted_first(space.search_space(Problem(8, 16, 4096, 128, 128), arch="sm_80"), model) == []
    )


def test_model_fit_without_held_out_shapes_leaves_each_shape_out(tmp_path, capsys):
    """A user's calibration: every shape is judged by a fit to the others, then the model is
    fitted to all of them; a storage of one shape cannot be judged, and says so."""
    held = latency_fit.from_sweep(EIGHT_HEADS)[0]
    out = tmp_path / "mine.json"
    assert main(["model", "fit", "--data", str(EIGHT_HEADS), "--out", str(out)]) == 0
    model = LatencyModel.load(out)
    shapes = {s.shape for s in held}
    assert model.trained["judged_on"] == "each shape left out in turn"
    assert model.trained["timings"] == model.trained["held_out_timings"] == len(held)
    rows = capsys.readouterr().out.splitlines()[1:-2]  # the header, a row per shape, the summary, where
    assert (
        len(rows)
        == model.trained["held_out"]["shapes"]
        == sum(sum(s.shape == shape for s in held) >= 3 for shape in shapes)
    )
    assert model.interval[0] < 0 < model.interval[1]
    one = [s for s in held if s.shape == held[0].shape]
    with pytest.raises(UsageError, match="all .* timings are of one shape"):
        latency_fit.fit_each_shape_out(one, gpu="G", bandwidth=latency.MODEL_BANDWIDTH, sources=[])


def test_a_fit_that_ranks_nothing_writes_plain_json_and_says_so(tmp_path, capsys):
    """Two shapes' sweeps, of which one has two timings: each fit to the other predicts its
    configs alike, so no rank correlation exists; the row and the file say none, never NaN."""
    out = tmp_path / "small.json"
    assert main(["model", "fit", "--data", str(fit_data.path("heldout-64x64-bfloat16-64x8x512.jsonl")),
                 "--out", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    row = printed.splitlines()[1].split()
    assert row[:4] == ["64x8x512", "64", "64", "forward"] and row[5] == "-"
    assert "NaN" not in printed and "each shape judged by a fit to the others" in printed
    held = json.loads(out.read_text(), parse_constant=pytest.fail)["trained"]["held_out"]
    assert held["spearman_median"] is None and held["spearman_at_least_0.85"] == 0 and held["shapes"] == 1


def test_spearman_gives_ties_their_average_rank():
    from scipy.stats import spearmanr

    rng = np.random.default_rng(0)
    for n in (3, 5, 12, 40):
        a, b = rng.integers(0, 4, n).tolist(), rng.random(n).tolist()
        assert latency_fit.spearman(a, b) == pytest.approx(spearmanr(a, b).statistic, abs=1e-12)
    assert math.isnan(latency_fit.spearman([1, 1, 1], [1, 2, 3]))


def test_a_prediction_counts_the_sms_of_the_gpu_at_hand():
    """The waves are counted on the GPU's own SMs where known (an H20 has 78, an H200 132,
    the sm_90a reference): the same config predicts slower on fewer SMs."""
    model, problem = latency.latency_model(), Problem(8, 16, 4096, 128, 128)
    config = KernelConfig(64, 128, 3, 256, "smem")
    resources = occupancy.estimated_resources(problem, config, "forward", "sm_90a")
    here = {sms: model.predict(problem, config, resources, arch="sm_90a", sms=sms) for sms in (None, 132, 78)}
    assert here[None] == here[132] and here[78].ratio > here[132].ratio
    assert occupancy.analytic_ratio(problem, config, resources, "sm_80", sms=78) != occupancy.analytic_ratio(
        problem, config, resources, "sm_80"
    )


def test_blocks_per_sm_follow_each_architecture_s_resident_threads():
    """384 threads a block: 5 fit the 2,048 threads of an sm_80 or sm_90a SM, 4 the 1,536 of
    an sm_86, sm_89 or sm_120 one (shared memory and registers permitting)."""
    small = BlockResources(registers=32, smem_bytes=1024, threads=384)
    assert {
        arch: occupancy.blocks_per_sm(small, arch) for arch in ("sm_80", "sm_90a", "sm_86", "sm_89", "sm_120")
    } == {
        "sm_80": 5,
        "sm_90a": 5,
        "sm_86": 4,
        "sm_89": 4,
        "sm_120": 4,
    }


def test_a_timing_takes_the_resources_of_its_own_chunk_class(tmp_path):
    """S = 6000 is no whole number of 64-token chunks: its kernel is the ragged class's, and
    where the sweep probed that class its resources are the timing's; a sweep that probed only
    the class of whole chunks (as before the class had a kernel of its own) lends its own."""
    lines = map(json.loads, EIGHT_HEADS.read_text().splitlines())
    probe = next(r for r in lines if r["kind"] == "probe" and "resources" in r)
    registers = probe["resources"]["registers"]
    ragged = probe | {"ragged": True, "resources": probe["resources"] | {"registers": 255}}
    shape = {k: probe[k] for k in ("dk", "dv", "sweep", "config")} | {"h": probe["heads"], "b": 1}
    times = [{"kind": "time", "s": s, "dtype": "bfloat16", "median_ms": 1.0} | shape for s in (4096, 6000)]
    env = {"kind": "env", "env": {"gpu": "G", "arch": "sm_90a"}}
    path = tmp_path / "sweep.jsonl"
    for probes, want in (([probe, ragged], 255), ([probe], registers)):
        path.write_text("\n".join(json.dumps(r) for r in [env, *probes, *times]))
        whole, odd = latency_fit.from_sweep(path)[0]
        assert whole.resources.registers == registers != 255
        assert odd.resources.registers == want
