"""The decode step in the tuner (``tuner.decode_tuner``, ``run --sweep decode``), in the
dispatch table (``Dispatch.decode_config``, ``kernel.ops.decode.config_for``), in
``warmup`` (``kernel.ops.decode.warmup_jobs``) and in the report, all without a GPU: a
compile-only study end to end, a table's pick by number of sequences, warmup's jobs, and a
report of a hand-built decode study."""

import json

import optuna
import pytest

from kernel.arch import DEFAULT_ARCH, get_arch
from kernel.decode import DecodeCase, DecodeConfig, DecodeProblem, decode_config
from kernel.environment import DECODE_KERNEL, DECODE_MODULES, decode_environment, environment, kernel_key
from kernel.ops import decode as ops_decode
from kernel.ops.dispatch import DecodeEntry, Dispatch, load_dispatch
from kernel.ops.serve import use_table
from kernel.trial_schema import TRIAL_COLUMNS
from reports import StudyInfo, render_report
from tuner.cli import main
from tuner.trials import best_trials, trials_frame

SMS = get_arch(DEFAULT_ARCH).sms
PROBLEM = DecodeProblem(16, 64, 64, "float16", "float32", "int32", 64**-0.5)


def test_the_decode_kernel_has_its_own_key_and_leaves_the_forward_s():
    env = decode_environment(DEFAULT_ARCH)
    assert env[DECODE_KERNEL] == kernel_key(modules=DECODE_MODULES) != env["kernel"] == kernel_key()
    assert {k: v for k, v in env.items() if k != DECODE_KERNEL} == environment(DEFAULT_ARCH)


