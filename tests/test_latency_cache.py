"""The latency model per GPU (``tuner.latency_cache``): a GPU's measured trials in a real
storage refit its model into the user's cache (or rescale one, where they are few), a
compile-only run for that GPU then ranks by it and says so, and a GPU never seen ranks by
the shipped model."""

import dataclasses
import json
import math
import statistics

import optuna
import pytest

from kernel.config import Problem
from tuner import fit_data, latency, latency_cache, latency_fit, space
from tuner.cli import main
from tuner.options import Options
from tuner.tuner import Tuner

H100 = "NVIDIA H100 80GB HBM3"  # the GPU of the committed grids below (tuner/data/README.md)
NEAR64 = fit_data.path("threads128-near64-h100.jsonl")  # 7 shapes of 8 configs


def store(storage: str, samples: list, gpu: str) -> None:
    """``samples`` as the measured GPU trials of one study per shape, as a GPU run records them."""
    by_shape: dict[tuple, list] = {}
    for s in samples:
        by_shape.setdefault(s.shape, []).append(s)
    for shape, found in by_shape.items():
        study = optuna.create_study(storage=storage, study_name="-".join(map(str, shape)))
        study.set_user_attr("problem", found[0].problem.to_dict())
        study.set_user_attr("mode", "gpu")
        study.set_user_attr("sweep", found[0].sweep)
        distributions = space.search_space(found[0].problem, found[0].sweep).distributions
        for s in found:
            f = s.resources
            attrs = {
                "status": "ok",
                "mode": "gpu",
                "median_ms": s.median_ms,
                "arch": s.arch,
                "environment": {"gpu": gpu, "arch": s.arch},
                "registers": f.registers,
                "static_smem": 0,
                "dynamic_smem": f.smem_bytes,
                "threads_launched": f.threads,
            }
            trial = optuna.trial.create_trial(
                params=s.config.to_dict(), distributions=distributions, value=s.median_ms, user_attrs=attrs
            )
            study.add_trial(trial)


def test_a_gpu_s_measured_trials_refit_its_model_which_compile_only_runs_for_it_then_use(tmp_path, capsys):
    """Seven shapes of committed H100 timings as a storage's GPU trials (and one compile-only
    study, whose trials count for nothing): the refresh refits the H100's model from them and
    the package's H100 grids, into the cache; a compile-only run for the H100 ranks by it and
    says so, ``model show`` lists it, and a GPU never seen ranks by the shipped model."""
    url = f"sqlite:///{tmp_path / 'gpu.db'}"
    trials = latency_fit.from_sweep(NEAR64)[0]
    store(url, trials, H100)
    shipped_grids = [s for g in fit_data.grids_of(H100, "sm_90a") for s in latency_fit.from_sweep(g)[0]]
    assert {g.name for g in fit_data.grids_of(H100, "sm_90a")} == {
        "sweep-128x128-bfloat16-h100.jsonl",
        "threads128-h100.jsonl",
        "threads128-near64-h100.jsonl",
    }
    line = latency_cache.refresh(
        optuna.storages.RDBStorage(url), url, gpu=H100, arch="sm_90a", bandwidth=3.35e12
    )
    path = latency_cache.cached_path(H100, "sm_90a")
    assert path.name == "nvidia-h100-80gb-hbm3-sm_90a.json" and path.parent == latency_cache.cache_dir()
    model = latency.LatencyModel.load(path)
    count = len(trials) + len(shipped_grids)
    assert line == (
        f"latency model of {H100} refit from {count} timings (Spearman median "
        f"{model.trained['held_out']['spearman_median']:.2f} over {model.trained['held_out']['shapes']} "
        f"shapes): wrote {path}"
    )
    assert model.gpu == H100 and model.arch == "sm_90a" and model.bandwidth == 3.35e12
    assert model.trained["made"] == "refit" and model.trained["timings"] == count
    assert model.trained["judged_on"] == f"shapes left out in {latency_cache.FOLDS} sets"
    assert model.trained["data"][0] == url and model.domain["gate"] == [0.0]
    assert 128 in model.domain["threads"]  # the H100 grids' one-warpgroup configs, which the shipped lacks

    compile_only = Tuner(
        Problem(4, 16, 4096, 128, 128),
        Options(arch="sm_90a", for_gpu="nvidia h100 80gb hbm3", progress=False),
        name="for-h100",
        storage=url,
    )
    assert compile_only.model.key == model.key and not compile_only.gpu
    assert compile_only.model_line == f"latency model: {H100}'s own, refit from {count} timings ({path})"
    assert compile_only.study.user_attrs["ranked_by"] == model.key
    assert compile_only.refresh_model() is None  # it measured nothing

    shipped = latency.LatencyModel.load(latency.MODEL_FILE)
    unseen = Tuner(
        Problem(4, 16, 4096, 128, 128),
        Options(arch="sm_90a", for_gpu="A GPU never seen", progress=False),
        name="for-unseen",
        storage=url,
    )
    assert unseen.model.key == shipped.key
    never = latency_cache.cached_path("A GPU never seen", "sm_90a")
    assert unseen.model_line == (
        f"latency model: the shipped one (of {shipped.gpu}, sm_90a): none cached for A GPU never seen "
        f"on sm_90a ({never})"
    )
    unnamed = latency_cache.model_for(None, "sm_90a")
    assert unnamed[0].key == shipped.key and "--for-gpu names a GPU's own" in unnamed[1]

    assert main(["model", "show"]) == 0
    listed = capsys.readouterr().out
    assert f"{path.name}: {H100} (sm_90a), refit from {count} timings" in listed
    assert f"(--for-gpu '{H100}')" in listed


