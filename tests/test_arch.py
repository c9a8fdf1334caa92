"""kernel.arch and --arch: the kernel compiles for every architecture of the table (real
TileLang and nvcc, no GPU), each config either compiles or fails as a recorded value,
configs that cannot exist on a target are restricted before they are compiled, and the
tool names the architecture everywhere and refuses a table tuned for another."""

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import SMALL, SMALL_PROBLEM, dispatch_file

from kernel import KernelConfig, ProbeFailure, Problem, Resources
from kernel.arch import ARCHS, DEFAULT_ARCH, arch_of_capability, get_arch, resolve, target
from kernel.config import HEADLINE, SEED_CONFIG, Call, model_call
from kernel.environment import env_key, environment
from kernel.ops.deploy import ExportError
from kernel.ops.dispatch import load_dispatch
from kernel.probe import probe
from tuner import space
from tuner.cli import main
from tuner.latency import latency_model
from tuner.options import Options
from tuner.tuner import Tuner

# A representative subset, small enough for CI: the sync step (32-token chunks), the
# transposed step (64 rows of S^T per consumer warpgroup on Hopper) and the async step
# with scores in registers (a layout TileLang may refuse: a failure is a value too).
SUBSET = [
    KernelConfig(32, 32, 1, 128, "smem"),
    KernelConfig(64, 64, 2, 128, "smem"),
    KernelConfig(64, 32, 1, 128, "regs"),
]


# sm_86 and sm_89 lower as sm_80 does (mma.sync, no TMA), with less shared memory: the sync
# step alone there, the whole subset on each other code path (sm_80, Hopper, sm_100a, and
# sm_120's TMA without setmaxnreg).
AS_SM80 = ("sm_86", "sm_89")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_architecture_compiles_the_kernel_or_records_why_not(arch, monkeypatch):
    configs = SUBSET[:1] if arch in AS_SM80 else SUBSET
    results = {c.label: probe(SMALL_PROBLEM, c, arch=arch, call=model_call(SMALL_PROBLEM)) for c in configs}
    compiled = {label: r for label, r in results.items() if isinstance(r, Resources)}
    failed = {label: r for label, r in results.items() if isinstance(r, ProbeFailure)}
    assert len(compiled) + len(failed) == len(configs)
    assert SUBSET[0].label in compiled, results  # at least one config, the sync step, on every arch
    for res in compiled.values():
        assert res.arch == arch and res.smem_limit == ARCHS[arch].smem_per_block
    for config in configs:  # the floor that restricts configs before compiling is a floor
        res = results[config.label]
        if isinstance(res, Resources):
            assert config.smem_floor(SMALL_PROBLEM) <= res.smem_bytes
    for res in failed.values():
        assert res.stage in ("lower", "nvcc") and res.error_type and res.message
        assert "requires Hopper WGMMA" not in res.message  # the portable layer: no wgmma off Hopper
    # TileLang adds a producer warp group where it warp-specialises (kernel.arch)
    assert compiled[SUBSET[0].label].threads_launched == (256 if ARCHS[arch].setmaxnreg else 128)

    # Probed again, a compiled config's resources are those kept beside TileLang's cache: no
    # lowering and no ptxas run (sm_80's were keyed by the TIR its compile had renamed).
    def refused(*args, **kwargs):
        raise AssertionError("the resources were made again, not read")

    monkeypatch.setattr("kernel.probe.lower", refused)
    monkeypatch.setattr("kernel.probe._ptxas", refused)
    for config in configs:
        if config.label in compiled:
            again = probe(SMALL_PROBLEM, config, arch=arch, call=model_call(SMALL_PROBLEM))
            assert dataclasses.replace(again, compile_seconds=0) == dataclasses.replace(
                compiled[config.label], compile_seconds=0
            )


