"""tuner.tuner: the Tuner loop on the CPU, a compile-only exploration with real TileLang
compiles, real Optuna and real SQLite: outcomes told as values with their reasons, every
sampler, the wave seeds measured first, and a kill -9 that loses no finished trial."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import optuna
import pandas as pd
import psutil
import pytest
from helpers import LAYOUT_FAILURE, SMALL, SMALL_PROBLEM, child_env, run_small

from kernel import SEED_CONFIG, KernelConfig, Problem
from kernel.constraints import knobs, violated
from kernel.ops.deploy import ExportError, load_config, read_export
from tuner import space
from tuner.latency import latency_model
from tuner.liveness import HEARTBEAT_ATTR, fail_stale, interrupt
from tuner.options import Options, UsageError
from tuner.samplers import make_sampler
from tuner.studies import export_dir
from tuner.tuner import Tuner


def _count(storage: str, name: str, state: optuna.trial.TrialState) -> int:
    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        return 0
    return len(study.get_trials(states=(state,)))


def _owned_running(storage: str, name: str) -> bool:
    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        return False
    return any("pid" in t.user_attrs for t in study.get_trials(states=(optuna.trial.TrialState.RUNNING,)))


def test_kill_9_mid_study_loses_no_finished_trial(tmp_path):
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    cmd = [
        sys.executable,
        "-m",
        "tuner",
        "run",
        *SMALL,
        "--storage",
        storage,
        "--study",
        "k9",
        "--workers",
        "1",
        "--n-trials",
        "12",
        "--no-progress",
    ]
    # A cold TileLang cache keeps every trial compiling for seconds, so the kill below
    # lands while a trial is in flight, whatever earlier tests or runs left cached.
    env = child_env(TILELANG_CACHE_DIR=str(tmp_path / "tilelang-cache"))
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    complete = optuna.trial.TrialState.COMPLETE
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        # A running trial its worker has recorded itself on: one killed before that write
        # is failed only after the grace period (tests/test_storage.py covers it).
        if _count(storage, "k9", complete) >= 2 and _owned_running(storage, "k9"):
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed mid-trial"
    os.killpg(proc.pid, signal.SIGKILL)  # the run and its compile workers, mid-trial
    proc.wait()
    before = {
        t.number: t.values
        for t in optuna.load_study(study_name="k9", storage=storage).get_trials(states=(complete,))
    }
    assert len(before) >= 2, proc.stderr.read().decode()[-2000:]

    done = subprocess.run(
        # A grace shorter than the rerun's start: a trial killed before its worker recorded
        # itself on it is failed too, so whatever was running at the kill is found.
        [*cmd[:-3], "--n-trials", "2", "--no-progress", "--heartbeat", "1", "--grace", "2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "of a killed run as failed" in done.stderr
    study = optuna.load_study(study_name="k9", storage=storage)
    after = {t.number: t.values for t in study.get_trials(states=(complete,))}
    assert all(after[n] == v for n, v in before.items())  # nothing finished was lost or changed
    assert len(after) >= len(before) + 1
    assert not study.get_trials(states=(optuna.trial.TrialState.RUNNING,))
    interrupted = [t for t in study.trials if t.user_attrs.get("status") == "interrupted"]
    assert interrupted and all(t.state == optuna.trial.TrialState.FAIL for t in interrupted)


def _cmdline(process: psutil.Process) -> str:
    """``process``'s command line, or "" for one that ended meanwhile (a compiler's nvcc)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def _gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_kill_9_of_a_run_takes_its_compile_processes_with_it(tmp_path):
    """The compile processes, and multiprocessing's resource tracker, end with their run."""
    argv = ["run", *SMALL, "--storage", f"sqlite:///{tmp_path / 'db.sqlite'}", "--study", "k9"]
    argv += ["--workers", "2", "--n-trials", "20", "--no-progress"]
    env = child_env(TILELANG_CACHE_DIR=str(tmp_path / "tilelang-cache"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tuner", *argv],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    run, children = psutil.Process(proc.pid), []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            children = run.children(recursive=True)
            if sum("spawn_main" in _cmdline(c) for c in children) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None and children, "the run ended before its compile processes started"
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(_gone(c) for c in children):
            time.sleep(0.2)
        assert all(_gone(c) for c in children), [_cmdline(c) for c in children if not _gone(c)]
    finally:
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def over_budget(tmp_path_factory) -> tuple[subprocess.CompletedProcess, pd.DataFrame]:
    """A compile-only run of two trials with a budget of one register per thread: the seed
    config, which compiles (to far more), then a config TileLang cannot lay out. Run as
    a user would, so its output is exactly what a terminal would show."""
    tmp = tmp_path_factory.mktemp("over_budget")
    storage = f"sqlite:///{tmp / 'db.sqlite'}"
    argv = ["run", *SMALL, "--storage", storage, "--study", "budget", "--workers", "2", "--no-progress"]
    argv += ["--n-trials", "2", "--max-registers", "1", "--enqueue", LAYOUT_FAILURE]
    done = subprocess.run(
        [sys.executable, "-m", "tuner", *argv],
        cwd=tmp,
        env=child_env(DECAY_TUNER_STUDIES=str(tmp)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    return done, pd.read_csv(export_dir(storage, "budget", tmp) / "trials.csv")


def test_a_trial_over_a_budget_says_which_budget(over_budget):
    done, frame = over_budget
    assert done.returncode == 1 and "no feasible, correct trial" in done.stderr  # nothing to export
    (seed,) = frame[frame.baseline].itertuples()
    assert (seed.status, seed.state) == ("infeasible", "COMPLETE") and seed.registers > 1
    assert seed.reason == f"registers: {seed.registers:.0f} per thread, over the budget of 1"
    assert not frame.feasible.any()


def test_a_compile_failure_keeps_the_diagnostic_and_off_the_terminal(over_budget):
    done, frame = over_budget
    (failed,) = frame[frame.status == "compile_failed"].itertuples()
    assert (
        f"{failed.chunk}/{failed.block_dv}/{failed.num_stages}/{failed.threads}/{failed.scores}"
        == LAYOUT_FAILURE
    )
    assert "Layout infer conflict" in failed.reason
    assert failed.reason.startswith("InternalError: ")
    for printed in (done.stdout, done.stderr):
        assert "Layout infer" not in printed and "T.Parallel" not in printed and "A_cast" not in printed


@pytest.mark.parametrize("sampler,multi", [("nsga2", True), ("gp", False), ("grid", False), ("tpe", True)])
def test_every_sampler_and_mode_runs(sampler, multi, tmp_path, studies_dir):
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    assert (
        run_small(storage, sampler, "--n-trials", "2", "--sampler", sampler, *(["--multi-objective"] * multi))
        == 0
    )
    study = optuna.load_study(study_name=sampler, storage=storage)
    finished = [t for t in study.trials if t.state.is_finished()]  # the wave seeds left wait
    assert len(finished) == 2 and len(study.directions) == (2 if multi else 1)
    objectives = ["predicted_x_floor", "smem_bytes"] if multi else ["predicted_x_floor"]
    assert study.user_attrs["objectives"] == objectives
    assert (
        read_export(export_dir(storage, sampler, studies_dir) / "best.json")["objectives"]
        == study.user_attrs["objectives"]
    )


@pytest.mark.parametrize(
    "options,seeded",
    [(Options(), True), (Options(wave_seeds=False), False), (Options(sampler="grid"), False)],
)
def test_studies_measure_the_wave_seeds_first(options, seeded, tmp_path):
    """A study enqueues the seed config, then the wave seeds and the latency model's
    predicted best, each once (unless turned off, or for the grid)."""
    problem = Problem(2, 8, 2048, 64, 64)
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    first = [
        *space.wave_seeds(space.search_space(problem)),
        *space.predicted_first(space.search_space(problem, arch="sm_90a"), latency_model()),
    ]
    expected = list(dict.fromkeys([SEED_CONFIG, *(first if seeded else [])]))
    assert (
        len(expected) > 1 + len(space.wave_seeds(space.search_space(problem))) or not seeded
    )  # the model adds its own
    for _ in range(2):  # a second run over a queue nobody asked yet does not duplicate it
        study = Tuner(problem, options, name="s", storage=storage).study
        queued = [t.system_attrs["fixed_params"] for t in study.get_trials(deepcopy=False)]
        assert [KernelConfig.from_dict(p) for p in queued] == expected


def _proposals(study: optuna.Study, n: int = 4) -> list[dict]:
    """The next ``n`` configs the study's sampler proposes (nothing queued is left)."""
    dists = space.search_space(SMALL_PROBLEM).distributions
    return [study.ask(dists).params for _ in range(n)]


def test_workers_started_with_one_seed_propose_different_configs(tmp_path):
    storage = f"journal:{tmp_path / 'j.log'}"
    opts = Options(seed=3, wave_seeds=False, workers=1, progress=False)
    first, second = (Tuner(SMALL_PROBLEM, opts, name="s", storage=storage) for _ in range(2))
    assert (first.worker_index, second.worker_index) == (0, 1)
    first.study.ask()  # the seed config, queued once for both
    ours = _proposals(first.study), _proposals(second.study)
    assert ours[0] != ours[1]
    # Two samplers of one seed would propose the same: what the offset prevents.
    same = [
        _proposals(
            optuna.create_study(sampler=make_sampler("tpe", space.search_space(SMALL_PROBLEM).knobs, 3))
        )
        for _ in range(2)
    ]
    assert same[0] == same[1] == ours[0]


def test_the_fused_sweep_is_tuned_in_its_own_study(tmp_path, studies_dir):
    """``run --sweep dkdv``: a compile-only study of the backward's fused dk and dv pass.
    Its trials take the sweep's own knobs (``knobs(.., "dkdv")``), its first ones
    are ``dkdv_config``'s pick and its neighbours (no seed config: that is a forward's), the
    probe compiles the fused pass (its shared memory, not a forward's), and the study
    refuses a forward run."""
    from kernel import dkdv
    from tuner.cli import main
    from tuner.options import UsageError

    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    argv = ["run", *SMALL, "--storage", storage, "--workers", "2", "--no-progress", "--n-trials", "2"]
    assert main([*argv, "--sweep", "dkdv"]) == 0
    study = optuna.load_study(study_name="b1-h2-s256-dk64-dv64-float16-dkdv", storage=storage)
    assert study.user_attrs["sweep"] == "dkdv"
    configs = [KernelConfig.from_dict(t.params) for t in study.trials if t.state.is_finished()]
    assert configs == space.wave_seeds(space.search_space(SMALL_PROBLEM, sweep="dkdv"))[:2]
    for t, config in zip(study.trials, configs):
        assert (config.chunk, config.block_dv, config.threads) == (dkdv.CHUNK, 64, dkdv.THREADS)
        assert t.user_attrs["status"] == "ok"
        assert t.user_attrs["dynamic_smem"] + t.user_attrs["static_smem"] == dkdv.smem_bytes(
            SMALL_PROBLEM, config
        )
    with pytest.raises(UsageError, match="tunes the dkdv kernel"):
        Tuner(SMALL_PROBLEM, Options(), name=study.study_name, storage=storage)
    with pytest.raises(ExportError, match="fused dk and dv pass, not of a forward kernel"):
        load_config(export_dir(storage, study.study_name, studies_dir) / "best.json", allow_mismatch=True)


def test_a_study_ranked_by_spill_bytes_is_not_resumed(tmp_path):
    """A compile-only study of a decay-tuner before the latency model ranked by spill bytes:
    resuming it would mix those values with predicted times, so a run refuses it and says
    how to go on."""
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    old = optuna.create_study(storage=storage, study_name="old")
    old.set_user_attr("objectives", ["spill_bytes"])
    with pytest.raises(UsageError, match="ranked by spill bytes") as refused:
        Tuner(SMALL_PROBLEM, Options(), name="old", storage=storage)
    assert f"optuna delete-study --study-name old --storage {storage}" in str(refused.value)


def test_the_fused_sweep_s_space():
    from kernel.rule import dkdv_config

    long = Problem(2, 16, 16384, 128, 128)
    table = knobs(long, "dkdv")
    assert (
        table["num_stages"] == (1, 2)
        and table["block_dv"] == (128,)
        and table["segments"] == knobs(long)["segments"]
    )
    assert space.search_space(long, "dkdv").grid == [
        KernelConfig(64, 128, stages, 256, "smem", n) for stages in (1, 2) for n in table["segments"]
    ]
    seeds = space.wave_seeds(space.search_space(long, sweep="dkdv"), sms=132)
    assert seeds[0] == dkdv_config(long, "sm_90a", 132) and [c.segments for c in seeds] == [4, 2, 8]
    assert violated(long, seeds[0], "sm_80", "dkdv")[0].startswith("the fused dk and dv pass does not serve")
    big = Problem(1, 1, 64, 256, 256)
    assert any(
        "does not serve" in r for r in violated(big, space.search_space(big, "dkdv").grid[0], sweep="dkdv")
    )
    assert space.wave_seeds(space.search_space(big, sweep="dkdv")) == []


class _StalledAsk(optuna.samplers.RandomSampler):
    """A real sampler whose first sample waits until a liveness check, as any worker runs
    it, has failed the trial being asked: a storage that answered after the grace."""

    def __init__(self, grace_s: int) -> None:
        super().__init__(seed=0)
        self.grace_s, self.stalled = grace_s, None

    def sample_independent(self, study, trial, param_name, param_distribution):
        if self.stalled is None:
            self.stalled = trial.number
            while study._storage.get_trial(trial._trial_id).state != optuna.trial.TrialState.FAIL:
                time.sleep(0.2)
                fail_stale(study, self.grace_s)
        return super().sample_independent(study, trial, param_name, param_distribution)


def test_a_trial_failed_as_it_is_asked_is_asked_again(tmp_path, capsys):
    """A worker whose ask outlasts the grace finds its trial failed (and queued again) by a
    liveness check: it says so in one line and asks anew, where it ended in a traceback."""
    opts = Options(n_trials=2, wave_seeds=False, workers=1, progress=False, grace_s=1, heartbeat_s=1)
    tuner = Tuner(SMALL_PROBLEM, opts, name="s", storage=f"journal:{tmp_path / 'j.log'}")
    tuner.study.sampler = _StalledAsk(opts.grace_s)
    study = tuner.run()
    stalled = study.trials[tuner.study.sampler.stalled]
    assert stalled.state == optuna.trial.TrialState.FAIL
    assert stalled.user_attrs["reason"].startswith("no worker recorded itself on it in 1 s")
    told = [t for t in study.trials if t.state.is_finished() and t.number != stalled.number]
    assert len(told) == 2 and all("pid" in t.user_attrs for t in told)
    err = capsys.readouterr().err
    assert err.count("a trial was failed as this worker asked for it") == 1, err


def test_a_trial_failed_elsewhere_stops_none_of_the_other_heartbeats(tmp_path, capsys):
    """One of a worker's live trials failed by another worker (its heartbeat came late)
    leaves the heartbeats of its other trials, and the liveness check, going."""
    opts = Options(wave_seeds=False, workers=1, progress=False, grace_s=60, heartbeat_s=1)
    tuner = Tuner(SMALL_PROBLEM, opts, name="s", storage=f"journal:{tmp_path / 'j.log'}")
    failed, alive = (tuner.study.ask() for _ in range(2))
    assert interrupt(tuner.study, tuner.study._storage.get_trial(failed._trial_id), "its worker seemed dead")
    tuner._live |= {failed._trial_id, alive._trial_id}
    stop = threading.Event()
    beats = threading.Thread(target=tuner._heartbeats, args=(stop,))
    beats.start()
    beaten = lambda: HEARTBEAT_ATTR in tuner.study._storage.get_trial(alive._trial_id).system_attrs  # noqa: E731
    deadline = time.monotonic() + 30
    while not beaten() and time.monotonic() < deadline:
        time.sleep(0.1)
    stop.set()
    beats.join()
    assert beaten()
    assert tuner._live == {alive._trial_id}
    assert "heartbeat:" not in capsys.readouterr().err


def test_n_trials_counts_new_configs_and_says_when_the_space_has_no_more(tmp_path, capsys, monkeypatch):
    """The fused pass at S=64: 14 configs, one the restrictions allow. Asked for 20, a run
    tries each config once, a repeat the sampler proposes served from its first trial and
    not counted, then says why it stopped at 14; run again, it asks no trial and says so."""
    from tuner.cli import main
    from tuner.trials import trial_config

    monkeypatch.setattr("tuner.cli.STUDIES_DIR", tmp_path)
    problem = Problem(1, 2, 64, 64, 64)
    grid = space.search_space(problem, "dkdv").grid
    assert len(grid) == 14 and sum(not violated(problem, c, "sm_90a", "dkdv") for c in grid) == 1
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    argv = ["run", "--dk", "64", "--dv", "64", "--batch", "1", "--heads", "2", "--seqlen", "64"]
    argv += ["--sweep", "dkdv", "--storage", storage, "--study", "all", "--workers", "1", "--no-progress"]
    assert main([*argv, "--n-trials", "20"]) == 0
    out, err = capsys.readouterr()
    assert "explored 14 configs, not 20: the space holds no other config not yet tried" in err
    assert "0 GPU evaluations, 14 configs new to the study this run" in " ".join(out.split())
    study = optuna.load_study(study_name="all", storage=storage)
    assert all(t.state.is_finished() for t in study.trials)
    configs = [trial_config(t) for t in study.trials]
    assert set(configs) == set(grid)
    firsts = {c: configs.index(c) for c in grid}
    repeats = [t for t in study.trials if firsts[trial_config(t)] != t.number]
    assert len(study.trials) == 14 + len(repeats)
    for t in repeats:  # served from the first trial of its config (compiled once), or restricted again
        first = study.trials[firsts[trial_config(t)]]
        assert t.user_attrs["status"] == first.user_attrs["status"]
        assert t.user_attrs.get("cached_from") == (
            first.number if first.user_attrs["status"] == "ok" else None
        )
    filled = [t.user_attrs["instead_of_repeat"] for t in study.trials if "instead_of_repeat" in t.user_attrs]
    assert set(filled) <= {t.number for t in repeats}
    assert main([*argv, "--n-trials", "5"]) == 0
    out, err = capsys.readouterr()
    assert "no config explored, not 5: each of the space's 14 was tried in this environment" in err
    assert len(optuna.load_study(study_name="all", storage=storage).trials) == len(study.trials)