def test_a_gpu_of_few_timings_and_no_grids_rescales_the_shipped_model(tmp_path):
    """Two shapes of a GPU the package has no grid of (the H100's timings, labelled as
    another GPU): too few shapes to refit, so the shipped model times the median of measured
    over predicted, its ranks unchanged; under 5 trials, nothing is written."""
    url = f"sqlite:///{tmp_path / 'few.db'}"
    every = latency_fit.from_sweep(NEAR64)[0]
    shapes = sorted({s.shape for s in every})[:2]
    trials = [s for s in every if s.shape in shapes]
    store(url, trials, "Another GPU")
    storage = optuna.storages.RDBStorage(url)
    line = latency_cache.refresh(storage, url, gpu="Another GPU", arch="sm_90a", bandwidth=None)
    path = latency_cache.cached_path("Another GPU", "sm_90a")
    model, shipped = latency.LatencyModel.load(path), latency.LatencyModel.load(latency.MODEL_FILE)
    residuals = [s.log_ratio(shipped.bandwidth) - shipped.log_ratio(s.features()) for s in trials]
    factor = math.exp(statistics.median(residuals))
    assert model.trained["made"] == "rescaled" and model.trained["factor"] == pytest.approx(factor)
    assert line.startswith(
        f"latency model of Another GPU rescaled by {factor:.3g} from {len(trials)} timings"
    )
    assert model.trees == shipped.trees and model.baseline == pytest.approx(
        shipped.baseline + math.log(factor)
    )
    assert model.gpu == "Another GPU" and model.bandwidth == shipped.bandwidth
    again = latency_cache.refresh(storage, url, gpu="Another GPU", arch="sm_90a", bandwidth=None)
    assert json.loads(path.read_text())["trained"]["factor"] == pytest.approx(1.0)  # the cached one, rescaled
    assert "rescaled by 1 from" in again

    url_few = f"sqlite:///{tmp_path / 'three.db'}"
    store(url_few, trials[:3], "A third GPU")
    said = latency_cache.refresh(
        optuna.storages.RDBStorage(url_few), url_few, gpu="A third GPU", arch="sm_90a", bandwidth=None
    )
    assert said == "latency model of A third GPU unchanged: 3 measured trials, under the 5 a rescale needs"
    assert not latency_cache.cached_path("A third GPU", "sm_90a").exists()
    none = latency_cache.refresh(
        optuna.storages.RDBStorage(url_few), url_few, gpu="Unmeasured", arch="sm_90a", bandwidth=None
    )
    assert none == "latency model of Unmeasured unchanged: no measured trial of it in the storage"


def test_a_cached_file_that_cannot_be_read_is_named_and_the_shipped_model_ranks():
    """A GPU's cached file that cannot be read: the line names it, the shipped model ranks;
    a GPU's name keys its file whatever its case and spacing."""
    path = latency_cache.cached_path("Broken GPU", "sm_90a")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{}")
    model, line = latency_cache.model_for("Broken GPU", "sm_90a")
    assert model.key == latency.LatencyModel.load(latency.MODEL_FILE).key
    assert line.startswith("latency model: the shipped one (of ") and "cannot read the latency model" in line
    assert latency_cache.gpu_key("nvidia  h100 80GB HBM3", "sm_90a") == latency_cache.gpu_key(H100, "sm_90a")


def test_the_per_token_gate_is_a_feature_no_shipped_timing_has():
    """The gated kernel's hook: a last feature, 0 for a constant decay; a model fitted to
    constant decays alone does not cover a gated config (its prediction is labelled an
    extrapolation)."""
    sample = latency_fit.from_sweep(NEAR64)[0][0]
    assert latency.FEATURES[-1] == "per-token gate" and sample.features()[-1] == 0.0
    gated_problem = dataclasses.replace(sample.problem, gate="token")  # the decay's kind is the problem's
    gated = dataclasses.replace(sample, problem=gated_problem)
    assert gated.features()[:-1] == sample.features()[:-1] and gated.features()[-1] == 1.0
    shipped = latency.latency_model()
    assert len(json.loads(latency.MODEL_FILE.read_text())["features"]) == len(latency.FEATURES) - 1
    config = latency_fit.from_sweep(fit_data.path(fit_data.RULE_GRID))[0][0].config  # a knob it covers
    assert shipped.covers(sample.problem, config) and not shipped.covers(gated_problem, config)
    prediction = shipped.predict(gated_problem, config, sample.resources, arch="sm_90a")
    assert prediction.calibrated and not prediction.covered
