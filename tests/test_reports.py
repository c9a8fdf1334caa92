"""The report: its data exactly on hand-built studies (turned into the trial log the tuner
hands the report: ``tuner.trials.trials_frame`` and a ``StudyInfo``), its figures by smoke,
the CLI, and the page itself in headless Chromium (offline, every plot drawn, a clean console).

The browser tests skip where there is no Chromium or no Playwright, and fail instead under
CI (CI=true), which installs both: a missing install step must not pass as a skip.
"""

import io
import math
import os
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from types import SimpleNamespace

import numpy as np
import optuna
import pandas as pd
import plotly.graph_objects as go
import pytest
from helpers import gpu_study, run_small
from optuna.trial import TrialState

from kernel import KernelConfig, Problem
from kernel.arch import ARCHS
from kernel.config import SEED_CONFIG, knob_choices
from kernel.trial_schema import OUTSIDE, TRIAL_COLUMNS
from refs import TOLERANCE
from reports import (
    StudyInfo,
    browser,
    compiled,
    compiler_figures,
    data,
    decay_figures,
    decays,
    figures,
    peers,
    render_report,
    search,
    write_report,
)
from reports.bench_figure import figure as bench_figure
from reports.stress import PEERS, synthetic_trials
from tuner.cli import main
from tuner.studies import export_dir
from tuner.trials import problem_trials, trial_config, trials_frame

SMEM_LIMIT = ARCHS["sm_90a"].smem_per_block
PROBLEM = Problem(1, 2, 256, 64, 64)
DISTRIBUTIONS = {
    k: optuna.distributions.CategoricalDistribution(v) for k, v in knob_choices(PROBLEM.dv).items()
}
BUDGET = {"spills": 0.0, "smem": float(SMEM_LIMIT), "registers": 255.0}


def _trial(
    config: str,
    status: str,
    *,
    ms: float | None = None,
    err: float | None = None,
    regs: int = 168,
    spills: int = 0,
    smem: int = 100_000,
    reason: str | None = None,
    **attrs,
) -> optuna.trial.FrozenTrial:
    """One hand-built trial of ``config`` ('C/bDV/stages/threads/scores'), as the tuner records it."""
    c, bdv, st, th, sc = config.split("/")
    params = KernelConfig(int(c), int(bdv), int(st), int(th), sc).to_dict()
    user = {"status": status, "mode": "gpu", **attrs}
    if reason:
        user["reason"] = reason
    if status == "compile_failed":
        return optuna.trial.create_trial(
            params=params, distributions=DISTRIBUTIONS, state=TrialState.FAIL, user_attrs=user
        )
    est = KernelConfig.from_dict(params).seed_register_estimate(PROBLEM)
    user |= {"registers": regs, "spill_bytes": spills, "smem_bytes": smem, "seed_register_estimate": est}
    constraints = {
        "spills": spills - BUDGET["spills"],
        "smem": smem - BUDGET["smem"],
        "registers": regs - BUDGET["registers"],
    }
    if ms is not None:
        user |= {"median_ms": ms, "p20_ms": ms * 0.99, "p80_ms": ms * 1.01, "rel_l2": err}
        constraints["correctness"] = err - TOLERANCE
    value = ms if status == "ok" else math.inf
    return optuna.trial.create_trial(
        params=params, distributions=DISTRIBUTIONS, value=value, user_attrs=user, constraints=constraints
    )


def _study(*, peers: dict | None = None, storage: str | None = None, name: str = "hand") -> optuna.Study:
    """Nine trials with every outcome: feasible ones on and off the fronts, a cached repeat,
    an untimed infeasible one, two compile failures with one first line, a wrong result."""
    study = optuna.create_study(storage=storage, study_name=name)
    study.set_user_attr("problem", PROBLEM.to_dict())
    study.set_user_attr("mode", "gpu")
    study.set_user_attr("objectives", ["median_ms"])
    if peers is not None:
        study.set_user_attr("peers", peers)
    layout = "InternalError: Layout infer conflict between A and A_cast\n    loop Fragment({})"
    study.add_trials(
        [
            _trial("64/32/2/128/regs", "ok", ms=0.5, err=3.6e-4, regs=240, baseline=True, smem=110_000),  # 0
            _trial("64/64/1/256/smem", "ok", ms=0.2, err=3.7e-4, smem=120_000),  # 1
            _trial("32/64/1/256/smem", "ok", ms=0.3, err=3.5e-4, smem=60_000),  # 2
            _trial("64/32/1/128/smem", "ok", ms=0.6, err=3.0e-4, regs=240, smem=90_000),  # 3
            _trial("128/64/2/256/smem", "infeasible", spills=64, smem=300_000),  # 4
            _trial("32/32/2/128/regs", "compile_failed", reason=layout.format(1)),  # 5
            _trial("32/16/2/128/regs", "compile_failed", reason=layout.format(2)),  # 6
            _trial("64/16/1/128/smem", "incorrect", ms=0.4, err=0.5, regs=240),  # 7
            _trial("64/64/1/256/smem", "ok", ms=0.2, err=3.7e-4, smem=120_000, cached_from=1),  # 8
        ]
    )
    return study


