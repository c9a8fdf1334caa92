"""tuner.cli: ``python -m tuner`` end to end on the CPU (a compile-only exploration with
real TileLang compiles, real Optuna and real SQLite), what it prints, and the user's
mistakes: exit code 2 with one line."""

import argparse
import fcntl
import io
import json
import math
import os
import re
import signal
import struct
import subprocess
import sys
import termios
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import optuna
import pandas as pd
import pytest
import torch
from helpers import (
    GRID,
    LAYOUT_FAILURE,
    REPO,
    SMALL,
    SMALL_PROBLEM,
    add_small_trial,
    as_at_a_terminal,
    best_config_file,
    child_env,
    gpu_study,
    run_small,
)

import refs
from kernel import SEED_CONFIG, KernelConfig, Problem
from kernel.config import retnet_decay
from kernel.ops.deploy import ExportError, load_config, read_export
from kernel.rule import default_config
from kernel.trial_schema import EXTRAPOLATED, TRIAL_COLUMNS
from tuner import space
from tuner.cli import COMMANDS, build_parser, main
from tuner.commands.device import PROBE_LAST
from tuner.latency import latency_model
from tuner.lines import WIDTH, Progress
from tuner.studies import default_study_name, export_dir
from tuner.trials import LISTING_COLUMNS, save_frame, trials_frame


@pytest.fixture(scope="module")
def explored(tmp_path_factory) -> SimpleNamespace:
    """A compile-only study "e2e" of ``SMALL_PROBLEM``: 4 trials, the first the seed's
    config, one a config TileLang cannot lay out, no wave seeds left waiting; run once for
    the tests that read it."""
    tmp = tmp_path_factory.mktemp("explored")
    storage = f"sqlite:///{tmp / 'db.sqlite'}"
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, redirect_stdout(out), redirect_stderr(err):
        mp.setattr("tuner.cli.STUDIES_DIR", tmp)
        code = run_small(storage, "e2e", "--n-trials", "4", "--enqueue", LAYOUT_FAILURE, "--no-wave-seeds")
    return SimpleNamespace(dir=tmp, storage=storage, code=code, out=out.getvalue(), err=err.getvalue())


def _on(explored: SimpleNamespace, command: str, *extra: str) -> list[str]:
    return [command, *SMALL, "--storage", explored.storage, "--study", "e2e", *extra]


def test_compile_only_study_end_to_end(explored, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("tuner.cli.STUDIES_DIR", explored.dir)
    assert explored.code == 0
    assert "no CUDA device: compile-only exploration" in explored.err
    assert "compile-only" in explored.out and "no latency" in explored.out

    study = optuna.load_study(study_name="e2e", storage=explored.storage)
    assert len(study.trials) == 4
    assert study.trials[0].params == SEED_CONFIG.to_dict()  # the baseline goes first
    assert study.user_attrs["mode"] == "compile-only"
    assert study.user_attrs["objectives"] == ["predicted_x_floor"]

    frame = pd.read_csv(export_dir(explored.storage, "e2e", explored.dir) / "trials.csv")
    assert list(frame.columns) == list(TRIAL_COLUMNS) and len(frame) == 4
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
        pd.read_parquet(export_dir(explored.storage, "e2e", explored.dir) / "trials.parquet"),
        trials_frame(study),
        check_dtype=False,
    )

    exported = read_export(export_dir(explored.storage, "e2e", explored.dir) / "best.json")
    assert exported["mode"] == "compile-only" and exported["problem"] == SMALL_PROBLEM.to_dict()
    # ranked by the latency model's prediction, calibrated for sm_90a, recorded as predicted
    assert (
        ok.predicted_by.str.startswith("latency model of NVIDIA H200").all() and (ok.predicted_ms > 0).all()
    )
    # a config of knobs the model was not fitted to (the seed's: scores in registers) says so
    outside = ok.predicted_by.str.endswith(", outside the knobs it was fitted to").tolist()
    knobs = ok[list(KernelConfig().to_dict())].to_dict("records")
    assert outside == [not latency_model().covers(SMALL_PROBLEM, KernelConfig(**k)) for k in knobs]
    assert outside[ok.number.tolist().index(0)]  # the seed's config, trial 0
    assert ((ok.predicted_low < ok.predicted_x_floor) & (ok.predicted_x_floor < ok.predicted_high)).all()
    # ranked by the prediction where the model covers the knobs; an extrapolation after them
    told = {t.number: t.values[0] for t in study.trials if t.user_attrs.get("status") == "ok"}
    assert told == {n: math.inf if o else x for n, x, o in zip(ok.number, ok.predicted_x_floor, outside)}
    assert (ok.reason[outside] == EXTRAPOLATED).all()
    best = min(ok.itertuples(), key=lambda r: (told[r.number], r.predicted_x_floor, r.number))
    assert exported["configs"][0]["predicted_x_floor"] == best.predicted_x_floor
    with pytest.raises(ExportError, match="ranked by predicted time .* never measured"):
        load_config(export_dir(explored.storage, "e2e", explored.dir) / "best.json")  # nothing to load

    # The study is kept: its trials and its export can be read back by later commands.
    assert main(_on(explored, "trials")) == 0
    assert "compile_failed" in capsys.readouterr().out
    assert main(_on(explored, "export", "--out", str(tmp_path / "x.json"))) == 0
    assert read_export(tmp_path / "x.json")["configs"] == exported["configs"]


def _table_lines(out: str) -> tuple[str, list[str], list[str]]:
    """(heading, header columns, rows) of what `trials` or `best` printed, the heading's
    lines joined, its notes left out."""
    heading, _, table = out.partition("\n\n")[0].partition("\nnumber ")
    header, *rows = f"number {table}".splitlines()
    return " ".join(heading.split()), header.split(), rows


