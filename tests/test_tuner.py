"""The tuner end to end on the CPU: real TileLang compiles, real Optuna, real SQLite.

Without a GPU a run is a compile-only exploration; these tests drive it through the CLI
and check what it leaves behind: the storage, the pandas trial log and the JSON export.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pandas as pd
import pytest
import torch

import refs
from kernel import SEED_CONFIG, KernelConfig, Problem
from kernel.deploy import ExportError, load_config, read_export, write_json
from tuner import space
from tuner.cli import main
from tuner.study import Options, Tuner, default_study_name
from tuner.trials import COLUMNS, trials_frame
from tuner.worker import INJECT_ENV, GpuWorker, config_key

REPO = Path(__file__).resolve().parent.parent
# Small enough that one config compiles in a few seconds on one core.
SMALL = ["--dk", "64", "--dv", "64", "--batch", "1", "--heads", "2", "--seqlen", "256"]
SMALL_PROBLEM = Problem(1, 2, 256, 64, 64, 0.99)
LAYOUT_FAILURE = "32/32/2/128/regs"  # TileLang 0.1.15 cannot lay out register scores at C = 32


def test_space_table_and_restrictions():
    table = space.choices(Problem(1, 1, 64, 128, 96, 0.9))
    assert table["block_dv"] == (16, 32, 48, 96)
    assert table["scores"] == ("smem", "regs")
    assert table["segments"][0] == 1  # the single-pass kernel, then the sequence-split variant
    assert len(list(space.grid(SMALL_PROBLEM))) == 3 * 3 * 4 * 2 * 2 * len(space.SEGMENTS)
    short = Problem(1, 1, 40, 64, 64, 0.9)  # one chunk of 64: a 2-stage pipeline has nothing to overlap
    assert space.violated(short, KernelConfig(64, 32, 2, 128)) == ["stages <= chunks per segment"]
    assert space.violated(short, KernelConfig(32, 32, 2, 128)) == []
    assert space.violated(short, KernelConfig(32, 32, 1, 128, segments=2)) == []  # 32 + 8 tokens
    assert space.violated(short, KernelConfig(32, 32, 1, 128, segments=4)) == []  # rounds to 2 segments
    assert space.violated(short, KernelConfig(64, 32, 1, 128, segments=2)) == [
        "seq-split makes at least two segments"
    ]
    # 4096 tokens: 8 segments hold 8 chunks of 64 each; 16 segments, 2 chunks of 128, too few for 4 stages
    long = Problem(1, 1, 4096, 64, 64, 0.9)
    assert space.violated(long, KernelConfig(64, 32, 4, 128, segments=8)) == []
    assert space.violated(long, KernelConfig(128, 32, 4, 128, segments=16)) == [
        "stages <= chunks per segment"
    ]


def _run(storage: str, study: str, *extra: str) -> int:
    return main(
        ["run", *SMALL, "--storage", storage, "--study", study, "--workers", "2", "--no-progress", *extra]
    )


def test_the_summary_counts_queued_configs_apart(tmp_path, capsys, monkeypatch):
    """One trial asked: the seed config runs, the one-wave seeds wait for the next run."""
    monkeypatch.setattr("tuner.cli.STUDIES_DIR", tmp_path)
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    argv = ["run", "--dk", "64", "--dv", "64", "--batch", "1", "--heads", "2", "--seqlen", "4096"]
    assert main([*argv, "--storage", storage, "--workers", "2", "--no-progress", "--n-trials", "1"]) == 0
    study = optuna.load_study(
        study_name=default_study_name(Problem(1, 2, 4096, 64, 64, 0.99)), storage=storage
    )
    waiting = sum(t.state == optuna.trial.TrialState.WAITING for t in study.trials)
    assert waiting >= 1
    assert f": 1 trial ({waiting} queued for the next run), 0 GPU evaluations" in capsys.readouterr().out
    frame = pd.read_csv(tmp_path / study.study_name / "trials.csv")
    queued = frame[frame.status == "queued"]
    fixed = [
        t.system_attrs["fixed_params"] for t in study.trials if t.state == optuna.trial.TrialState.WAITING
    ]
    assert queued[list(fixed[0])].to_dict("records") == fixed  # the enqueued configs, not defaults


def test_compile_only_study_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("tuner.cli.STUDIES_DIR", tmp_path)
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    assert _run(storage, "e2e", "--n-trials", "4", "--enqueue", LAYOUT_FAILURE) == 0
    out, err = capsys.readouterr()
    assert "no CUDA device: compile-only exploration" in err
    assert "no latency measured" in out

    study = optuna.load_study(study_name="e2e", storage=storage)
    assert len(study.trials) == 4
    assert study.trials[0].params == SEED_CONFIG.to_dict()  # the baseline goes first
    assert study.user_attrs["mode"] == "compile-only" and study.user_attrs["objectives"] == ["spill_bytes"]

    frame = pd.read_csv(tmp_path / "e2e" / "trials.csv")
    assert list(frame.columns) == list(COLUMNS) and len(frame) == 4
    failed = frame[(frame.chunk == 32) & (frame.scores == "regs")]
    assert (
        len(failed) >= 1
        and (failed.status == "compile_failed").all()
        and failed.reason.str.contains("Layout infer conflict").all()
    )
    ok = frame[frame.status == "ok"]
    assert len(ok) >= 1 and ok.median_ms.isna().all()  # compile-only: nothing is timed
    assert (ok.smem_bytes > 0).all() and (ok.env_tilelang == "0.1.15").all()
    assert frame.loc[frame.number == 0, "baseline"].item()
    pd.testing.assert_frame_equal(
        pd.read_parquet(tmp_path / "e2e" / "trials.parquet"), trials_frame(study), check_dtype=False
    )

    exported = read_export(tmp_path / "e2e" / "best.json")
    assert exported["mode"] == "compile-only" and exported["problem"] == SMALL_PROBLEM.to_dict()
    best = min(ok.itertuples(), key=lambda r: (r.spill_bytes, r.number))
    assert exported["configs"][0]["spill_bytes"] == best.spill_bytes
    problem, config = load_config(tmp_path / "e2e" / "best.json")  # same environment: accepted
    assert problem == SMALL_PROBLEM and config == KernelConfig.from_dict(exported["configs"][0]["config"])

    # A second run of the same study resumes it; configs already probed are kept.
    assert main(["trials", *SMALL, "--storage", storage, "--study", "e2e"]) == 0
    assert "compile_failed" in capsys.readouterr().out
    assert (
        main(["export", *SMALL, "--storage", storage, "--study", "e2e", "--out", str(tmp_path / "x.json")])
        == 0
    )
    assert read_export(tmp_path / "x.json")["configs"] == exported["configs"]


def _count(storage: str, name: str, state: optuna.trial.TrialState) -> int:
    try:
        study = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        return 0
    return len(study.get_trials(states=(state,)))


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
    env = os.environ | {
        "PYTHONPATH": str(REPO),
        "DECAY_TUNER_STUDIES": str(tmp_path),
        "TILELANG_CACHE_DIR": str(tmp_path / "tilelang-cache"),
    }
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    complete, running = optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if _count(storage, "k9", complete) >= 2 and _count(storage, "k9", running) >= 1:
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
        [*cmd[:-3], "--n-trials", "2", "--no-progress"],
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


def test_worker_survives_hang_and_segfault(monkeypatch):
    hang, crash = KernelConfig(64, 32, 1, 128), KernelConfig(64, 64, 1, 128)
    monkeypatch.setenv(
        INJECT_ENV, f"{config_key(hang.to_dict())}=hang,{config_key(crash.to_dict())}=segfault"
    )
    worker = GpuWorker(timeout_s=20)

    def job(config: KernelConfig) -> dict:
        return {"problem": SMALL_PROBLEM.to_dict(), "config": config.to_dict(), "seed": 0, "tolerance": 2e-2}

    try:
        t0 = time.monotonic()
        hung = worker.measure(job(hang))
        assert hung["ok"] is False and hung["error_type"] == "Timeout"
        assert 20 <= time.monotonic() - t0 < 40
        crashed = worker.measure(job(crash))
        assert crashed["ok"] is False and crashed["error_type"] == "WorkerCrashed"
        assert "-11" in crashed["message"]  # SIGSEGV
        # A fresh worker takes the next job; here without a GPU it reports why it cannot build.
        # Twice in a row: a worker that reported an error exits, and the next job must not
        # race its exit (on the H200 that once recorded a good config as a crash).
        for _ in range(2):
            plain = worker.measure(job(SEED_CONFIG))
            assert (
                plain["ok"] is False and plain["error_type"] == "RuntimeError" and "CUDA" in plain["message"]
            )
    finally:
        worker.close()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["run", "--dk", "0"], "dk must be a positive integer"),
        (["run", "--dk", "100"], "dk must be a multiple of 16"),
        (["run", "--alpha", "1.5"], "alpha must be in (0, 1]"),
        (["run", "--alpha", "0"], "alpha must be in (0, 1]"),
        (["run", "--storage", "nosuchdb://x"], "cannot open storage"),
        (["run", "--sampler", "random"], "invalid choice"),
        (["run", "--enqueue", "64/32"], "--enqueue wants"),
        (["run", "--enqueue", "64/48/1/128"], "outside the search space"),
        (["trials", "--study", "nope", "--storage", "sqlite:///:memory:"], "no study 'nope'"),
        (["frobnicate"], "invalid choice"),
        (["run", "--workers", "0"], "--workers must be positive"),
        (["run", "--tolerance", "-1"], "--tolerance must be positive"),
        (["run", "--timeout", "nan"], "--timeout must be positive"),
        (["run", "--enqueue", "64/32/1/128/smem/0"], "segments must be a positive integer"),
        (["dispatch", "--shapes", "1x2"], "--shapes wants BxHxS"),
        (["dispatch", "--dv", "20"], "dv must be a multiple of 16"),
        (["dispatch", "--out", "/"], "--out wants a file path"),
        (["bench", "--dispatch", "/nonexistent/table.json"], "cannot read dispatch table"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_unreadable_json_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": ')
    assert main(["run", "--enqueue-from", str(bad)]) == 2
    assert "cannot read best-config file" in capsys.readouterr().err
    assert main(["run", "--enqueue-from", str(tmp_path / "missing.json")]) == 2


def _export(tmp_path: Path, **changes) -> Path:
    from kernel.deploy import environment

    data = {
        "format": "decay-tuner/best-configs",
        "version": 1,
        "problem": SMALL_PROBLEM.to_dict(),
        "environment": environment(),
        "configs": [{"config": KernelConfig(64, 64, 1, 128).to_dict()}],
    }
    path = tmp_path / "best.json"
    write_json(path, data | changes)
    return path


def test_loader_refuses_other_environment_or_problem(tmp_path):
    assert load_config(_export(tmp_path))[1] == KernelConfig(64, 64, 1, 128)
    elsewhere = _export(
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
    from kernel.deploy import environment

    edited = _export(tmp_path, environment=environment() | {"kernel": "0" * 12})  # the kernel changed since
    with pytest.raises(ExportError, match="kernel: file '000000000000'"):
        load_config(edited)
    assert load_config(elsewhere, allow_mismatch=True)[1] == KernelConfig(64, 64, 1, 128)
    other = Problem(2, 2, 256, 64, 64, 0.99)
    with pytest.raises(ExportError, match="was tuned for"):
        load_config(_export(tmp_path), problem=other)
    with pytest.raises(ExportError, match="version"):
        load_config(_export(tmp_path, version=99))
    with pytest.raises(ExportError, match="block_dv must divide dv"):
        load_config(_export(tmp_path), problem=Problem(1, 2, 256, 64, 32, 0.99), allow_mismatch=True)


def _table(tmp_path: Path, pairs: list[tuple[Problem, KernelConfig]], **changes) -> Path:
    from kernel.deploy import DISPATCH_FORMAT, environment

    data = {
        "format": DISPATCH_FORMAT,
        "version": 1,
        "environment": environment(),
        "entries": [{"problem": p.to_dict(), "config": c.to_dict(), "median_ms": 0.1} for p, c in pairs],
    }
    path = tmp_path / "dispatch.json"
    write_json(path, data | changes)
    return path


def test_dispatch_picks_the_nearest_shape_and_keeps_its_grid(tmp_path):
    from kernel.deploy import load_dispatch

    many = KernelConfig(64, 128, 2, 256)  # tuned at B*H = 128, S = 4096: 128 blocks
    few = KernelConfig(64, 128, 2, 256, segments=16)  # tuned at B*H = 8, S = 32768: 128 blocks
    narrow = KernelConfig(64, 32, 1, 128)  # tuned for DV = 64
    table = load_dispatch(
        _table(
            tmp_path,
            [
                (Problem(8, 16, 4096, 128, 128, 0.99), many),
                (Problem(1, 8, 32768, 128, 128, 0.99), few),
                (Problem(8, 16, 4096, 128, 64, 0.99), narrow),
            ],
        )
    )
    pick = lambda *shape, dv=128, alpha=0.9: table.pick(Problem(*shape, 128, dv, alpha)).config  # noqa: E731
    segments = lambda config, n: dataclasses.replace(config, segments=n)  # noqa: E731
    assert pick(8, 16, 4096) == many and pick(1, 8, 32768) == few
    assert pick(2, 4, 16384) == few  # nearer in log2(B*H) + log2(S); B*H = 8 as tuned
    # Other B*H: the segment count that keeps about 128 blocks.
    assert pick(1, 4, 65536) == segments(few, 32) and pick(4, 16, 4096) == segments(many, 2)
    assert pick(16, 16, 2048) == many  # 256 blocks already with one segment
    assert pick(8, 16, 4096, dv=64) == narrow
    # 512 tokens hold 8 chunks: 2 stages leave at most 4 segments, 32 blocks.
    assert pick(1, 8, 512) == segments(few, 4)
    # Too short for any split: the nearest config as a single-pass kernel, pipeline shortened.
    assert table.pick(Problem(1, 1, 64, 128, 128, 0.9)).config == KernelConfig(64, 128, 1, 256, segments=1)
    with pytest.raises(ExportError, match=r"no dispatch entry for dk=128, dv=32"):
        pick(8, 16, 4096, dv=32)
    with pytest.raises(ExportError, match="no dispatch entry"):
        table.pick(Problem(8, 16, 4096, 128, 128, 0.99, "bfloat16"))


def test_bench_rows_say_which_entry_served_a_shape(tmp_path):
    from kernel.deploy import load_dispatch
    from tuner.bench import served_by

    table = load_dispatch(
        _table(tmp_path, [(Problem(1, 8, 32768, 128, 128, 0.99), KernelConfig(64, 128, 2, 256))])
    )
    assert served_by(table, Problem(1, 8, 32768, 128, 128, 0.9)) == "dispatch table: tuned at this shape"
    assert served_by(table, Problem(1, 4, 65536, 128, 128, 0.99)).endswith("the entry tuned at 1x8x32768")


def test_the_committed_table_serves_untuned_shapes_the_segment_count_measured_best():
    """The H200 table (retable) serves three shapes it was not tuned at (oos); for each,
    the pick's segment count is the fastest one the oos study measured with its other
    knobs, while the nearest entry's own count was 1.6x slower at two of them."""
    from kernel.deploy import load_dispatch

    h200 = Path(__file__).resolve().parent.parent / "reports" / "h200" / "issue5"
    table = load_dispatch(h200 / "retable" / "dispatch.json", allow_mismatch=True)
    slower = 0
    for b, h, s in [(1, 16, 16384), (4, 8, 8192), (1, 4, 65536)]:
        problem = Problem(b, h, s, 128, 128, 0.99)
        pick = table.pick(problem)
        trials = pd.read_csv(h200 / f"oos/studies/b{b}-h{h}-s{s}-dk128-dv128-a0.99-float16/trials.csv")
        ok = trials[trials.status == "ok"]
        knobs = pd.Series({k: v for k, v in pick.config.to_dict().items() if k != "segments"})
        same = ok[(ok[knobs.index] == knobs).all(axis=1)]
        by_segments = same.groupby("segments").median_ms.min()
        assert pick.config.segments == by_segments.idxmin(), (b, h, s, by_segments.to_dict())
        nearest = min(table.entries, key=lambda e: e.distance(problem))
        slower += by_segments[nearest.config.segments] > 1.5 * by_segments.min()
    assert slower == 2