def test_the_ampere_source_issues_mma_not_wgmma():
    """The async step's kernels (the subset's, which the test above compiles too)."""
    from kernel.probe import compile_kernel

    config, call = SUBSET[1], model_call(SMALL_PROBLEM)
    (hopper,) = compile_kernel(SMALL_PROBLEM, config, "sm_90a", call)
    (ampere,) = compile_kernel(SMALL_PROBLEM, config, "sm_80", call)
    assert "wgmma" in hopper.get_kernel_source() and "wait_wgmma" in hopper.get_kernel_source()
    source = ampere.get_kernel_source()
    assert "wgmma" not in source and "mma" in source and "cp_async" in source and "tma" not in source


def test_a_config_over_an_architectures_shared_memory_is_restricted_before_compiling():
    config = KernelConfig(128, 128, 1, 256, "smem")  # 192 KB of tiles at the least
    floor = config.smem_floor(HEADLINE)
    assert (
        ARCHS["sm_86"].smem_per_block < ARCHS["sm_80"].smem_per_block < floor < ARCHS["sm_90a"].smem_per_block
    )
    for arch in ("sm_80", "sm_86", "sm_89", "sm_120"):
        (reason,) = space.violated(HEADLINE, config, arch)
        assert (
            reason
            == f"shared memory: at least {floor} B, over {arch}'s {ARCHS[arch].smem_per_block} B per block"
        )
    assert space.violated(HEADLINE, config, "sm_90a") == space.violated(HEADLINE, config, "sm_100a") == []
    assert all(
        not space.violated(HEADLINE, c, "sm_86")
        for c in space.wave_seeds(space.search_space(HEADLINE, arch="sm_86"))
    )


def test_a_compile_only_study_seeds_one_wave_of_its_architectures_reference_gpu(tmp_path):
    """2x15 (batch, head) pairs at DV = 128: 30 blocks per segment. On the A100's 108 SMs 2
    segments (60 blocks) come nearest one wave without passing it (4 would be 120), on the
    H100's 132 SMs 4 (120 blocks); the seeds are that count and its neighbours, at 2 and 3
    stages; then, on sm_90a alone (the latency model's architecture), the configs the model
    predicts fastest."""
    problem = Problem(2, 15, 8192, 128, 128)
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    segments = {}
    for arch in ("sm_80", "sm_90a"):
        study = Tuner(problem, Options(arch=arch), name=arch, storage=storage).study
        queued = [KernelConfig.from_dict(t.system_attrs["fixed_params"]) for t in study.trials]
        predicted = space.predicted_first(space.search_space(problem, arch=arch), latency_model())
        assert (predicted == []) == (arch == "sm_80")
        assert queued == list(
            dict.fromkeys(
                [SEED_CONFIG, *space.wave_seeds(space.search_space(problem, arch=arch)), *predicted]
            )
        )
        assert all(not space.violated(problem, c, arch) for c in queued)
        seeds = queued[1 : 1 + len(space.wave_seeds(space.search_space(problem, arch=arch)))]
        assert {(c.chunk, c.block_dv, c.threads, c.scores) for c in seeds} == {(64, 128, 256, "smem")}
        assert sorted(c.num_stages for c in seeds) == [2, 2, 2, 3, 3, 3]
        segments[arch] = sorted({c.segments for c in seeds})
    assert segments == {"sm_80": [1, 2, 4], "sm_90a": [2, 4, 8]}
    # the same configs for the same SM count; the rule's depth leads (2 stages on sm_80,
    # where 3 are over its shared memory, 3 on sm_90a)
    ampere = space.wave_seeds(space.search_space(problem, arch="sm_80"))
    hopper = space.wave_seeds(space.search_space(problem, arch="sm_90a"), sms=108)
    assert set(ampere) == set(hopper) and (ampere[0].num_stages, hopper[0].num_stages) == (2, 3)