def _shown_whole(cell: str, whole: str, out: str) -> bool:
    """Whether a reason's ``cell`` is ``whole``, or its start with a note in ``out`` that
    holds ``whole``."""
    if cell == whole:
        return True
    start, mark, n = cell.rpartition("... [")
    notes = " ".join(out.partition("\n\n")[2].split())
    return bool(mark) and whole.startswith(start) and f"[{n} {' '.join(whole.split())}" in notes


def test_trials_prints_whole_numbers_blank_cells_and_first_lines(explored, capsys):
    assert main(_on(explored, "trials")) == 0
    out = capsys.readouterr().out
    heading, header, rows = _table_lines(out)
    assert heading == "study 'e2e' (compile-only for sm_90a: no latency measured, ranked by predicted time)"
    assert header == list(LISTING_COLUMNS) and len(rows) == 4
    printed = "\n".join(rows)
    assert not re.search(r"\d\.0\b", printed)  # smem bytes, registers, spills: no ".0"
    assert not re.search(r"\b(None|NaN|nan|NA|<NA>)\b", printed)  # empty cells are blank
    frame = trials_frame(optuna.load_study(study_name="e2e", storage=explored.storage))
    for row, trial in zip(rows, frame.itertuples()):
        config = KernelConfig(**{k: getattr(trial, k) for k in KernelConfig().to_dict()}).label
        assert row.split()[:3] == [str(trial.number), trial.status, config]
        if trial.status == "ok":  # compile-only: the predicted time, sizes in bytes, no latency
            assert float(row.split()[3]) == pytest.approx(trial.predicted_ms, rel=1e-2)
            assert row.split()[4:7] == [
                f"{trial.spill_bytes:.0f}",
                f"{trial.smem_bytes:.0f}",
                f"{trial.registers:.0f}",
            ]
            reason = " ".join(row.split()[7:])  # an extrapolation says how it is ranked, in full
            assert _shown_whole(reason, trial.reason if isinstance(trial.reason, str) else "", out)
    layout = frame[frame.status == "compile_failed"].reason.iloc[0].splitlines()
    shown = next(row for row in rows if "compile_failed" in row).split(maxsplit=3)[3]
    assert len(layout) > 1 and _shown_whole(shown, layout[0], out)  # the first line
    assert layout[1].strip() not in out and max(map(len, out.splitlines())) <= 120


def test_trials_fits_its_width_and_the_log_keeps_the_whole_reason(tmp_path, capsys):
    """A compiler's message as long as TileLang's: `trials` cuts it to keep every line
    within 120 characters, marks the cut with a note that holds it whole after the table;
    the trial log's CSV holds it whole too."""
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    study = gpu_study([0.5, None], storage=storage, name="long")
    reason = "LoweringError: " + " ".join(f"buffer{i}[{i}:{i + 64}]" for i in range(24)) + "\n  at stage 2"
    assert len(reason.splitlines()[0]) > 300
    study.add_trial(
        optuna.trial.create_trial(
            params=GRID[2].to_dict(),
            distributions=space.search_space(SMALL_PROBLEM).distributions,
            state=optuna.trial.TrialState.FAIL,
            user_attrs={"mode": "gpu", "status": "compile_failed", "reason": reason},
        )
    )
    assert main(["trials", *SMALL, "--storage", storage, "--study", "long"]) == 0
    out = capsys.readouterr().out
    heading, header, rows = _table_lines(out)
    assert WIDTH == 120 and max(map(len, out.splitlines())) <= 120
    cut = rows[2].split(maxsplit=3)[3]
    assert re.search(r"\.\.\. \[\d\]$", cut) and _shown_whole(cut, reason.splitlines()[0], out)
    assert len(rows[2]) == 120  # cut at the width, not before
    (csv, *_) = save_frame(trials_frame(study), tmp_path / "trials")
    assert pd.read_csv(csv).reason.tolist()[2] == reason


def test_an_uncalibrated_study_says_so_and_shows_its_predicted_ratio(tmp_path, capsys):
    """A compile-only study for an architecture the latency model was not fitted to ranks
    by the analytic part alone: its heading says so, and its table shows the predicted
    ratio to the floor where it has no predicted time in ms."""
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    study = optuna.create_study(storage=storage, study_name="old-gpu")
    for key, value in (("problem", SMALL_PROBLEM.to_dict()), ("mode", "compile-only"), ("arch", "sm_80")):
        study.set_user_attr(key, value)
    by = "analytic part alone: uncalibrated for sm_80"
    for config, ratio in zip(GRID[:2], (1.5, 1.25)):
        add_small_trial(
            study, config, ratio, mode="compile-only", status="ok", predicted_x_floor=ratio, predicted_by=by
        )
    assert main(["best", *SMALL, "--storage", storage, "--study", "old-gpu"]) == 0
    heading, header, rows = _table_lines(capsys.readouterr().out)
    assert heading.startswith(
        "study 'old-gpu' (compile-only for sm_80: no latency measured, ranked by predicted time (the "
        "analytic part alone: the latency model was not calibrated for it)"
    )
    assert header == [c if c != "predicted_ms" else "predicted_x_floor" for c in LISTING_COLUMNS]
    assert [row.split()[3] for row in rows] == ["1.25", "1.5"]
    study.set_user_attr("arch", "sm_90a")  # ranked where the model file could not be read
    add_small_trial(
        study,
        GRID[2],
        1.75,
        mode="compile-only",
        status="ok",
        predicted_x_floor=1.75,
        predicted_by="analytic part alone: no latency model could be read",
    )
    assert main(["best", *SMALL, "--storage", storage, "--study", "old-gpu"]) == 0
    heading = _table_lines(capsys.readouterr().out)[0]
    assert "ranked by predicted time (the analytic part alone: no latency model could be read))" in heading