def test_dispatch_loader_refuses_bad_tables(tmp_path):
    from kernel.deploy import load_dispatch

    entry = [(SMALL_PROBLEM, KernelConfig(64, 64, 1, 128))]
    with pytest.raises(ExportError, match="another environment"):
        load_dispatch(_table(tmp_path, entry, environment={"gpu": "NVIDIA H200"}))
    assert load_dispatch(_table(tmp_path, entry, environment={"gpu": "x"}), allow_mismatch=True).entries
    with pytest.raises(ExportError, match="version"):
        load_dispatch(_table(tmp_path, entry, version=2))
    with pytest.raises(ExportError, match="holds no entries"):
        load_dispatch(_table(tmp_path, []))
    with pytest.raises(ExportError, match="malformed entry"):
        load_dispatch(_table(tmp_path, entry, entries=[{"problem": {"batch": 1}}]))
    with pytest.raises(ExportError, match="is not a decay-tuner/dispatch file"):
        load_dispatch(_export(tmp_path))


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the command would tune; see the gpu test")
def test_dispatch_needs_a_gpu(capsys):
    assert main(["dispatch", "--shapes", "1x2x256", "--dk", "64", "--dv", "64"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_trials_frame_from_hand_built_study():
    study = optuna.create_study()
    study.set_user_attr("problem", SMALL_PROBLEM.to_dict())
    dists = space.distributions(SMALL_PROBLEM)
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
    frame = trials_frame(study)
    assert frame.status.tolist() == ["ok", "compile_failed"]
    assert frame.feasible.tolist() == [True, False] and frame.baseline.tolist() == [True, False]
    assert (
        frame.median_ms[0] == 0.25 and pd.isna(frame.median_ms[1]) and frame.reason[1] == "InternalError: x"
    )


def test_default_study_name_is_the_problem():
    assert default_study_name(SMALL_PROBLEM) == "b1-h2-s256-dk64-dv64-a0.99-float16"
    assert json.loads(json.dumps(SMALL_PROBLEM.to_dict())) == SMALL_PROBLEM.to_dict()


def _gpu_study(latencies: list[float | None]) -> optuna.Study:
    """A hand-built GPU study: one trial per latency (None: failed to compile)."""
    study = optuna.create_study()
    dists = space.distributions(SMALL_PROBLEM)
    configs = list(space.grid(SMALL_PROBLEM))
    for config, ms in zip(configs, latencies):
        attrs = {"mode": "gpu", "status": "ok" if ms else "compile_failed"}
        state = optuna.trial.TrialState.COMPLETE if ms else optuna.trial.TrialState.FAIL
        study.add_trial(
            optuna.trial.create_trial(
                params=config.to_dict(),
                distributions=dists,
                state=state,
                value=ms,
                user_attrs=attrs | ({"median_ms": ms} if ms else {}),
            )
        )
    return study


def test_compare_against_yardstick():
    from tuner.trials import compare

    grid = trials_frame(_gpu_study([0.5, None, 0.2, 0.3, 0.25, 0.4]))
    tpe = trials_frame(_gpu_study([0.5, 0.3, None, 0.205]))
    summary = compare(tpe, grid)
    assert summary["best_ms"] == 0.205 and summary["yardstick_best_ms"] == 0.2
    assert summary["gpu_evaluations"] == 3 and summary["yardstick_gpu_evaluations"] == 5
    assert summary["best_over_yardstick"] == pytest.approx(1.025)
    assert summary["gpu_evaluations_to_within_0.05"] == 3  # 0.5, 0.3, then 0.205 (the failure cost no GPU)
    assert (
        summary["yardstick_best_config"]
        == KernelConfig(**list(space.grid(SMALL_PROBLEM))[2].to_dict()).to_dict()
    )


@pytest.mark.gpu
def test_gpu_study_end_to_end(tmp_path, monkeypatch, capsys):
    """On a GPU: trials are timed and checked, and the export loads into a kernel that runs."""
    from kernel.deploy import load_kernel
    from kernel.validate import check

    monkeypatch.setattr("tuner.cli.STUDIES_DIR", tmp_path)
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    assert _run(storage, "gpu", "--n-trials", "3", "--enqueue", "64/64/1/128") == 0
    assert "median" in capsys.readouterr().out
    frame = pd.read_csv(tmp_path / "gpu" / "trials.csv")
    ok = frame[frame.status == "ok"]
    assert len(ok) >= 2 and (ok.median_ms > 0).all() and (ok.rel_l2 < 2e-2).all() and ok.gpu_evaluated.all()
    assert (ok.p20_ms <= ok.median_ms).all() and (ok.median_ms <= ok.p80_ms).all()
    kernel = load_kernel(tmp_path / "gpu" / "best.json")
    assert check(kernel, seed=5)["rel_l2"] < 2e-2


@pytest.mark.gpu
def test_gpu_dispatch_end_to_end(tmp_path, monkeypatch, capsys):
    """On a GPU: two shapes tuned, the table written, and a kernel it serves matches C."""
    from kernel.deploy import load_dispatch
    from kernel.validate import random_qkv

    monkeypatch.setattr("tuner.cli.STUDIES_DIR", tmp_path)
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    argv = ["dispatch", "--dk", "64", "--dv", "64", "--shapes", "4x8x512,1x2x4096", "--storage", storage]
    argv += ["--n-trials", "3", "--enqueue", "64/64/1/128/smem/8", "--workers", "4", "--no-progress"]
    assert main(argv) == 0
    table = load_dispatch(tmp_path / "dispatch.json")
    assert [e.problem.seqlen for e in table.entries] == [512, 4096]
    problem = Problem(1, 3, 3000, 64, 64, 0.95)  # an untuned shape, served by the nearest bucket
    q, k, v = random_qkv(problem, seed=8)
    out = table(q, k, v, alpha=problem.alpha)
    ref = refs.kernel_mimic(q, k, v, problem.alpha, table.pick(problem).config.chunk)
    assert refs.rel_l2(out, ref) < 2e-2


@pytest.mark.parametrize("sampler,multi", [("nsga2", True), ("gp", False), ("grid", False), ("tpe", True)])
def test_every_sampler_and_mode_runs(sampler, multi, tmp_path, monkeypatch):
    monkeypatch.setattr("tuner.cli.STUDIES_DIR", tmp_path)
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    assert (
        _run(storage, sampler, "--n-trials", "2", "--sampler", sampler, *(["--multi-objective"] * multi)) == 0
    )
    study = optuna.load_study(study_name=sampler, storage=storage)
    assert len(study.trials) == 2 and len(study.directions) == (2 if multi else 1)
    assert study.user_attrs["objectives"] == (["spill_bytes", "smem_bytes"] if multi else ["spill_bytes"])
    assert read_export(tmp_path / sampler / "best.json")["objectives"] == study.user_attrs["objectives"]


def test_written_json_has_the_permissions_of_a_plain_file(tmp_path):
    """write_json goes through mkstemp (0600) for atomicity; the result must still be
    readable as a file opened normally would be, so a deployment's user can load it."""
    plain = tmp_path / "plain.json"
    plain.write_text("{}")
    written = tmp_path / "table.json"
    write_json(written, {"a": 1})
    assert written.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777
    assert json.loads(written.read_text()) == {"a": 1}


def test_wave_seeds_launch_about_one_wave_and_are_allowed():
    # 2x16x16384, DV = 128 at block_dv 128: 32 blocks per segment count, 4 segments = 128
    # blocks, the nearest to 132 SMs; its neighbours 2 and 8, at 2 and 3 stages.
    problem = Problem(2, 16, 16384, 128, 128, 0.99)
    seeds = space.wave_seeds(problem, sms=132)
    assert sorted((c.segments, c.num_stages) for c in seeds) == [(n, s) for n in (2, 4, 8) for s in (2, 3)]
    assert {(c.chunk, c.block_dv, c.threads, c.scores) for c in seeds} == {(64, 128, 256, "smem")}
    # twice the SMs: one more doubling of segments
    assert {c.segments for c in space.wave_seeds(problem, sms=264)} == {4, 8, 16}
    # 1 segment at most: the headline's 128 (batch, head) pairs already fill the GPU
    assert {c.segments for c in space.wave_seeds(Problem(8, 16, 4096, 128, 128, 0.99))} == {1, 2}
    # DV = 256 is split in two 128-wide blocks; restricted configs are never seeded
    for problem in (Problem(3, 5, 3000, 128, 256, 0.9), Problem(1, 2, 256, 64, 64, 0.99)):
        seeds = space.wave_seeds(problem)
        assert all(c.block_dv == min(128, problem.dv) for c in seeds)
        assert all(space.violated(problem, c) == [] for c in seeds)
    assert space.wave_seeds(Problem(1, 2, 256, 64, 64, 0.99)) == []  # 64-token segments: no pipeline


@pytest.mark.parametrize(
    "options,seeded",
    [(Options(), True), (Options(wave_seeds=False), False), (Options(sampler="grid"), False)],
)
def test_studies_measure_the_wave_seeds_first(options, seeded, tmp_path):
    """A study enqueues the seed config, then the wave seeds (unless turned off, or for the grid)."""
    problem = Problem(2, 8, 2048, 64, 64, 0.99)
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    expected = [SEED_CONFIG, *(space.wave_seeds(problem) if seeded else [])]
    assert len(expected) > 1 or not seeded
    for _ in range(2):  # a second run over a queue nobody asked yet does not duplicate it
        study = Tuner(problem, options, name="s", storage=storage).study
        queued = [t.system_attrs["fixed_params"] for t in study.get_trials(deepcopy=False)]
        assert [KernelConfig.from_dict(p) for p in queued] == expected