def test_the_architecture_table():
    assert [a.name for a in ARCHS.values()] == ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_120"]
    assert {a.name: a.smem_per_block for a in ARCHS.values()} == {
        "sm_80": 166_912,
        "sm_86": 101_376,
        "sm_89": 101_376,
        "sm_90a": 232_448,
        "sm_100a": 232_448,
        "sm_120": 101_376,
    }
    assert {a.name: a.sms for a in ARCHS.values()} == {
        "sm_80": 108,  # A100
        "sm_86": 72,  # A10
        "sm_89": 58,  # L4
        "sm_90a": 132,  # H100 SXM5, H200
        "sm_100a": 148,  # B200
        "sm_120": 170,  # RTX 5090
    }
    assert [a.name for a in ARCHS.values() if a.wgmma] == ["sm_90a"] and DEFAULT_ARCH == "sm_90a"
    assert arch_of_capability(9, 0).name == "sm_90a" and arch_of_capability(10, 0).name == "sm_100a"
    with pytest.raises(ValueError, match=r"compute capability 7.5\) is not a target"):
        arch_of_capability(7, 5)
    with pytest.raises(ValueError, match="unknown architecture 'sm_70'"):
        get_arch("sm_70")
    # the Ampere path on an H200: lowered for sm_80, assembled for the H200
    assert target("sm_80", run_on="sm_90a") == {"kind": "cuda", "arch": "sm_80", "code": ["sm_90"]}
    assert target("sm_90a", run_on="sm_90a") == target("sm_90a") == {"kind": "cuda", "arch": "sm_90a"}


def test_the_environment_names_the_architecture():
    assert environment("sm_80")["arch"] == "sm_80" and environment()["arch"] == resolve(None)[0]
    assert env_key(environment("sm_80")) != env_key(environment("sm_90a"))
    assert resolve("sm_80")[0] == "sm_80"