def _log(study: optuna.Study) -> tuple[pd.DataFrame, StudyInfo]:
    """What ``python -m tuner report`` hands the report: the trial log and the study's info."""
    return trials_frame(study), StudyInfo.from_attrs(study.study_name, study.user_attrs)


def _report(log: tuple[pd.DataFrame, StudyInfo]) -> tuple[pd.DataFrame, StudyInfo]:
    """``report_frame`` of a trial log, and its info (the input of ``reports.data``'s functions)."""
    trials, info = log
    return data.report_frame(trials, info), info


@pytest.fixture(scope="module")
def study() -> optuna.Study:
    return _study()


@pytest.fixture(scope="module")
def info(study) -> StudyInfo:
    return _log(study)[1]


@pytest.fixture(scope="module")
def frame(study) -> pd.DataFrame:
    return _report(_log(study))[0]


# The input ----------------------------------------------------------------------------------


def test_study_info_from_attrs(study, info):
    assert info == StudyInfo(
        name="hand", problem=PROBLEM.to_dict(), mode="gpu", objectives=("median_ms",), peers=None
    )
    bare = StudyInfo.from_attrs("bare", {"unrelated": 1})
    assert bare == StudyInfo(name="bare", problem={}, mode=None, objectives=None, peers=None)
    assert StudyInfo.from_attrs("p", {"peers": PEERS}).peers == PEERS


def test_trial_log_holds_what_the_report_reads(study):
    trials = trials_frame(study)
    assert set(data.FRAME_COLUMNS) <= set(trials.columns), set(data.FRAME_COLUMNS) - set(trials.columns)
    # The synthetic log of reports.stress has exactly the trial log's columns.
    assert set(TRIAL_COLUMNS) == set(trials.columns) | {"constraints"}
    assert data.constraints(trials.constraints[4]) == {
        "spills": 64.0,
        "smem": 300_000 - SMEM_LIMIT,
        "registers": 168 - 255.0,
    }
    with pytest.raises(ValueError, match=r"lacks the columns \['constraints'\]"):
        data.report_frame(
            trials.drop(columns=["constraints"]), StudyInfo.from_attrs("hand", study.user_attrs)
        )


def test_constraints_and_config_label_cells():
    assert data.constraints('{"smem": 1.0, "spills": -2}') == {"smem": 1.0, "spills": -2.0}
    assert data.constraints({"smem": None, "spills": 0.5}) == {"spills": 0.5}  # as Parquet gives it back
    assert data.constraints(None) == data.constraints(math.nan) == data.constraints("") == {}
    knobs = {
        "chunk": 64,
        "block_dv": np.int64(32),
        "num_stages": 2.0,
        "threads": 128,
        "scores": "regs",
        "segments": 1,
    }
    assert data.config_label(knobs) == "64/32/2/128/regs/1" == KernelConfig(scores="regs").label
    assert data.config_label(knobs | {"block_dv": math.nan}) == "64/?/2/128/regs/1"