def test_best_prints_the_columns_of_trials(explored, capsys):
    assert main(_on(explored, "trials")) == 0
    _, trials_header, trials_rows = _table_lines(capsys.readouterr().out)
    assert main(_on(explored, "best", "--top", "1")) == 0
    heading, header, rows = _table_lines(capsys.readouterr().out)
    assert heading.startswith("study 'e2e' (compile-only") and header == trials_header
    assert ", compiled in environment " in heading and "measured in" not in heading
    (best,) = rows
    # The same cells as in `trials` but the reason, cut to each listing's width; compile-only:
    # median_ms and rel_l2 blank.
    cells = len(LISTING_COLUMNS) - 3
    assert best.split()[:cells] in [row.split()[:cells] for row in trials_rows]
    assert best.split()[1] == "ok"


def test_an_empty_study_s_trials_and_a_report_of_no_environment(tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    optuna.create_study(storage=storage, study_name="empty").set_user_attr("mode", "gpu")
    assert main(["trials", *SMALL, "--storage", storage, "--study", "empty"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ["no trials yet"]
    gpu_study([0.5, 0.3], storage=storage, name="timed")
    argv = ["report", *SMALL, "--storage", storage, "--study", "timed", "--out", str(tmp_path / "r.html")]
    assert main([*argv, "--env", "nosuchenv"]) == 2
    err = capsys.readouterr().err
    assert "--env 'nosuchenv' names no environment" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "storage, said",
    [
        ("journal:/proc/1/j.log", "cannot write the storage '/proc/1/j.log': '/proc/1' is read-only"),
        ("sqlite:////proc/1/db.sqlite", "storage '/proc/1/db.sqlite': '/proc/1' is read-only"),
    ],
)
def test_a_storage_or_studies_folder_it_cannot_write_is_one_line_before_any_trial(
    storage, said, tmp_path, capsys, monkeypatch
):
    """/proc/1 refuses writes to everyone, root too (as a read-only mount does)."""
    assert main(["run", *SMALL, "--storage", storage, "--n-trials", "1"]) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1
    monkeypatch.setattr("tuner.cli.STUDIES_DIR", Path("/proc/1/studies"))
    argv = ["run", *SMALL, "--storage", f"journal:{tmp_path / 'j.log'}", "--n-trials", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot write the study's files '/proc/1/studies/storages/" in err and err.count("\n") == 1
    assert not (tmp_path / "j.log").exists()  # refused before the storage was made


@pytest.mark.parametrize("command", ["trials", "best", "report", "run"])
def test_a_study_of_another_program_is_one_line(command, tmp_path, capsys):
    """An Optuna study of its own parameters in the same storage: never read as configs."""
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    raw = optuna.create_study(storage=storage, study_name="raw")
    raw.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    assert main([command, *SMALL, "--storage", storage, "--study", "raw"]) == 2
    err = capsys.readouterr().err
    assert "study 'raw'" in err and "is no decay-tuner study (parameters ['x'])" in err
    assert err.count("\n") == 1
    assert "problem" not in optuna.load_study(study_name="raw", storage=storage).user_attrs


def test_compare_checks_its_out_path_before_comparing(tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    for name in ("a", "b"):
        gpu_study([0.5, 0.3], storage=storage, name=name)
    argv = ["compare", *SMALL, "--storage", storage, "--study", "a", "--against", "b"]
    for out, said in (
        (tmp_path, "--out wants a .json file path"),
        (tmp_path / "db.sqlite" / "c.json", "is a file"),
    ):
        assert main([*argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1
    assert main([*argv, "--out", str(tmp_path / "c.json")]) == 0
    assert json.loads((tmp_path / "c.json").read_text())["study"] == "a"
    capsys.readouterr()
    assert main([*argv, "--out", "/proc/1/c.json"]) == 2  # a folder no one writes into, root too
    err = capsys.readouterr().err
    assert err == "error: cannot write --out '/proc/1/c.json': '/proc/1' is read-only\n"


def test_a_compile_only_study_resumed_under_another_latency_model_exits_2(
    explored, tmp_path, capsys, monkeypatch
):
    from tuner import latency

    monkeypatch.setattr("tuner.cli.STUDIES_DIR", explored.dir)
    monkeypatch.setenv(latency.MODEL_VARIABLE, str(tmp_path / "none.json"))  # unreadable: the analytic part
    assert main(_on(explored, "run", "--n-trials", "1")) == 2
    warning, said = capsys.readouterr().err.splitlines()
    assert "predictions are the analytic part alone" in warning
    shipped = latency.LatencyModel.load(latency.MODEL_FILE).key
    assert said.startswith(f"error: study 'e2e' was ranked by the latency model {shipped}; the model")
    chooses = "(DECAY_TUNER_LATENCY_MODEL or --for-gpu chooses it)"
    assert f"in use is {latency.ANALYTIC_ONLY.key} {chooses}" in said


def test_compare_refuses_a_compile_only_study(explored, capsys):
    """Whichever side is compile-only, the error names it."""
    storage = explored.storage
    gpu_study([0.5, 0.3], storage=storage, name="timed")
    for study, against in (("e2e", "timed"), ("timed", "e2e")):
        argv = ["compare", *SMALL, "--storage", storage, "--study", study, "--against", against]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert "study 'e2e' is compile-only" in err and "'timed'" not in err


def test_export_to_a_directory_exits_2_and_writes_nothing(explored, tmp_path, capsys):
    folder = tmp_path / "out"
    folder.mkdir()
    assert main(_on(explored, "export", "--out", str(folder))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out wants a .json file path" in err and str(folder) in err
    assert list(tmp_path.rglob("*")) == [folder]


def test_the_summary_counts_queued_configs_apart(tmp_path, capsys, monkeypatch):
    """One trial asked: the seed config runs, the one-wave seeds wait for the next run."""
    monkeypatch.setattr("tuner.cli.STUDIES_DIR", tmp_path)
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    argv = ["run", "--dk", "64", "--dv", "64", "--batch", "1", "--heads", "2", "--seqlen", "4096"]
    assert main([*argv, "--storage", storage, "--workers", "2", "--no-progress", "--n-trials", "1"]) == 0
    study = optuna.load_study(study_name=default_study_name(Problem(1, 2, 4096, 64, 64)), storage=storage)
    waiting = sum(t.state == optuna.trial.TrialState.WAITING for t in study.trials)
    assert waiting >= 1
    said = " ".join(capsys.readouterr().out.split())
    assert (
        f": 1 trial ({waiting} queued for the next run), 0 GPU evaluations, 1 config new to the study" in said
    )
    frame = pd.read_csv(export_dir(storage, study.study_name, tmp_path) / "trials.csv")
    queued = frame[frame.status == "queued"]
    fixed = [
        t.system_attrs["fixed_params"] for t in study.trials if t.state == optuna.trial.TrialState.WAITING
    ]
    assert queued[list(fixed[0])].to_dict("records") == fixed  # the enqueued configs, not defaults


def test_no_line_a_command_prints_is_wider_than_120_columns(explored, tmp_path, capsys, monkeypatch):
    """What run (compile-only), trials, best, export, report, compare, probe and model show
    print, on stdout and on stderr, fits a terminal of 120 columns: prose wraps (a path
    whole), a table cuts its reasons into notes, probe gives each row's reason a line."""
    from kernel.environment import environment
    from tuner.storage import get_storage

    monkeypatch.setattr("tuner.cli.STUDIES_DIR", explored.dir)
    storage = f"journal:{tmp_path / 'j.log'}"
    env = environment() | {"gpu": "NVIDIA H200"}  # a GPU's name lengthens the environment's line
    for name in ("tuned", "yard"):
        gpu_study([0.5, 0.3, 0.4], storage=get_storage(storage), name=name, env=env)
    gpu = ["--storage", storage, *SMALL]
    runs = {
        "trials": _on(explored, "trials"),
        "best": _on(explored, "best"),
        "export": _on(explored, "export", "--out", str(tmp_path / "best.json")),
        "report": _on(explored, "report", "--out", str(tmp_path / "report.html")),
        "best, a GPU study": ["best", *gpu, "--study", "tuned"],
        "export, a GPU study": ["export", *gpu, "--study", "tuned", "--out", str(tmp_path / "gpu.json")],
        "compare": ["compare", *gpu, "--study", "tuned", "--against", "yard"],
        "probe": ["probe", *SMALL, "--arch", "sm_90a"],
        "probe, refused": ["probe", "--dk", "48", "--dv", "48", *SMALL[4:], "--arch", "sm_90a,sm_80"],
        "model show": ["model", "show"],
    }
    printed = {"run": explored.out + explored.err}
    for what, argv in runs.items():
        assert main(argv) == 0, what
        printed[what] = "".join(capsys.readouterr())
    assert all(printed.values())
    wide = [(what, line) for what, text in printed.items() for line in text.splitlines() if len(line) > 120]
    assert wide == []


def _progress_to(stream, times: list[float]) -> Progress:
    """A ``Progress`` of 5 kernels on ``stream``, each ended at the next of ``times`` (after
    the start's)."""
    clock = iter(times)
    progress = Progress(5, verb="compiled", unit="kernels", stream=stream, clock=lambda: next(clock))
    for _ in range(5):
        progress()
    progress.close()
    return progress


def _drained(read_fd: int) -> str:
    """All that was written to the other side of ``read_fd`` (a pipe, or a terminal's master
    side, which hands over what was written a read at a time where it likes), once that side
    is closed."""
    chunks = []
    with open(read_fd, "rb", buffering=0) as reader:
        while True:
            try:
                chunk = reader.read(4096)
            except OSError:  # a terminal whose other side is closed and drained (EIO)
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks).decode()


@pytest.mark.parametrize("where", ["pipe", "terminal of no size"])
def test_progress_without_a_terminal_size_is_a_line_every_10_s(where):
    """A pipe, or a terminal that reports no size: the first, then one line at most every 10
    s, then the last, each with the time since the start."""
    read_fd, write_fd = os.pipe() if where == "pipe" else os.openpty()
    with open(write_fd, "w") as stream:
        progress = _progress_to(stream, [0.0, 1.0, 5.0, 12.0, 13.0, 30.4])
    assert progress.bar is None
    said = _drained(read_fd)
    assert said.splitlines() == [
        "compiled 1/5 kernels (1 s)",
        "compiled 3/5 kernels (12 s)",
        "compiled 5/5 kernels (30 s)",
    ]


def test_progress_on_a_terminal_of_a_size_is_a_bar():
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    with open(slave, "w") as stream:
        progress = _progress_to(stream, [0.0] * 6)
    said = _drained(master)
    assert progress.bar is not None and "\r" in said and "5/5" in said and "compiled 1/5" not in said


def test_warmup_without_a_terminal_says_how_far_it_is_and_where_the_kernels_went():
    """``warmup`` with stdout and stderr to pipes, on head sizes that serve few kernels: at
    1024 heads every batch is one (B*H up to 512) and at DK = 256 the rule keeps one stage
    at every length, so one config serves all (6 forward kernels, 4 decode steps: a minute
    on 2 cores with TileLang's cache cold, 10 s warm). Its progress as lines on stderr, its
    last line on stdout naming TileLang's cache folder."""
    from kernel.loader import cache_dir

    argv = ["warmup", "--heads", "1024", "--dk", "256", "--dv", "64", "--arch", "sm_90a"]
    done = subprocess.run(
        [sys.executable, "-m", "tuner", *argv], capture_output=True, text=True, env=child_env(), timeout=600
    )
    assert done.returncode == 0, done.stderr
    progress = done.stderr.splitlines()
    counts = [re.fullmatch(r"compiled (\d+)/(\d+) kernels \(\d+ s\)", line) for line in progress]
    assert all(counts), progress
    total = int(counts[-1][2])
    assert (int(counts[0][1]), int(counts[-1][1])) == (1, total) and total >= 10
    said = " ".join(done.stdout.split())  # one line, or two where the folder's path is long
    assert said.startswith(f"warmed {total} kernels for sm_90a in ") and said.endswith(f": {cache_dir()}")
    assert cache_dir().is_dir()


def test_probe_without_a_config_compiles_the_rule_s_config_per_architecture(capsys):
    """No --config: each architecture's ``default_config`` for the flags' problem (not the
    seed's), named in a column; a line on stderr as each architecture starts compiling;
    --help says where the default comes from."""
    config = default_config(SMALL_PROBLEM, "sm_90a")
    assert config != SEED_CONFIG
    assert main(["probe", *SMALL, "--arch", "sm_90a"]) == 0
    out, err = capsys.readouterr()
    heading, _, table = out.partition("\nconfig ")
    header, last, row, why = ("config " + table).splitlines()
    assert heading.startswith("the default config (kernel.rule.default_config) of each architecture")
    assert header.split()[:3] == ["config", "arch", "status"] and last == "    " + PROBE_LAST
    assert row.split()[:3] == [config.label, "sm_90a", "ok"]
    assert re.fullmatch(r"    predicted \S+ ms \(\S+ to \S+\), \d+\.\d\dx floor", why), why
    assert err == f"compiling {config.label} for sm_90a (1 of 1)\n"
    help_text = _help_entries("probe")["--config"]
    assert "(default: each architecture's config of the rule kernel.rule.default_config" in help_text


def test_probe_of_several_architectures_names_those_the_rule_refuses_and_goes_on(capsys):
    """An architecture whose rule has no config for the head sizes is a row saying why, not
    the end of the table; asked of one architecture alone, it is one line and exit 2."""
    args = ["probe", "--dk", "48", "--dv", "48", "--batch", "1", "--heads", "2", "--seqlen", "256"]
    assert main([*args, "--arch", "sm_90a,sm_80"]) == 0
    rows = [" ".join(r.split()) for r in capsys.readouterr().out.split("\n- ")[1:]]  # each with its reason
    assert [r.split()[:2] for r in rows] == [["sm_90a", "restricted"], ["sm_80", "restricted"]]
    assert "DK a multiple of 64" in rows[0] and "tiles its MMA across 8 warps" in rows[1], rows
    assert main([*args, "--arch", "sm_90a"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


# Runs ``python -m tuner ARGV`` (ARGV as JSON) and prints, last, its exit code and which
# heavy libraries it imported.
HELP_PROBE = """
import json, runpy, sys
sys.argv = ["tuner", *json.loads(sys.argv[1])]
code = None
try:
    runpy.run_module("tuner", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in ("torch", "tilelang", "optuna", "pandas") if m in sys.modules)
print(json.dumps({"code": code, "heavy": heavy}))
"""


@pytest.mark.parametrize("argv", [["--help"], *([name, "--help"] for name in COMMANDS)], ids=" ".join)
def test_help_answers_without_loading_heavy_libraries(argv):
    done = subprocess.run(
        [sys.executable, "-c", HELP_PROBE, json.dumps(argv)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    *shown, last = done.stdout.splitlines()
    assert json.loads(last) == {"code": 0, "heavy": []}, done.stderr[-2000:]
    assert shown[0].startswith("usage: python -m tuner") and done.stderr == ""


def _help_entries(command: str) -> dict[str, str]:
    """Each option's entry in ``command --help``, by its first flag, on one line (printed
    wide: argparse breaks a long default, such as a temporary folder's path, at a hyphen)."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, redirect_stdout(out), pytest.raises(SystemExit) as exit:
        mp.setenv("COLUMNS", "1000")
        build_parser().parse_args([command, "--help"])
    assert exit.value.code == 0
    entries: dict[str, str] = {}
    current = None
    for line in out.getvalue().splitlines():
        if match := re.match(r"  (--?[\w-]+)", line):
            current = match.group(1)
            entries[current] = line.strip()
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_flag_has_help_and_shows_its_default(command):
    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    entries = _help_entries(command)
    for action in sub.choices[command]._actions:
        if not action.option_strings:  # a positional (model's action): its help, no default
            assert action.help and action.dest in entries.get(action.dest, action.dest)
            continue
        flag = action.option_strings[0]
        if flag == "-h" or action.help == argparse.SUPPRESS:  # run's --worker: internal to --gpus
            continue
        assert action.help, flag
        entry = entries[flag]
        assert " ".join(action.help.split()) in entry, (flag, entry)
        value = (
            action.nargs != 0 and action.default not in (None, []) and not isinstance(action.default, bool)
        )
        if value and "default" not in action.help:  # unless its help already says what it defaults to
            assert entry.endswith(f"(default: {action.default})"), (flag, entry)
    if command == "run":
        assert entries["--seed"].endswith("(default: 0)")  # 0 is a default too
        assert entries["--max-spill-bytes"].endswith("(default: 0)")
        assert entries["--n-trials"].endswith("(default: 40)")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["run", "--dk", "0"], "dk must be a positive integer"),
        (["run", "--dk", "100"], "dk must be a multiple of 16"),
        (["run", "--alpha", "0.9"], "unrecognized arguments: --alpha 0.9"),  # the decay is a run-time input
        (["bench", "--alpha", "0.9"], "unrecognized arguments: --alpha 0.9"),
        (["bench", "--packed", "-1"], "--packed wants a number of sequences >= 0"),
        (["run", "--storage", "nosuchdb://x"], "cannot open storage"),
        (["run", "--sampler", "random"], "invalid choice"),
        (["run", "--enqueue", "64/32"], "--enqueue wants"),
        (["run", "--enqueue", "64/48/1/128"], "outside the search space"),
        (
            ["run", "--enqueue", "a/b/c/d"],
            "--enqueue wants C/bDV/stages/threads[/scores[/segments]], numbers but",
        ),
        (["trials", "--study", "nope", "--storage", "sqlite:///:memory:"], "no storage at"),
        (["frobnicate"], "invalid choice"),
        (["run", "--workers", "0"], "--workers must be positive"),
        (["run", "--tolerance", "-1"], "--tolerance must be positive"),
        (["run", "--timeout", "nan"], "--timeout must be positive"),
        (["run", "--max-spill-bytes", "-1"], "--max-spill-bytes must be >= 0"),
        (["run", "--enqueue", "64/32/1/128/smem/0"], "segments must be a positive integer"),
        (["best", "--top", "0"], "--top must be positive"),
        (["run", "--sweep", "dkdv", "--dk", "256", "--dv", "256"], "fused dk and dv pass does not serve"),
        (["run", "--sweep", "dkdv", "--arch", "sm_80"], "does not serve DK x DV = 128 x 128 on sm_80"),
        (["run", "--sweep", "dq"], "invalid choice"),
        (["dispatch", "--shapes", "1x2"], "--shapes wants BxHxS"),
        (["dispatch", "--dv", "20"], "dv must be a multiple of 16"),
        (["dispatch", "--out", "/"], "--out wants a .json file path"),
        (["warmup", "--arch", "sm_90a", "--workers", "0"], "--workers must be positive"),
        (["run", "--arch", "sm_90a", "--dk", "96"], "on sm_90a the kernels need DK a multiple of 64"),
        (
            ["run", "--arch", "sm_90a", "--dk", "64", "--dv", "48"],
            "on sm_90a the kernels need DV a multiple of 32",
        ),
        (["warmup", "--arch", "sm_90a", "--dk", "96"], "on sm_90a the kernels need DK a multiple of 64"),
        (
            ["dispatch", "--arch", "sm_90a", "--dv", "96", "--backward"],
            "need DK a multiple of 64 (their warpgroup MMA), got 96",
        ),
        (["run", "--seed", "-1"], "--seed must be >= 0"),
        (
            ["run", "--batch", "4096", "--heads", "16"],
            "batch x heads = 4096 x 16 = 65536: the kernels take at most",
        ),
        (["run", "--tolerance", "inf"], "--tolerance must be at most 1"),
        (["run", "--max-registers", "100000"], "--max-registers must be at most 255"),
        (["run", "--heartbeat", "100", "--grace", "10"], "--grace (10 s) must be longer than --heartbeat"),
        (["run", "--storage", "sqlite://"], "keeps nothing"),
        (["run", "--study", ""], "--study wants a name, got ''"),
        (["compare", "--against", ""], "--against wants a name, got ''"),
        (["run", "--for-gpu", ""], "--for-gpu wants a name, got ''"),
        (["run", "--study", "storages/j-1/b1"], "is reserved: the studies folder's storages/ holds"),
        (["run", "--study", "decay-tuner.db-journal"], "names the storage's file '"),
        (["export", "--study", "decay-tuner.db-wal/x"], "decay-tuner.db-wal': choose another --study"),
        (["model", "show", "--data", "x.jsonl"], "model show takes no --data: model fit's"),
        (
            ["model", "show", "--out", "m.json", "--bandwidth", "3e12"],
            "takes no --bandwidth, --out: model fit's",
        ),
        (["best", "--storage", ""], "--storage wants a name, got ''"),
        (["bench", "--dispatch", "/nonexistent/table.json"], "cannot read dispatch table"),
        (["bench", "--shapes", "8x16"], "--shapes wants BxHxS"),
        (["dispatch", "--shapes", "8x16x64,4096x32x64"], "--shapes: batch x heads = 4096 x 32 = 131072"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "command, said",
    [
        ("run", "interrupted: finished trials are kept in the study; run the same command to go on"),
        ("warmup", "interrupted: the kernels compiled so far are in TileLang's disk cache; run the same"),
        ("bench", "interrupted"),
    ],
)
def test_ctrl_c_says_in_one_line_what_the_command_keeps(command, said, monkeypatch, capsys):
    """A Ctrl-C in a command (here raised where it starts) exits 130 with one line that names
    what the same command goes on from, or none where nothing is kept."""

    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    monkeypatch.setitem(COMMANDS, command, (interrupted, COMMANDS[command][1]))
    before = signal.getsignal(signal.SIGINT)
    try:
        assert main([command]) == 130
    finally:
        signal.signal(signal.SIGINT, before)  # main ignores Ctrl-C once it has said so
    err = capsys.readouterr().err
    assert err.startswith(said) and err.count("\n") == 1


@pytest.mark.parametrize("command", ["trials", "best", "export", "report", "compare"])
@pytest.mark.parametrize("storage", ["sqlite:///{}/no.db", "journal:{}/no.log", "{}/no.log"])
def test_read_only_commands_never_create_a_storage(command, storage, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("tuner.cli.STUDIES_DIR", tmp_path)
    extra = ["--against", "other"] if command == "compare" else []
    assert main([command, "--storage", storage.format(tmp_path), *extra]) == 2
    err = capsys.readouterr().err
    assert "no storage at" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["run", "trials", "export", "report"])
@pytest.mark.parametrize("name", ["../../tmp/evil", "/tmp/evil", "a/../../evil"])
def test_a_study_name_outside_the_studies_folder_exits_2_and_writes_nothing(
    command, name, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr("tuner.cli.STUDIES_DIR", tmp_path / "studies")
    argv = [command, *SMALL, "--storage", f"journal:{tmp_path / 'j.log'}", "--study", name]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "would leave the studies folder" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_out_as_a_folder_path_exits_2_and_writes_nothing(explored, tmp_path, capsys):
    for out in (str(tmp_path / "new") + "/", str(tmp_path)):
        assert main(_on(explored, "export", "--out", out)) == 2
        err = capsys.readouterr().err
        assert "--out wants a .json file path" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_unreadable_json_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": ')
    assert main(["run", "--enqueue-from", str(bad)]) == 2
    assert "cannot read best-config file" in capsys.readouterr().err
    assert main(["run", "--enqueue-from", str(tmp_path / "missing.json")]) == 2
    capsys.readouterr()
    incomplete = [{"config": {"chunk": 64, "block_dv": 64, "num_stages": 1, "scores": "smem"}}]
    for configs, said in (
        ("abc", "configs is not a list"),
        (["abc"], "malformed entry: configs[0] is not a JSON object"),
        (incomplete, "malformed entry: configs[0].config lacks threads"),  # no default filled in
    ):
        assert main(["run", "--enqueue-from", str(best_config_file(tmp_path, configs=configs))]) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the command would tune; see the gpu test")
def test_dispatch_without_a_gpu_refuses_and_names_the_compile_only_way(capsys):
    assert main(["dispatch", "--shapes", "1x2x256", "--dk", "64", "--dv", "64"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA device (--arch sm_90a explores compile-only: no table is written)" in err


@pytest.mark.gpu
def test_gpu_study_end_to_end(tmp_path, monkeypatch, capsys):
    """On a GPU: trials are timed and checked, and the export loads into a kernel that runs."""
    from kernel.ops.deploy import load_kernel
    from kernel.validate import check

    monkeypatch.setattr("tuner.cli.STUDIES_DIR", tmp_path)
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    assert run_small(storage, "gpu", "--n-trials", "3", "--enqueue", "64/64/1/128") == 0
    assert "median" in capsys.readouterr().out
    frame = pd.read_csv(export_dir(storage, "gpu", tmp_path) / "trials.csv")
    ok = frame[frame.status == "ok"]
    assert len(ok) >= 2 and (ok.median_ms > 0).all() and ok.gpu_evaluated.all()
    assert (ok.rel_l2 < refs.TOLERANCE).all()
    assert (ok.p20_ms <= ok.median_ms).all() and (ok.median_ms <= ok.p80_ms).all()
    kernel = load_kernel(export_dir(storage, "gpu", tmp_path) / "best.json")
    assert check(kernel, seed=5)["rel_l2"] < refs.TOLERANCE


@pytest.mark.gpu
def test_gpu_dispatch_end_to_end(tmp_path, monkeypatch, capsys):
    """On a GPU: two shapes tuned, the table written, and a kernel it serves matches C."""
    from kernel.ops.dispatch import load_dispatch
    from kernel.validate import random_qkv

    monkeypatch.setattr("tuner.cli.STUDIES_DIR", tmp_path)
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    argv = ["dispatch", "--dk", "64", "--dv", "64", "--shapes", "4x8x512,1x2x4096", "--storage", storage]
    argv += ["--n-trials", "3", "--enqueue", "64/64/1/128/smem/8", "--workers", "4", "--no-progress"]
    assert main(argv) == 0
    table = load_dispatch(tmp_path / "dispatch.json")
    assert [e.problem.seqlen for e in table.entries] == [512, 4096]
    problem = Problem(1, 3, 3000, 64, 64)  # an untuned shape, served by the nearest bucket
    q, k, v = random_qkv(problem, seed=8)
    out = table(q, k, v, decay=0.95)
    ref = refs.kernel_mimic(q, k, v, 0.95, table.pick(problem).config.chunk)
    assert refs.rel_l2(out, ref) < refs.TOLERANCE
    gammas = torch.tensor(retnet_decay(problem.heads), device="cuda")
    ref = refs.kernel_mimic(q, k, v, gammas, table.pick(problem).config.chunk)
    assert refs.rel_l2(table(q, k, v), ref) < refs.TOLERANCE  # RetNet's decays by default


def test_best_and_export_rank_each_environment_apart(tmp_path, capsys, monkeypatch):
    """Workers on two GPU kinds share a study: each environment is ranked on its own, and
    `best` and `export` say which one they report."""
    from kernel.environment import env_key, environment
    from tuner.storage import get_storage

    monkeypatch.setattr("tuner.cli.STUDIES_DIR", tmp_path)
    storage = f"journal:{tmp_path / 'j.log'}"
    h100, h200 = (environment() | {"gpu": gpu} for gpu in ("NVIDIA H100", "NVIDIA H200"))
    study = gpu_study([0.5, 0.3], storage=get_storage(storage), name="mix", env=h100)
    for config, ms, env in zip(GRID[2:5], [0.4, 0.2, 0.9], [h200, h200, environment()]):
        add_small_trial(
            study, config, ms, mode="gpu", status="ok", environment=env, median_ms=ms, rel_l2=1e-3
        )
    on = ["--storage", storage, "--study", "mix", *SMALL]

    # This machine's environment has a trial: it is the default, and it is named.
    assert main(["export", *on, "--out", str(tmp_path / "here.json")]) == 0
    err = capsys.readouterr().err
    assert f"measured in environment {env_key(environment())}" in err
    assert read_export(tmp_path / "here.json")["configs"][0]["median_ms"] == 0.9
    # Another environment by its key's start: its own ranking, never the others'.
    assert main(["best", *on, "--env", env_key(h200)[:6]]) == 0
    heading, header, rows = _table_lines(capsys.readouterr().out)
    assert f", measured in environment {env_key(h200)} (NVIDIA H200," in heading
    assert [float(r.split()[3]) for r in rows] == [0.2, 0.4]
    assert main(["export", *on, "--env", env_key(h100), "--out", str(tmp_path / "h100.json")]) == 0
    capsys.readouterr()
    exported = read_export(tmp_path / "h100.json")
    assert exported["environment"] == h100 and [c["median_ms"] for c in exported["configs"]] == [0.3, 0.5]
    assert main(["best", *on, "--env", ""]) == 2  # no prefix of every key
    assert capsys.readouterr().err == "error: --env wants a name, got ''\n"
    assert main(["best", *on, "--env", "zzz"]) == 2
    err = capsys.readouterr().err
    assert "--env 'zzz' names no environment" in err and "NVIDIA H200" in err and err.count("\n") == 1
    # The report holds one environment's trials, and says which.
    assert main(["report", *on, "--env", env_key(h200)[:6], "--out", str(tmp_path / "h200.html")]) == 0
    assert f"measured in environment {env_key(h200)}" in capsys.readouterr().err
    assert sorted(trials_frame(study, env=env_key(h200)).median_ms) == [0.2, 0.4]
    # compare: the yardstick's trials of the same environment, never another GPU's.
    gpu_study([0.39], storage=get_storage(storage), name="yard", env=h100)
    against = ["compare", *on, "--against", "yard"]
    assert main([*against, "--env", env_key(h100)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["best_ms"], summary["yardstick_best_ms"], summary["gpu_evaluations"]) == (0.3, 0.39, 2)
    assert main([*against, "--env", env_key(h200)]) == 2
    err = capsys.readouterr().err
    assert f"names no environment of study 'yard'; it has: {env_key(h100)}" in err and err.count("\n") == 1


def test_a_study_of_other_environments_asks_which(tmp_path, capsys, monkeypatch):
    from kernel.environment import environment
    from tuner.storage import get_storage

    monkeypatch.setattr("tuner.cli.STUDIES_DIR", tmp_path)
    storage = f"journal:{tmp_path / 'j.log'}"
    study = gpu_study(
        [0.5], storage=get_storage(storage), name="a", env=environment() | {"gpu": "NVIDIA H100"}
    )
    assert main(["best", "--storage", storage, "--study", "a", *SMALL]) == 0  # the only one: no question
    capsys.readouterr()
    gpu_study([0.4], storage=get_storage(storage), name="b", env=environment() | {"gpu": "NVIDIA H200"})
    for trial in optuna.load_study(study_name="b", storage=get_storage(storage)).trials:
        study.add_trial(trial)
    assert main(["export", "--storage", storage, "--study", "a", *SMALL]) == 2
    err = capsys.readouterr().err
    assert "holds measurements of 2 environments, none of them this machine's: choose one with --env" in err
    assert "NVIDIA H100" in err and "NVIDIA H200" in err and err.count("\n") == 1
    assert not (tmp_path / "storages").exists()


@pytest.mark.parametrize("command", ["trials", "best", "export", "compare", "report"])
def test_a_problem_flag_the_named_study_contradicts_exits_2(command, tmp_path, capsys):
    """A problem flag typed beside --study must agree with the study's problem (the
    defaults, untyped, need not): the study here is of DK 64 and S 256."""
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    gpu_study([0.5], storage=storage, name="s")
    argv = [command, "--storage", storage, "--study", "s", "--dk", "64", "--seqlen", "512"]
    assert main(argv + ["--against", "s"] * (command == "compare")) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.endswith("--seqlen 512 contradicts it (drop the flag, or name another --study)")
    assert "--dk" not in err


def test_a_ctrl_c_dropped_in_a_weak_reference_s_callback_is_raised_again_in_the_main_thread(
    capsys, ctrl_c_raises
):
    """Where a Ctrl-C lands in a callback (SQLAlchemy's, as ``export`` closes its storage),
    Python prints it and goes on; the CLI's hook raises it again once the callback is done,
    and prints nothing for it."""
    import sys
    import time
    import weakref

    from tuner.cli import _ctrl_c_unraised

    class Owner:
        pass

    def callback(_):
        raise KeyboardInterrupt

    sys.unraisablehook = _ctrl_c_unraised
    try:
        owner = Owner()
        ref = weakref.ref(owner, callback)
        with pytest.raises(KeyboardInterrupt):
            del owner
            for _ in range(100):  # the main thread's work, where the Ctrl-C lands again
                time.sleep(0.01)
    finally:
        sys.unraisablehook = sys.__unraisablehook__
    assert ref() is None and capsys.readouterr().err == ""


def test_version_prints_the_package_s_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"decay-tuner {version('decay-tuner')}\n"


def _sigint_ignored() -> None:
    """A child's SIGINT as ``nohup``, a scheduler or ``cmd &`` in a script leave it: ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    "stop, code, said",
    [
        ("sigterm, sigint ignored", 143, "terminated: finished trials are kept in the study"),
        ("ctrl-c, stdout's reader gone", 130, "interrupted: finished trials are kept in the study"),
    ],
)
def test_a_run_stopped_mid_study_exits_with_its_signal_s_code_and_keeps_its_log(
    stop, code, said, tmp_path, studies_dir
):
    """A SIGTERM stops a run whose SIGINT was ignored from its start (``nohup``); a Ctrl-C
    that also stopped the reader of its output (``run ... | tee log``) loses nothing: each
    exits with its code, in one line, no traceback, its trial log written."""
    import time

    from tuner.storage import get_storage

    storage = f"journal:{tmp_path / 'j.log'}"
    backend = get_storage(storage)
    argv = ["run", *SMALL, "--storage", storage, "--study", "s", "--workers", "1", "--no-progress"]
    ctrl_c = stop.startswith("ctrl-c")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tuner", *argv, "--n-trials", "40"],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=as_at_a_terminal if ctrl_c else _sigint_ignored,
    )
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if any(t.state.is_finished() for t in optuna.load_study(study_name="s", storage=backend).trials):
                break
        except KeyError:  # not created yet
            pass
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    if ctrl_c:
        proc.stdout.close()  # tee died of the same Ctrl-C
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGTERM)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == code, err[-2000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]
    assert err.splitlines()[-1].startswith(said), err[-2000:]
    (log,) = studies_dir.glob("**/s/trials.csv")
    assert len(pd.read_csv(log)) == len(optuna.load_study(study_name="s", storage=backend).trials)