def test_a_table_tuned_for_another_architecture_is_refused_in_one_line(tmp_path):
    there = "sm_80" if environment()["arch"] != "sm_80" else "sm_86"
    path = dispatch_file(
        tmp_path, [(SMALL_PROBLEM, KernelConfig())], environment=environment() | {"arch": there}
    )
    with pytest.raises(ExportError) as info:
        load_dispatch(path)
    assert str(info.value) == (
        f"{path} was tuned for {there}, this machine is {environment()['arch']}: "
        "tune here (python -m tuner run, or dispatch)"
    )
    assert load_dispatch(path, allow_mismatch=True).entries


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--arch", "sm_70"],
        ["run", "--arch", "banana"],
        ["dispatch", "--arch", "sm_75"],
        ["probe", "--arch", "sm_80,banana"],
        ["probe", "--arch", ""],
        ["probe", "--arch", "sm_80", "--config", "64/48/2/128"],
    ],
)
def test_an_unknown_architecture_is_one_line_and_exit_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_probe_prints_one_config_across_architectures(capsys):
    argv = ["probe", *SMALL, "--config", "128/64/1/256/smem", "--arch", "sm_86,sm_90a"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    heading, lines = " ".join(out.partition("\narch ")[0].split()), out.splitlines()
    assert heading.startswith("128/64/1/256/smem/1 for Problem(") and heading.endswith("compile-only")
    i86, i90 = (
        next(i for i, line in enumerate(lines) if line.startswith(f"{a} ")) for a in ("sm_86", "sm_90a")
    )
    sm86, sm90 = lines[i86].split(), lines[i90].split()
    # each row's numbers, then on a line of its own, indented, why it has none or its prediction
    assert sm86[:2] == ["sm_86", "restricted"] and "over sm_86's 101376 B per block" in lines[i86 + 1]
    assert sm90[0] == "sm_90a" and sm90[5] == "232448" and lines[i90 + 1].startswith("    predicted ")


def test_run_for_sm80_on_a_cpu_is_compile_only_and_a_second_architecture_measures_the_seeds_for_itself(
    tmp_path, capsys, monkeypatch
):
    """``python -m tuner run --arch sm_80 --n-trials 5`` on a machine without an A100 finds a
    feasible config, labelled compile-only. The seed config (and wave seeds) are queued per
    environment: a worker for sm_89 joining the study sm_80 explored compiles the seed
    config for sm_89 too (one test: the sm_80 study is compiled once for both)."""
    import optuna

    from tuner.storage import get_storage

    monkeypatch.setattr("tuner.cli.STUDIES_DIR", tmp_path)  # its exports, out of the repository
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    argv = ["run", *SMALL, "--arch", "sm_80", "--n-trials", "5", "--storage", storage, "--study", "a100"]
    assert main([*argv, "--workers", "2", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "compile-only exploration for sm_80" in err
    assert "(compile-only for sm_80:" in out and "no latency" in out
    best = " ".join(out.partition("\nbest ")[2].partition("\nexported ")[0].split())  # its lines, joined
    exported = json.loads(Path(out.rpartition("\nexported ")[2].strip()).read_text())
    assert exported["mode"] == "compile-only" and exported["environment"]["arch"] == "sm_80"
    # no model is calibrated for sm_80: the analytic part alone ranks, and says so
    assert "predicted" in best and "(analytic part alone: uncalibrated for sm_80)" in best
    assert exported["configs"][0]["predicted_ms"] is None and exported["configs"][0]["predicted_x_floor"] >= 1
    assert main(["trials", *SMALL, "--storage", storage, "--study", "a100"]) == 0
    assert capsys.readouterr().out.startswith("study 'a100' (compile-only for sm_80:")
    assert Problem.from_dict(exported["problem"]) == SMALL_PROBLEM

    # sm_89 joins: its first trial is the seed config, compiled for sm_89
    argv = ["run", *SMALL, "--arch", "sm_89", "--n-trials", "2", "--storage", storage, "--study", "a100"]
    assert main([*argv, "--workers", "1", "--no-progress"]) == 0  # a feasible config among its two
    trials = optuna.load_study(study_name="a100", storage=get_storage(storage)).trials
    seeds = [t for t in trials if t.params == SEED_CONFIG.to_dict() and "env_key" in t.user_attrs]
    assert {t.user_attrs["env_key"] for t in seeds} == {env_key(environment(a)) for a in ("sm_80", "sm_89")}
    capsys.readouterr()
    shown = []
    for arch in ("sm_80", "sm_89"):  # each architecture's own, and named so, whichever ran last
        key = env_key(environment(arch))
        if main(["best", "--storage", storage, "--study", "a100", *SMALL, "--env", key]) == 0:
            heading = " ".join(capsys.readouterr().out.split("\n\n")[0].split())  # wrapped at 120 columns
            assert f"(compile-only for {arch}:" in heading and f"no GPU: compile-only for {arch}," in heading
            shown.append(arch)
    assert shown == ["sm_80", "sm_89"], shown  # the first run's, which the second's --arch once relabelled


def test_packed_sequences_take_one_stage_where_tilelang_does_not_warp_specialise():
    """A loop of a sequence-dependent length is software-pipelined only when warp-specialised:
    sm_80 keeps one stage (and compiles), sm_90a keeps the config's stages."""
    from kernel.variants import packed_config, prim_funcs

    call = Call(scale=0.125, initial_state=True, final_state=True, packed=True)
    problem, config = Problem(1, 8, 1, 128, 128), KernelConfig(64, 128, 2, 256, segments=4)
    assert packed_config(config, "sm_90a") == KernelConfig(64, 128, 2, 256)
    assert packed_config(config, "sm_80") == KernelConfig(64, 128, 1, 256)
    with pytest.raises(ValueError, match="one stage where TileLang does not warp-specialise"):
        prim_funcs(problem, KernelConfig(64, 128, 2, 256), call, arch="sm_80")
    assert isinstance(probe(problem, packed_config(config, "sm_80"), arch="sm_80", call=call), Resources)