def test_reports_never_import_the_tuner():
    code = (
        "import sys, reports, reports.bench_figure, reports.stress, reports.browser, reports.data, "
        "reports.decays, reports.figures, reports.page; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tuner'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# Data, exactly ------------------------------------------------------------------------------


def test_report_frame_labels_and_hover(frame):
    assert frame.config.tolist()[:3] == ["64/32/2/128/regs/1", "64/64/1/256/smem/1", "32/64/1/256/smem/1"]
    assert frame.violated.tolist() == ["", "", "", "", "smem, spills", "", "", "correctness", ""]
    assert (frame.decay == "RetNet γ, H = 2: 0.969-0.984").all()
    assert frame.hover[0].startswith(
        "trial 0 · ok · baseline (seed default)<br>C=64 bDV=32 stages=2 "
        "threads=128 scores=regs segments=1<br>median 0.5000 ms (p20 0.4950, p80 0.5050) "
        "· rel_l2 3.60e-04"
    )
    assert "registers 240 (seed estimate" in frame.hover[0] and "smem 110,000 B" in frame.hover[0]
    assert frame.hover[4].endswith("constraint violated: smem, spills")
    assert frame.hover[5].endswith("InternalError: Layout infer conflict between A and A_cast")


def test_summary_and_budgets(frame, info):
    s = data.summary(frame, info)
    assert (s.study, s.mode, s.timed, s.objectives) == ("hand", "gpu", True, ["median_ms"])
    assert s.counts == {"ok": 5, "compile_failed": 2, "infeasible": 1, "incorrect": 1} and s.n_trials == 9
    assert (s.best, s.baseline) == (1, 0)  # 1 and its cached repeat 8 tie; the first wins, as in export
    assert s.budgets == pytest.approx(
        {"spill_bytes": 0, "smem_bytes": SMEM_LIMIT, "registers": 255, "rel_l2": TOLERANCE}
    )
    assert s.metric == "median_ms"


@pytest.mark.parametrize(
    "x,y,expected",
    [
        ([1, 2, 3], [3, 2, 1], [True, True, True]),
        ([1, 2, 3], [1, 2, 3], [True, False, False]),
        ([1, 1, 2], [2, 2, 1], [True, True, True]),  # ties stay on the front
        ([1, 1], [2, 3], [True, False]),  # equal x, worse y: dominated
        ([5], [5], [True]),
    ],
)
def test_pareto_mask(x, y, expected):
    assert search.pareto_mask(np.array(x), np.array(y)).tolist() == expected


def test_pareto_latency_against_error(frame):
    info = search.pareto_info(frame, x="median_ms", y="rel_l2")
    assert info.feasible.number.tolist() == [0, 1, 2, 3, 8]
    assert info.infeasible.number.tolist() == [7]  # timed, but a wrong result
    assert info.untimed.empty
    assert info.front.number.tolist() == [1, 8, 2, 3]  # 0 is beaten by 2 on both axes


def test_pareto_latency_against_resources(frame):
    info = search.pareto_info(frame, x="smem_bytes", y="median_ms")
    assert info.front.number.tolist() == [2, 1, 8]
    assert info.untimed.number.tolist() == [4]  # compiled, over budget, never timed
    spills = search.pareto_info(frame, x="spill_bytes", y="median_ms")
    assert spills.front.number.tolist() == [1, 8]


def test_knob_frame(frame):
    long = search.knob_frame(frame, "median_ms")
    assert len(long) == 5 * 6  # five feasible trials, six knobs
    chunk = long[long.knob == "chunk"]
    assert chunk.choice.tolist() == ["32", "64", "64", "64", "64"]
    assert chunk.number.tolist() == [2, 0, 1, 3, 8]
    assert long[long.knob == "scores"].choice.tolist() == ["regs", "smem", "smem", "smem", "smem"]
    assert list(dict.fromkeys(long.knob)) == [
        "chunk",
        "block_dv",
        "num_stages",
        "threads",
        "scores",
        "segments",
    ]


def test_history(frame):
    h = search.history(frame, "median_ms")
    assert h.number.tolist() == list(range(9))
    nan = math.nan
    np.testing.assert_array_equal(h.value, [0.5, 0.2, 0.3, 0.6, nan, nan, nan, nan, 0.2])
    np.testing.assert_array_equal(h.best, [0.5, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2])


def test_top_configs_speedup_and_baseline(frame):
    top = data.top_configs(frame, ["median_ms"])
    assert top.number.tolist() == [1, 2, 0, 3]  # the cached repeat of 1 is listed once
    assert top.speedup.tolist() == pytest.approx([2.5, 0.5 / 0.3, 1.0, 0.5 / 0.6])
    assert top.baseline.tolist() == [False, False, True, False]
    short = data.top_configs(frame, ["median_ms"], n=2)
    assert short.number.tolist() == [1, 2, 0] and short.baseline.tolist() == [False, False, True]


def test_failures_grouped_by_first_line(frame):
    f = data.failures(frame)
    assert f.to_dict("records") == [
        {
            "status": "compile_failed",
            "reason": "InternalError: Layout infer conflict between A and A_cast",
            "count": 2,
            "trials": [5, 6],
        },
        {"status": "incorrect", "reason": "constraint violated: correctness", "count": 1, "trials": [7]},
        {"status": "infeasible", "reason": "constraint violated: smem, spills", "count": 1, "trials": [4]},
    ]


def test_error_and_register_frames(frame):
    err = decays.error_by_decay(frame)
    assert err.number.tolist() == [0, 1, 2, 3, 7, 8] and (err.decay == frame.decay[0]).all()
    assert err.feasible.tolist() == [True, True, True, True, False, True]
    reg = compiled.register_budget(frame)
    assert reg.number.tolist() == [0, 1, 2, 3, 4, 7]  # each compiled config once; failures have no registers
    # The seed's arithmetic: (DK*bDV + C*bDV + 2*C*C) / threads, DK = 64 here.
    assert reg.seed_register_estimate.tolist() == [
        math.ceil((64 * 32 + 64 * 32 + 2 * 64 * 64) / 128),
        math.ceil((64 * 64 + 64 * 64 + 2 * 64 * 64) / 256),
        math.ceil((64 * 64 + 32 * 64 + 2 * 32 * 32) / 256),
        math.ceil((64 * 32 + 64 * 32 + 2 * 64 * 64) / 128),
        math.ceil((64 * 64 + 128 * 64 + 2 * 128 * 128) / 256),
        math.ceil((64 * 16 + 64 * 16 + 2 * 64 * 64) / 128),
    ]
    assert reg.registers.tolist() == [240, 168, 168, 240, 168, 240] and reg.spill_bytes.tolist()[4] == 64


def test_gamma_is_the_seeds_panel():
    # Seed section 2, panel 2: alpha = 0.5, C = 4; cell (4, 1) is alpha^3 = 0.125.
    g = decays.gamma_info(0.5, 4)
    nan = math.nan
    np.testing.assert_allclose(
        g.gamma,
        [[1, nan, nan, nan], [0.5, 1, nan, nan], [0.25, 0.5, 1, nan], [0.125, 0.25, 0.5, 1]],
        rtol=1e-15,
    )  # exp(log) rounding
    assert (g.alpha, g.chunk) == (0.5, 4)


def test_the_decays_a_study_used():
    """RetNet's per head (what the tuner checks with); a study from before the run-time
    decay (its record's version 1 names one alpha in its problem): that alpha."""
    new = PROBLEM.to_dict()
    assert decays.study_decays(new) == (0.96875, 0.984375)
    assert decays.decay_label(new) == "RetNet γ, H = 2: 0.969-0.984"
    old = StudyInfo.from_attrs("old", {"problem": new | {"alpha": 0.9}})
    assert old.problem == new and old.decays == (0.9,)
    assert decays.study_decays(old.problem, old.decays) == (0.9,)
    assert decays.decay_label(old.problem, old.decays) == "α = 0.9"


def test_overflow_map_matches_the_seeds_table():
    m = decays.overflow_map((1.0, 0.99, 0.8, 0.5), (32, 64))
    assert m.limit == 65504.0
    # Seed section 3: 0.99^-63 = 1.88, 0.8^-31 = 1.01e3 (safe); 0.8^-63 = 1.27e6, 0.5^-31 = 2.15e9 (overflow).
    np.testing.assert_allclose(
        m.peak, [[1, 1], [0.99**-31, 0.99**-63], [0.8**-31, 0.8**-63], [2.0**31, 2.0**63]]
    )
    assert m.overflow.tolist() == [[False, False], [False, False], [False, True], [True, True]]


def test_importance_over_feasible_trials_and_its_failures():
    imp = search.importance(*_report(synthetic_trials(150)))
    assert imp.note is None and sum(imp.values.values()) == pytest.approx(1.0)
    assert next(iter(imp.values)) == "block_dv"  # the toy model's strongest knob
    assert set(imp.values) <= set(knob_choices(PROBLEM.dv))
    fast = _trial("64/64/1/256/smem", "ok", ms=0.2, err=3e-4)
    one = optuna.create_study()
    one.add_trials([fast, _trial("64/16/1/128/smem", "incorrect", ms=0.1, err=0.5)])
    expected = "needs at least 2 feasible trials with median_ms, the study has 1"
    assert search.importance(*_report(_log(one))) == search.Importance({}, expected)
    same = optuna.create_study()
    same.add_trials([fast, _trial("32/64/1/256/smem", "ok", ms=0.2, err=3e-4)])
    assert search.importance(*_report(_log(same))).note == "all 2 feasible trials have the same median_ms"
    assert (
        search.importance(*_report(_log(same)), "smem_bytes").note
        == "all 2 feasible trials have the same smem_bytes"
    )


def test_peers(frame, info):
    absent = peers.peers(frame, info)
    assert absent.bars.empty and 'study user attr "peers"' in absent.note
    timed = peers.peers(*_report(_log(_study(peers={"fla chunk_simple_gla": 0.39, "torch chunked": 4.0}))))
    assert timed.note is None
    assert timed.bars.to_dict("records") == [
        {"name": "decay-tuner best (64/64/1/256/smem/1)", "median_ms": 0.2, "ours": True, "vs_ours": 1.0},
        {"name": "fla chunk_simple_gla", "median_ms": 0.39, "ours": False, "vs_ours": pytest.approx(1.95)},
        {"name": "torch chunked", "median_ms": 4.0, "ours": False, "vs_ours": pytest.approx(20.0)},
    ]
    for bad in ({"fla": "fast"}, {"fla": -1.0}, [0.3], {"fla": math.nan}):
        broken = _report(_log(_study(peers=bad)))
        with pytest.raises(ValueError, match='"peers" must map a name to a positive median'):
            peers.peers(*broken)


def test_compile_only_study_reports_resources():
    frame, info = _report(synthetic_trials(60, mode="compile-only"))
    s = data.summary(frame, info)
    # Every feasible config spills 0 B (the objective): the plots are over shared memory.
    assert (s.mode, s.timed, s.objectives, s.metric) == ("compile-only", False, ["spill_bytes"], "smem_bytes")
    assert frame.median_ms.isna().all() and decays.error_by_decay(frame).empty
    assert peers.peers(frame, info).bars.empty
    assert (
        search.importance(frame, info, "spill_bytes").note
        == "all 24 feasible trials have the same spill_bytes"
    )
    assert search.importance(frame, info, "smem_bytes").note is None
    top = data.top_configs(frame, s.objectives)
    assert (top.spill_bytes[~top.baseline] == 0).all() and top.speedup.isna().all()


def test_a_compile_only_study_with_predictions_plots_them_labelled_as_predictions():
    """What ``run`` on a CPU records: each compiled config's predicted time, the seed's an
    extrapolation (outside the model's knobs). The plots are over the prediction, the
    extrapolations drawn apart and named for what they are; hovering says "predicted"."""
    trials, info = synthetic_trials(60, mode="compile-only")
    ok = trials.status == "ok"
    trials.loc[ok, "predicted_x_floor"] = 1.1 + trials.number[ok] / 100
    trials.loc[ok, ["predicted_low", "predicted_high"]] = (1.0, 1.5)
    trials.loc[ok, "predicted_ms"] = 0.14
    trials.loc[ok, "predicted_by"] = "latency model of NVIDIA H200"
    trials.loc[trials.number == 0, "predicted_by"] = "latency model of NVIDIA H200" + OUTSIDE
    frame, info = _report((trials, info._replace(objectives=("predicted_x_floor",))))
    s = data.summary(frame, info)
    assert s.metric == "predicted_rank" and frame.predicted_rank[frame.number == 0].isna().all()
    # the best is what export picks: the model's best among the configs it covers, never the
    # extrapolation (trial 0's 1.10x is the least prediction)
    covered = frame[frame.feasible & (frame.state == "COMPLETE") & frame.predicted_rank.notna()]
    assert s.best == covered.sort_values(["predicted_rank", "number"]).number.iloc[0] != 0
    assert frame.feasible[frame.number == 0].item()
    infos = [search.pareto_info(frame, x=r, y=s.metric) for r in data.RESOURCES]
    names = {t.name for t in figures.resources_figure(infos, s).data}
    assert "outside the latency model's knobs (drawn at the top)" in names
    assert not any("not timed" in name for name in names)
    hover = frame.hover[frame.number == 0].item()
    assert "predicted 0.1400 ms, 1.10x floor (1.00 to 1.50) · latency model of NVIDIA H200, outside" in hover
    assert figures.knobs_figure(search.knob_frame(frame, s.metric), s.metric).layout.title.text.startswith(
        "predicted time"
    )


# Figures, by smoke --------------------------------------------------------------------------


def test_figures_draw_what_they_are_given(frame, info):
    s = data.summary(frame, info)
    error = figures.pareto_figure(search.pareto_info(frame, x="median_ms", y="rel_l2"), s)
    names = [t.name for t in error.data]
    assert names == [
        "infeasible",
        "feasible",
        "Pareto front",
        "best feasible (by median_ms)",
        "baseline (seed default)",
    ]
    infos = [search.pareto_info(frame, x=r, y="median_ms") for r in data.RESOURCES]
    res = figures.resources_figure(infos, s)
    assert "compiled but not timed (drawn at the top)" in [t.name for t in res.data]
    assert len(res.layout.shapes) == 3  # a budget line per resource
    drawn = [
        figures.knobs_figure(search.knob_frame(frame, "median_ms"), "median_ms"),
        figures.importance_figure(search.Importance({"threads": 0.7, "chunk": 0.3}, None), "median_ms"),
        figures.history_figure(search.history(frame, "median_ms"), "median_ms", s),
        decay_figures.gamma_figure(decays.gamma_info(0.9, 16)),
        decay_figures.overflow_figure(decays.overflow_map(), alpha=0.99, chunks=(32, 64)),
        decay_figures.error_figure(decays.error_by_decay(frame), TOLERANCE),
        compiler_figures.registers_figure(compiled.register_budget(frame), 255.0),
        figures.peers_figure(peers.peers(frame, info._replace(peers=PEERS))),
    ]
    assert all(isinstance(f, go.Figure) and f.data for f in drawn)
    assert len(drawn[4].layout.shapes) == 2  # the study's alpha row, two chunks outlined
    empty = frame.iloc[:0]
    assert figures.knobs_figure(search.knob_frame(empty, "median_ms"), "median_ms") is None
    assert figures.importance_figure(search.Importance({}, "why"), "median_ms") is None
    assert decay_figures.error_figure(decays.error_by_decay(empty), TOLERANCE) is None
    assert figures.peers_figure(peers.peers(frame, info)) is None


def test_bench_figure():
    shape = {"batch": 8, "heads": 16, "seqlen": 4096}
    rows = [
        shape | {"impl": "floor", "median_ms": 0.1, "x_floor": 1.0},
        shape | {"impl": "tuned", "config": "64/128/2/256/smem/1", "median_ms": 0.2, "x_floor": 2.0},
        shape | {"impl": "candidate", "config": "64/64/1/256/smem/1", "median_ms": 0.3, "x_floor": 3.0},
        shape | {"impl": "seed config", "config": "64/32/2/128/regs/1", "median_ms": 0.5, "x_floor": 5.0},
        shape | {"impl": "torch chunked", "median_ms": 4.0, "x_floor": 40.0},
        shape | {"impl": "fla chunk_simple_gla", "rel_l2": 0.5},
    ]  # incorrect: never timed
    fig = bench_figure(rows)
    assert [t.name for t in fig.data] == ["tuned", "seed config", "fla chunk_simple_gla", "torch chunked"]
    assert [list(t.y) for t in fig.data] == [[2.0], [5.0], [], [40.0]]
    assert fig.data[0].x == ("B=8 H=16 S=4096",) and fig.data[0].text == ("0.200 ms",)
    assert fig.data[0].hovertext == ("64/128/2/256/smem/1",) and fig.data[3].hovertext == ("",)
    assert fig.layout.yaxis.type == "log" and len(fig.layout.shapes) == 1  # the floor, dashed at 1
    backward = [
        shape | {"pass": "backward", "impl": "out of the box backward", "median_ms": 0.4, "x_floor": 1.9},
        shape | {"pass": "fwd+bwd", "impl": "fla chunk_simple_gla fwd+bwd", "median_ms": 2.0, "x_floor": 6.0},
    ]
    names = [t.name for t in bench_figure(rows + backward).data]
    assert names == [
        "tuned",
        "seed config",
        "out of the box backward",
        "fla chunk_simple_gla",
        "fla chunk_simple_gla fwd+bwd",
        "torch chunked",
    ]


def test_page_is_self_contained(study):
    page = render_report(*_log(study))
    assert page.count("<script") == 1 + 9  # plotly.js once, then one call per figure
    assert page.count('class="plotly-graph-div"') == 9 and page.count("Plotly.newPlot(") == 9
    body = page.split("<body>")[1]
    assert "src=" not in body and "https://" not in body  # nothing to fetch: the browser test checks it too
    assert "64/64/1/256/smem" in page and "2.50×" in page  # the best config and its speed-up
    assert "Layout infer conflict" in page and "no peer timings" in page


def test_the_latency_model_is_drawn_against_the_gpu_where_trials_have_both():
    """Trials that recorded a prediction beside their measurement: the page gives the median
    of measured over predicted, per knob choice too, and draws one against the other."""
    frame, info = _log(_study())
    assert "fig-predicted" not in render_report(frame, info)  # no prediction: no section
    predicted = {0: 0.25, 1: 0.1, 2: 0.3, 3: 0.3}  # feasible trials 0 to 3: measured 0.5, 0.2, 0.3, 0.6
    frame["predicted_ms"] = frame.number.map(predicted)
    page = render_report(frame, info)
    assert "measured / predicted 2.00 (median of 4 trials" in page and "fig-predicted" in page
    assert "chunk 32 1.00" in page and "chunk 64 2.00" in page  # 0.3/0.3; 0.5/0.25, 0.2/0.1, 0.6/0.3


def test_compile_only_page_says_so():
    page = render_report(*synthetic_trials(60, mode="compile-only"))
    assert "Compile-only study: nothing was timed" in page and "no latency-against-error front" in page


def test_a_gpu_study_that_timed_nothing_yet_is_not_called_compile_only():
    frame, info = synthetic_trials(20)
    frame["median_ms"] = math.nan  # every trial failed before its timing
    page = render_report(frame, info)
    assert "GPU study: no trial was timed yet" in page and "Compile-only" not in page


def test_empty_trial_log_is_refused(study, info):
    with pytest.raises(ValueError, match="study 'hand' has no trials: nothing to report"):
        render_report(trials_frame(study).iloc[:0], info)


# The CLI ------------------------------------------------------------------------------------


def test_report_command(tmp_path, capsys, monkeypatch):
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    _study(storage=storage, name="hand")
    out = tmp_path / "out" / "hand.html"
    assert main(["report", "--study", "hand", "--storage", storage, "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_text().startswith("<!DOCTYPE html>")
    opened = []
    monkeypatch.setattr("webbrowser.open", lambda url: opened.append(url) or True)
    monkeypatch.setattr("tuner.cli.STUDIES_DIR", tmp_path / "studies")
    assert main(["report", "--study", "hand", "--storage", storage, "--open"]) == 0
    default = export_dir(storage, "hand", tmp_path / "studies") / "report.html"  # keyed by storage
    assert default.is_file() and opened == [default.resolve().as_uri()]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["report", "--study", "nope"], "no study 'nope'"),
        (["report", "--study", "hand", "--out", "x.png"], "--out wants a .html or .htm file path"),
        (["report", "--study", "badpeers"], '"peers" must map a name'),
    ],
)
def test_report_mistakes_exit_2_with_one_line(argv, message, tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    _study(storage=storage, name="hand")
    _study(storage=storage, name="badpeers", peers={"fla": "fast"})
    optuna.create_study(storage=storage, study_name="empty")
    assert main([*argv, "--storage", storage]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_report_of_a_study_with_no_trials_yet_exits_1_as_best_does(tmp_path, capsys):
    """Nothing to show yet is exit 1, one line; a mistake in the input is exit 2."""
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    optuna.create_study(storage=storage, study_name="empty")
    assert main(["report", "--study", "empty", "--storage", storage]) == 1
    assert main(["best", "--study", "empty", "--storage", storage]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "study 'empty' has no trials yet: nothing to report",
        "study 'empty' has no feasible, correct trial yet",
    ]


# Across architectures -----------------------------------------------------------------------

# Configs both studies run: one compiles on both; one is 114,688 B of tiles at the least,
# over sm_86's 101,376 B per block (restricted there, compiled on sm_100a). The seed's
# config comes first in each. A config restricted on sm_86 that sm_100a never tried:
ON_BOTH = ("64/64/2/128/smem/1", "128/64/1/128/smem/1")
ONLY_SM86 = "128/64/2/128/smem/1"


@pytest.fixture(scope="module")
def archs(tmp_path_factory) -> SimpleNamespace:
    """Two compile-only studies of ``PROBLEM`` in one storage, run by the tuner: "s86" for
    sm_86 (the seed's config, ``ON_BOTH``, ``ONLY_SM86``) and "s100" for sm_100a (the
    seed's config, ``ON_BOTH``). Neither is an H200's architecture: compile-only there too."""
    tmp = tmp_path_factory.mktemp("archs")
    storage = f"sqlite:///{tmp / 'db.sqlite'}"
    with pytest.MonkeyPatch.context() as mp, redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        mp.setattr("tuner.cli.STUDIES_DIR", tmp)
        for name, arch, configs in (("s86", "sm_86", (*ON_BOTH, ONLY_SM86)), ("s100", "sm_100a", ON_BOTH)):
            enqueue = [a for c in configs for a in ("--enqueue", c)]
            n = str(1 + len(configs))
            assert run_small(storage, name, "--arch", arch, "--n-trials", n, "--no-wave-seeds", *enqueue) == 0
    load = lambda name: optuna.load_study(study_name=name, storage=storage)  # noqa: E731
    return SimpleNamespace(storage=storage, s86=load("s86"), s100=load("s100"))


def test_the_same_configs_side_by_side_across_architectures(archs):
    side = compiled.across_archs(problem_trials(archs.s100))
    labels = sorted((SEED_CONFIG.label, *ON_BOTH))
    assert side.config.tolist() == [c for c in labels for _ in range(2)]  # ONLY_SM86 is not shared
    assert side.arch.tolist() == ["sm_86", "sm_100a"] * 3  # in kernel.arch's order
    cells = side.set_index(["config", "arch"])
    for study, arch in ((archs.s86, "sm_86"), (archs.s100, "sm_100a")):
        for t in study.trials:  # each cell is what the tuner recorded for that trial
            assert t.user_attrs["environment"]["arch"] == arch
            if trial_config(t).label == ONLY_SM86:
                continue
            cell = cells.loc[(trial_config(t).label, arch)]
            assert cell.status == t.user_attrs["status"]
            for key in ("registers", "spill_bytes", "smem_bytes"):
                assert cell[key] == t.user_attrs[key] if key in t.user_attrs else math.isnan(cell[key])
            reason = t.user_attrs.get("reason", "").strip().splitlines()
            assert cell.reason == (reason[0][:160] if reason else "")
    big = cells.loc[ON_BOTH[1]]
    assert big.loc["sm_86"].status == "restricted"
    assert big.loc["sm_86"].reason == "shared memory: at least 114688 B, over sm_86's 101376 B per block"
    assert big.loc["sm_100a"].smem_bytes > ARCHS["sm_86"].smem_per_block  # it compiled there
    # One architecture, or none recorded: nothing to set side by side
    assert compiled.across_archs(trials_frame(archs.s100)).empty
    assert compiled.across_archs(trials_frame(_study())).empty
    fig = compiler_figures.archs_figure(side)
    assert {t.name for t in fig.data} == {"sm_86", "sm_100a"} and len(fig.data) == 2 * 3  # 3 resources
    assert compiler_figures.archs_figure(side[side.registers.isna()]) is None


def test_the_problems_trials_come_from_every_study_of_it_in_the_storage(archs, tmp_path):
    shutil.copy(archs.storage.removeprefix("sqlite:///"), tmp_path / "db.sqlite")
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    s86 = optuna.load_study(study_name="s86", storage=storage)
    assert len(problem_trials(s86)) == 4 + 3
    other = _study(storage=storage, name="other")  # nine trials of another problem
    other.set_user_attr("problem", Problem(1, 2, 512, 64, 64).to_dict())
    assert len(problem_trials(s86)) == 4 + 3
    _study(storage=storage, name="same")  # nine of this one
    assert len(problem_trials(s86)) == 4 + 3 + 9


def test_the_report_sets_the_architectures_side_by_side(archs, tmp_path, capsys):
    out = tmp_path / "s100.html"
    assert main(["report", "--study", "s100", "--storage", archs.storage, "--out", str(out)]) == 0
    page = out.read_text()
    assert '<h2 id="archs">Across architectures</h2>' in page and 'href="#archs"' in page
    assert 'id="fig-archs"' in page and "(sm_86, sm_100a)" in page
    assert "over sm_86&#x27;s 101376 B per block" in page  # the restriction, as the cell's reason
    alone = render_report(*_log(archs.s100))  # without the other studies: no such section
    assert 'id="archs"' not in alone and "fig-archs" not in alone


# In a real browser --------------------------------------------------------------------------


def _need_browser() -> None:
    why = browser.unavailable()
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI installs chromium and playwright, yet: {why}")
    pytest.skip(f"no headless browser: {why}")


@pytest.mark.browser
def test_pages_render_offline_in_chromium(tmp_path):
    _need_browser()
    # GPU: 10 plots. Compile-only: no error front, no error by decay, no peers: 7.
    for name, log, graphs in (
        ("gpu", _log(_study(peers=PEERS)), 10),
        ("compile-only", synthetic_trials(60, mode="compile-only"), 7),
    ):
        html = write_report(*log, tmp_path / f"{name}.html")
        load = browser.load(html)
        assert load.graphs == load.rendered == graphs, (name, load)
        assert load.console_errors == [] and load.blocked == [], (name, load)


@pytest.mark.browser
def test_browser_check_sees_network_and_errors(tmp_path):
    _need_browser()
    page = tmp_path / "bad.html"
    page.write_text(
        '<html><body><img src="http://example.invalid/x.png">'
        '<div class="plotly-graph-div"></div><script>undefinedFunction()</script></body></html>'
    )
    load = browser.load(page, timeout_s=2)
    assert load.blocked == ["http://example.invalid/x.png"]
    assert any("undefinedFunction" in e for e in load.console_errors)
    assert (load.graphs, load.rendered) == (1, 0)


@pytest.mark.browser
def test_thousand_trials_stay_usable(tmp_path):
    _need_browser()
    html = write_report(*synthetic_trials(1000), tmp_path / "big.html")
    load = browser.load(html)
    assert load.rendered == load.graphs == 10 and load.console_errors == [] and load.blocked == []
    assert html.stat().st_size < 12e6 and load.load_ms < 30_000, (html.stat().st_size, load.load_ms)


@pytest.mark.browser
def test_the_architectures_section_renders_in_chromium(archs, tmp_path):
    _need_browser()
    html = write_report(*_log(archs.s100), tmp_path / "archs.html", across=problem_trials(archs.s100))
    graphs = html.read_text().count('class="plotly-graph-div"')
    load = browser.load(html)
    assert 'id="fig-archs"' in html.read_text() and load.graphs == load.rendered == graphs, load
    assert load.console_errors == [] and load.blocked == []


def test_prediction_check_says_when_the_latency_model_is_off_per_gpu():
    """Measured over predicted, per GPU, over trials measured (not copied): a model too slow
    or too fast by more than 30 % is named, with where the GPU's own model comes from."""
    frame = trials_frame(gpu_study([0.5, 0.4, 0.3, 0.2, 0.6, 0.7, None], env={"gpu": "NVIDIA H200"}))
    assert search.prediction_check(frame) == []  # no predictions recorded
    frame["predicted_ms"] = frame.median_ms / 1.1
    assert search.prediction_check(frame) == [
        "latency model on NVIDIA H200: measured / predicted 1.10 (median of 6 trials)"
    ]
    for ratio, off in ((1.5, "50%"), (0.7, "43%")):  # measured slower, and faster, than predicted
        frame["predicted_ms"] = frame.median_ms / ratio
        (line,) = search.prediction_check(frame)
        assert f"off by {off} on this GPU: a GPU run refits this GPU's own from its trials" in line
    frame.loc[frame.number >= 2, "cached_from"] = 0  # copies of trial 0: not measurements
    assert search.prediction_check(frame) == []  # fewer than 5 measured trials with both
    frame["cached_from"] = None
    frame.loc[frame.number < 3, "env_gpu"] = "NVIDIA H100"
    lines = search.prediction_check(frame, least=3)
    assert [line.split(":")[0] for line in lines] == [
        "latency model on NVIDIA H100",
        "latency model on NVIDIA H200",
    ]
    assert all("measured / predicted 0.70 (median of 3 trials); the model is off by 43%" in x for x in lines)
