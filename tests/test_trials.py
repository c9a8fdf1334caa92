"""tuner.trials: the trial log as a pandas frame and as a listing, and a study against a yardstick."""

import math

import optuna
import pandas as pd
import pytest
from helpers import GRID, SMALL_PROBLEM, gpu_study

from kernel import SEED_CONFIG, KernelConfig
from kernel.trial_schema import EXTRAPOLATED, TRIAL_COLUMNS
from tuner import space
from tuner.trials import LISTING_COLUMNS, best_trials, compare, listing, save_frame, trials_frame


def test_trials_frame_from_hand_built_study():
    study = optuna.create_study()
    study.set_user_attr("problem", SMALL_PROBLEM.to_dict())
    dists = space.search_space(SMALL_PROBLEM).distributions
    ok = optuna.trial.create_trial(
        params=SEED_CONFIG.to_dict(),
        distributions=dists,
        value=0.25,
        user_attrs={"status": "ok", "median_ms": 0.25, "rel_l2": 3e-4, "baseline": True},
    )
    failed = optuna.trial.create_trial(
        params=KernelConfig(32, 32, 2, 128, "regs").to_dict(),
        distributions=dists,
        state=optuna.trial.TrialState.FAIL,
        user_attrs={"status": "compile_failed", "reason": "InternalError: x"},
    )
    study.add_trials([ok, failed])
    study.enqueue_trial(KernelConfig(64, 64, 1, 128).to_dict())
    frame = trials_frame(study)
    assert list(frame.columns) == list(TRIAL_COLUMNS)
    assert frame.status.tolist() == ["ok", "compile_failed", "queued"]
    assert frame.feasible.tolist() == [True, False, False] and frame.baseline.tolist() == [True, False, False]
    assert (
        frame.median_ms[0] == 0.25 and pd.isna(frame.median_ms[1]) and frame.reason[1] == "InternalError: x"
    )
    assert frame.loc[2, ["chunk", "block_dv", "num_stages"]].tolist() == [64, 64, 1]  # the enqueued config


def test_the_log_is_saved_as_csv_and_parquet(tmp_path):
    frame = trials_frame(gpu_study([0.5, None]))
    paths = save_frame(frame, tmp_path / "s" / "trials")
    assert [p.name for p in paths] == ["trials.csv", "trials.parquet"]
    assert pd.read_csv(paths[0]).median_ms.tolist()[0] == 0.5
    pd.testing.assert_frame_equal(pd.read_parquet(paths[1]), frame, check_dtype=False)


def test_compare_against_yardstick():
    grid = trials_frame(gpu_study([0.5, None, 0.2, 0.3, 0.25, 0.4]))
    tpe = trials_frame(gpu_study([0.5, 0.3, None, 0.205]))
    summary = compare(tpe, grid)
    assert summary["best_ms"] == 0.205 and summary["yardstick_best_ms"] == 0.2
    assert summary["gpu_evaluations"] == 3 and summary["yardstick_gpu_evaluations"] == 5
    assert summary["best_over_yardstick"] == pytest.approx(1.025)
    assert summary["gpu_evaluations_to_within_0.05"] == 3  # 0.5, 0.3, then 0.205 (the failure cost no GPU)
    assert summary["yardstick_best_config"] == KernelConfig(**GRID[2].to_dict()).to_dict()
    with pytest.raises(LookupError, match="no feasible, timed trial"):
        compare(trials_frame(gpu_study([None])), grid)


def test_listing_cuts_a_long_reason_to_its_width_and_keeps_it_whole_in_a_note():
    frame = trials_frame(gpu_study([0.5, None]))
    frame.loc[0, "reason"] = "short"
    first = "CompileError: " + "x" * 200
    frame.loc[1, "reason"] = first + "\nsecond line"
    lines = listing(frame, width=130).splitlines()
    assert max(map(len, lines)) == 130 and lines[0].split() == list(LISTING_COLUMNS)
    assert lines[1].endswith(" short") and lines[2].endswith(
        "CompileError: " + "x" * (lines[2].count("x")) + "... [1]"
    )
    assert lines[3] == "" and "".join(line.strip() for line in lines[4:]) == f"[1] {first}"
    assert "second line" not in "\n".join(lines)
    wide = listing(frame, width=400).splitlines()  # room for the whole first line: nothing is cut
    assert wide[2].endswith("x" * 200) and "..." not in "\n".join(wide)


def test_best_orders_configs_tied_at_infinity_by_their_predicted_time():
    """A compile-only study of a head size its latency model never saw: every config is an
    extrapolation, told infinity; ``best`` orders them by the prediction, not by trial number."""
    study = optuna.create_study()
    dists = space.search_space(SMALL_PROBLEM).distributions
    predicted = [2.3, 1.1, None, 1.4]  # None: a trial that recorded no prediction
    for config, x in zip(GRID, predicted):
        attrs = {"status": "ok", "reason": EXTRAPOLATED} | ({"predicted_x_floor": x} if x else {})
        trial = optuna.trial.create_trial(
            params=config.to_dict(), distributions=dists, value=math.inf, user_attrs=attrs
        )
        study.add_trial(trial)
    assert [t.number for t in best_trials(study)] == [1, 3, 0, 2]