def test_compile_only_run_sweep_decode_end_to_end(studies_dir, capsys):
    code = main(["run", "--sweep", "decode", "--n-trials", "3", "--dk", "64", "--dv", "64", "--no-progress"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "no latency model is fitted to it" in " ".join(err.split())  # wrapped at 120 columns
    name = "n8-h16-dk64-dv64-float16-pool-float32-decode"
    best = json.loads((studies_dir / name / "best.json").read_text())
    assert best["sweep"] == "decode" and best["mode"] == "compile-only"
    assert best["problem"] == DecodeCase(8, PROBLEM).to_dict()
    configs = [DecodeConfig.from_dict(c["config"]) for c in best["configs"]]
    assert all(c.fits_error(PROBLEM) is None for c in configs)
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{studies_dir / 'decay-tuner.db'}")
    rule = decode_config(PROBLEM, 8 * 16, SMS)
    assert study.trials[0].params == rule.to_dict() and study.trials[0].user_attrs["baseline"]
    assert len({tuple(t.params.items()) for t in study.trials}) >= 3  # three configs new to the study
    ranked = best_trials(study)
    assert [t.values[0] for t in ranked] == sorted(t.values[0] for t in ranked)
    assert all(
        t.user_attrs["environment"][DECODE_KERNEL] == kernel_key(modules=DECODE_MODULES) for t in ranked
    )
    assert main(["trials", "--study", name]) == 0
    assert f"{rule.label}" in capsys.readouterr().out
    assert main(["report", "--study", name]) == 0
    page = (studies_dir / name / "report.html").read_text()
    assert "decode N=8 H=16 DK=64 DV=64" in page and "No config was timed" in page


def test_a_report_of_a_hand_built_decode_study_shows_its_floor_and_knobs():
    study = optuna.create_study()
    study.set_user_attr("problem", DecodeCase(64, PROBLEM).to_dict())
    study.set_user_attr("sweep", "decode")
    study.set_user_attr("mode", "gpu")
    dist = {"block_dv": optuna.distributions.CategoricalDistribution((8, 16, 32, 64)),
            "threads": optuna.distributions.CategoricalDistribution((32, 64, 128, 256))}  # fmt: skip
    for i, (config, ms) in enumerate(((DecodeConfig(16, 64), 0.0123), (DecodeConfig(64, 256), 0.0187))):
        attrs = {"status": "ok", "mode": "gpu", "median_ms": ms, "rel_l2": 1e-4, "floor_ms": 0.0100,
                 "x_floor": ms / 0.0100, "copy_bytes_per_s": 2.1e12, "registers": 40, "spill_bytes": 0,
                 "smem_bytes": 256, "baseline": i == 0}  # fmt: skip
        study.add_trial(
            optuna.trial.create_trial(
                params=config.to_dict(), distributions=dist, value=ms, user_attrs=attrs,
                system_attrs={"constraints": (0.0, 0.0, 0.0, -0.01)},
            )
        )  # fmt: skip
    frame = trials_frame(study)
    assert list(frame.columns) == list(TRIAL_COLUMNS)
    assert frame.chunk.isna().all() and frame.x_floor.tolist() == pytest.approx([1.23, 1.87])
    page = render_report(frame, StudyInfo.from_attrs("decode", study.user_attrs))
    assert "decode N=64 H=16 DK=64 DV=64 float16, float32 pool" in page
    assert "Best config 16/64: 0.0123 ms, the copy 0.0100 ms (2,100 GB/s): 1.23x the floor." in page


def _entry(batch: int, config: DecodeConfig, pool: str = "float32") -> DecodeEntry:
    problem = DecodeProblem(16, 64, 64, "float16", pool, "int32", 64**-0.5)
    return DecodeEntry(DecodeCase(batch, problem), config, 0.01, kernel_key(modules=DECODE_MODULES))


def test_a_table_serves_the_decode_config_of_the_nearest_number_of_sequences(tmp_path):
    entries = [_entry(1, DecodeConfig(8, 64)), _entry(64, DecodeConfig(32, 128)),
               _entry(256, DecodeConfig(64, 256)), _entry(8, DecodeConfig(16, 32), "bfloat16")]  # fmt: skip
    table = Dispatch([], environment(DEFAULT_ARCH), decode=entries)
    picks = {n: table.decode_config(PROBLEM, n) for n in (1, 2, 7, 9, 64, 100, 200, 4096)}
    assert {n: c.label for n, c in picks.items()} == {
        1: "8/64", 2: "8/64", 7: "8/64", 9: "32/128", 64: "32/128", 100: "32/128", 200: "64/256",
        4096: "64/256",
    }  # fmt: skip
    bf16 = DecodeProblem(16, 64, 64, "float16", "bfloat16", "int64", 0.5)  # the slot dtype and scale: any
    assert table.decode_config(bf16, 300).label == "16/32"
    assert table.decode_config(DecodeProblem(8, 64, 64), 1) is None  # no entry of 8 heads
    # written and read back, beside a file's environment; served by the op's config_for
    data = {"format": "decay-tuner/dispatch", "version": 2, "environment": environment(DEFAULT_ARCH),
            "entries": [{"problem": e.case.to_dict(), "config": e.config.to_dict(), "sweep": "decode",
                         "median_ms": 0.01, DECODE_KERNEL: e.kernel} for e in table.decode]}  # fmt: skip
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    read = load_dispatch(path, allow_mismatch=True)
    assert read.decode == table.decode and read.entries == []
    try:
        use_table(read)
        assert ops_decode.config_for(PROBLEM, 100, sms=SMS).label == "32/128"
        assert ops_decode.config_for(DecodeProblem(8, 64, 64), 100, sms=SMS) == decode_config(
            DecodeProblem(8, 64, 64), 800, SMS
        )  # the rule where the table holds none
    finally:
        use_table(None)
    data["entries"][0][DECODE_KERNEL] = "stale"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="decode kernels 'stale'"):
        load_dispatch(path)
    data["entries"][0]["config"] = {"block_dv": 128, "threads": 32}  # 128 does not divide DV = 64
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="malformed entry"):
        load_dispatch(path, allow_mismatch=True)


def test_warmup_compiles_the_rule_s_decode_kernels_for_both_pools():
    use_table(None)
    try:
        jobs = ops_decode.warmup_jobs(16, 64, 64, "float16", arch=DEFAULT_ARCH)
    finally:
        use_table("default")
    assert len(jobs) == len(set(jobs))
    for pool in ("float32", "bfloat16"):
        for slot in ("int32", "int64"):
            problem = DecodeProblem(16, 64, 64, "float16", pool, slot, 64**-0.5)
            wanted = {decode_config(problem, n * 16, SMS) for n in range(1, ops_decode.WARMUP_MAX_BATCH + 1)}
            assert {c for p, c in jobs if p == problem} == wanted
