"""The per-token gate's forward (``kernel.gated``) in the tuner: ``run --gate token --groups
G`` (a problem's ``gate`` and ``groups``, ``kernel.config.Problem``), its code key
(``kernel.environment.GATED_MODULES``), its space, the dispatch table and the op's pick
(``Problem.kind``), ``warmup``, the report, the floor and bad flags, all without a GPU (a
compile-only study compiles real kernels); on a GPU (marked ``gpu``), trials measured
against reference C's per-token form, a table tuned by ``dispatch --gate token`` that the
op serves, and ``bench --gate token``."""

import dataclasses
import json
import math
from pathlib import Path

import optuna
import pytest
import torch
from helpers import SMALL, best_config_file, dispatch_file, gpu_study, tiled_grid

from kernel.arch import DEFAULT_ARCH
from kernel.config import SEED_CONFIG, Call, KernelConfig, Problem, gate_flags, knob_choices, model_call
from kernel.environment import (
    GATED_KERNEL,
    GATED_MODULES,
    KERNEL_MODULES,
    env_key,
    environment,
    gated_environment,
    kernel_key,
)
from kernel.gated import prim_func
from kernel.gated_build import pass_jobs
from kernel.ops import autotune, load_config, serve
from kernel.ops.dispatch import load_dispatch
from kernel.rule import default_config, gated_config
from kernel.variants import prim_funcs, shape_generic
from tuner import space
from tuner.cli import build_parser, main
from tuner.commands.args import problem_of
from tuner.export import export_dispatch
from tuner.fleet import run_argv
from tuner.occupancy import traffic_bytes
from tuner.options import Options
from tuner.trials import measured_before

# SMALL's shape (B = 1, H = 2, S = 256, 64 x 64) with q and k in one group
GATED = Problem(1, 2, 256, 64, 64, gate="token", groups=1)
GATED_FLAGS = [*SMALL, "--gate", "token", "--groups", "1"]
NAME = "b1-h2-s256-dk64-dv64-float16-gated-g1"


def test_a_gated_problem_records_its_gate_and_reads_back():
    assert GATED.to_dict() == Problem(1, 2, 256, 64, 64).to_dict() | {"gate": "token", "groups": 1}
    assert "gate" not in Problem(1, 2, 256, 64, 64).to_dict()  # a constant decay's records as before
    assert Problem.from_dict(GATED.to_dict()) == GATED and GATED.qk_heads == 1
    assert Problem(1, 2, 256, 64, 64, gate="token", groups=2).groups is None  # G = H: no groups
    assert gate_flags(GATED) == ["--gate", "token", "--groups", "1"] and gate_flags(SMALL_HEAD) == []
    with pytest.raises(ValueError, match="gate='token'"):
        Problem(1, 2, 256, 64, 64, groups=1)
    with pytest.raises(ValueError, match="multiple of groups = 3"):
        Problem(1, 4, 256, 64, 64, gate="token", groups=3)


SMALL_HEAD = Problem(1, 2, 256, 64, 64)
KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernel"


def test_the_gated_kernel_has_its_own_key_and_leaves_the_forward_s():
    env = gated_environment(DEFAULT_ARCH)
    assert env[GATED_KERNEL] == kernel_key(modules=GATED_MODULES) != env["kernel"] == kernel_key()
    assert {k: v for k, v in env.items() if k != GATED_KERNEL} == environment(DEFAULT_ARCH)


@pytest.mark.parametrize(
    "name, old, new, forward_changes",
    [
        ("gated.py", "bg = bh // group_size", "bg = bh % group_size", False),
        ("gated_build.py", "return heads // groups", "return heads // groups + 1", False),
        ("scalar_decay.py", "max(threads // 128, 1)", "max(threads // 64, 1)", True),  # staged tiles
    ],
)
def test_an_edit_to_the_gated_kernel_changes_its_key_alone(name, old, new, forward_changes):
    """The forward's key is not computed from the gated kernel's modules; the gated key is,
    and from the constant decay's modules the gated kernel is built of."""
    sources = {m: (KERNEL_DIR / m).read_text() for m in {*KERNEL_MODULES, *GATED_MODULES}}
    assert sources[name].count(old) == 1, f"{old!r} must occur once in {name}"
    edited = sources | {name: sources[name].replace(old, new)}
    assert kernel_key(edited, GATED_MODULES) != kernel_key(modules=GATED_MODULES)
    assert (kernel_key(edited) != kernel_key()) == forward_changes


def test_the_space_is_the_gated_kernel_s_knobs():
    """One pass, scores in shared memory; chunk, block_dv, stages and threads free. The rule's
    config (``kernel.rule.gated_config``) is measured first; the seed's, a constant decay's
    register-score config, is not in the space."""
    built = space.search_space(GATED, arch=DEFAULT_ARCH)
    free = {k: v for k, v in knob_choices(64).items() if k not in ("scores", "segments")}
    assert built.knobs == free | {"scores": ("smem",), "segments": (1,)}
    assert len(built.grid) == len(set(built.grid)) == math.prod(map(len, free.values()))
    assert not built.unusable
    assert all(c.scores == "smem" and c.segments == 1 for c in built.grid)
    rule = default_config(GATED, DEFAULT_ARCH)
    assert rule == gated_config(GATED) == KernelConfig(64, 64, 1, 256, "smem", 1)
    first = space.first_configs(built, space.LatencyModel.load(), Options(), sms=None)
    assert first[0] == rule and SEED_CONFIG not in first and all(c in built.grid for c in first)
    assert space.search_space(GATED, "dkdv").unusable.startswith(
        "the per-token gate's backward has no fused dk and dv kernel"
    )


def test_the_floor_counts_the_gate_s_bytes_and_q_and_k_s_groups():
    plain, (b, h, s, dk) = traffic_bytes(SMALL_HEAD), (1, 2, 256, 64)
    gate, fewer_qk = b * s * h * 4, b * s * (h - 1) * 2 * dk * 2  # fp32 g; one group of q and k, not two
    assert traffic_bytes(GATED) == plain + gate - fewer_qk
    assert traffic_bytes(dataclasses.replace(GATED, groups=None)) == plain + gate


def test_compile_only_run_gate_token_end_to_end(studies_dir, capsys):
    """Two trials compile real kernels for sm_90a, rank by the latency model (which says that
    it was fitted to no per-token gate), export the problem with its gate, and the read
    commands and the report take the study."""
    assert main(["run", *GATED_FLAGS, "--n-trials", "2", "--workers", "2", "--no-progress"]) == 0, (
        capsys.readouterr().err
    )
    best = json.loads((studies_dir / NAME / "best.json").read_text())
    assert best["mode"] == "compile-only" and Problem.from_dict(best["problem"]) == GATED
    study = optuna.load_study(study_name=NAME, storage=f"sqlite:///{studies_dir / 'decay-tuner.db'}")
    compiled = [t for t in study.trials if t.user_attrs.get("status") == "ok"]
    assert len(compiled) == 2 and all(t.user_attrs["registers"] > 0 for t in compiled)
    here = gated_environment(DEFAULT_ARCH)  # the gated kernel's code key in each trial's environment
    assert all(t.user_attrs["environment"] == here for t in study.trials)
    assert {t.user_attrs["env_key"] for t in study.trials} == {env_key(here)}
    edited = env_key(here | {GATED_KERNEL: "0" * 12})  # a changed gated kernel reuses no trial
    assert measured_before(study, compiled[0].params, edited) is None
    assert measured_before(study, compiled[0].params, env_key(here)) is not None
    assert compiled[0].params == gated_config(GATED).to_dict()  # the rule's first
    assert all(t.params["scores"] == "smem" and t.params["segments"] == 1 for t in study.trials)
    capsys.readouterr()
    assert main(["trials", *GATED_FLAGS]) == 0
    assert "the per-token gate's forward, compile-only" in " ".join(capsys.readouterr().out.split())
    assert main(["report", *GATED_FLAGS]) == 0
    page = (studies_dir / NAME / "report.html").read_text()
    assert "per-token g, -0.0001 to -20, G = 1" in page
    assert "Numerics of the per-token gate" in page and "factorised form" not in page


@pytest.mark.parametrize(
    "argv, said",
    [
        (["run", "--groups", "2"], "--groups needs --gate token"),
        (["run", "--gate", "token", "--groups", "3"], "--groups 3 must divide the heads, 16"),
        (["run", "--gate", "token", "--groups", "0"], "--groups 0 must divide the heads"),
        (["run", "--gate", "other"], "invalid choice: 'other'"),
        (["run", "--gate", "token", "--sweep", "decode"], "--gate token is not tuned there"),
        (["run", "--gate", "token", "--sweep", "dkdv"], "no fused dk and dv kernel"),
        (["dispatch", "--gate", "token", "--backward"], "no table entry to tune: drop --backward"),
        (["dispatch", "--gate", "token", "--groups", "3", "--shapes", "1x6x64,1x4x64"], "must divide"),
        (["bench", "--gate", "token", "--groups", "5"], "--groups 5 must divide the heads, 16"),
        (["probe", "--groups", "4"], "--groups needs --gate token"),
    ],
)
def test_bad_gate_flags_are_one_line_and_exit_2(argv, said, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and said in err and len(err.strip().splitlines()) == 1, err


def test_a_worker_and_a_tuning_child_are_handed_the_gate():
    """``--gpus``'s workers (``tuner.fleet.run_argv``) and tuning on first use's child
    (``kernel.ops.autotune.child_command``) get the gate's flags beside the shape."""
    args = build_parser().parse_args(list(run_argv(GATED, Options(), "s", "journal:j.log")))
    assert problem_of(args) == GATED
    cmd, _ = autotune.child_command(GATED, serve.Path("t.json"), serve.Path("studies"))
    assert cmd[cmd.index("--gate") :][:4] == ["--gate", "token", "--groups", "1"]


def test_a_table_serves_gated_entries_to_gated_calls_alone(tmp_path):
    """An entry of a per-token gate serves gated problems of its DK, DV and dtype
    (``Problem.kind``), never a constant decay's, and runs one segment at every shape; the
    op's pick (``kernel.ops.serve.kernel_job``) is the table's, else the rule's; packed, it
    keeps the gate. A gated entry whose config is outside its knobs is malformed."""
    plain, gated = KernelConfig(64, 64, 2, 256, segments=2), KernelConfig(64, 32, 2, 256)
    path = dispatch_file(tmp_path, [(SMALL_HEAD, plain), (GATED, gated)])
    table = load_dispatch(path)
    assert table.pick(SMALL_HEAD).config == plain and table.pick(GATED).config == gated
    long = dataclasses.replace(GATED, batch=64, heads=8, seqlen=65536)
    assert table.pick(long).config == gated  # far from the tuned shape: still one segment
    with pytest.raises(ValueError, match="gate token; the table was tuned for"):
        table.pick(dataclasses.replace(GATED, dk=128))
    call = model_call(GATED)
    try:
        serve.use_table(table)
        assert serve.kernel_job(GATED, call, 1, arch=DEFAULT_ARCH, sms=132)[1] == gated
        packed = dataclasses.replace(GATED, seqlen=4096)
        job = serve.kernel_job(packed, dataclasses.replace(call, packed=True), 16, arch=DEFAULT_ARCH, sms=132)
        assert job[0] == dataclasses.replace(packed, seqlen=1) and job[0].gate == "token" and job[1] == gated
        serve.use_table(None)
        assert serve.kernel_job(GATED, call, 1, arch=DEFAULT_ARCH, sms=132)[1] == gated_config(GATED)
    finally:
        serve.use_table(serve.DEFAULT)
    data = json.loads(path.read_text())
    data["entries"][1][GATED_KERNEL] = "stale"  # measured with other gated kernels: refused, as decode's
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="its gated entries were measured with the gated kernels 'stale'"):
        load_dispatch(path)
    assert load_dispatch(path, allow_mismatch=True).pick(GATED).kernel == "stale"
    del data["entries"][1][GATED_KERNEL]  # written before gated entries had one: not trusted either
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="gated kernels None"):
        load_dispatch(path)
    data["entries"][1]["config"] = KernelConfig(64, 32, 2, 128, "regs").to_dict()  # no gated kernel has it
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"entries\[1\].*outside the kernels' knobs"):
        load_dispatch(path)


def test_a_gated_study_s_entry_carries_the_gated_key_into_the_table(tmp_path):
    """``export_dispatch`` ranks a gated study's trials of ``gated_env``, writes the gated
    kernel's code key beside its entry and the forward's environment as the table's, which
    ``load_dispatch`` serves; a trial measured with other gated kernels is not exported."""
    plain, gated = environment(), gated_environment()
    studies = [gpu_study([0.5], env=plain), gpu_study([0.4], env=gated, problem=GATED)]
    out = tmp_path / "t.json"
    data = export_dispatch(studies, out, env=env_key(plain), gated_env=env_key(gated))
    assert data["environment"] == plain and GATED_KERNEL not in data["entries"][0]
    assert data["entries"][1][GATED_KERNEL] == kernel_key(modules=GATED_MODULES)
    table = load_dispatch(out)
    assert table.pick(GATED).kernel == kernel_key(modules=GATED_MODULES)
    assert table.pick(GATED).config == tiled_grid(GATED)[0]  # the gated study's one trial
    other = env_key(gated | {GATED_KERNEL: "0" * 12})
    with pytest.raises(LookupError, match="no feasible, correct trial in environment"):
        export_dispatch(studies, out, env=env_key(plain), gated_env=other)


def test_a_gated_best_config_file_of_other_gated_kernels_is_refused(tmp_path):
    """``load_config`` trusts a gated file by the gated kernel's key, as the table does."""
    gated = gated_environment()
    config = {"config": gated_config(GATED).to_dict()}
    fields = {"problem": GATED.to_dict(), "sweep": "forward", "mode": "gpu", "configs": [config]}
    tuned = (GATED, gated_config(GATED))
    assert load_config(best_config_file(tmp_path, environment=gated, **fields)) == tuned
    stale = best_config_file(tmp_path, environment=gated | {GATED_KERNEL: "stale"}, **fields)
    with pytest.raises(ValueError, match="measured with the gated kernels 'stale'"):
        load_config(stale)
    assert load_config(stale, allow_mismatch=True)[0] == GATED


def test_warmup_compiles_what_a_gated_call_compiles():
    """``warmup --gate token``'s jobs (``kernel.ops.serve.warmup_jobs``) are the gated
    forward's at the rule's config, dense and packed, with the final state or not, one per
    compiled kernel; the probe compiles the very prim func a gated call compiles
    (``kernel.gated_build.compile_gated``), so that the call finds it in TileLang's cache."""
    serve.use_table(None)
    try:
        gate = {"gate": "token", "groups": 2}
        jobs = serve.warmup_jobs(4, 64, 64, "float16", backward=False, arch=DEFAULT_ARCH, **gate)
        both = serve.warmup_jobs(4, 64, 64, "float16", backward=True, arch=DEFAULT_ARCH, **gate)
    finally:
        serve.use_table(serve.DEFAULT)
    assert {(p.gate, p.groups) for p, _, _ in jobs} == {("token", 2)}
    assert {c for _, c, _ in jobs} == {gated_config(jobs[0][0])}
    assert {(c.packed, c.final_state) for _, _, c in jobs} == {(a, b) for a in (0, 1) for b in (0, 1)}
    assert len(jobs) == 4  # one shape class: the gated kernel counts each chunk's tokens
    # --backward adds its passes' kernels (kernel.gated_build.pass_jobs), what a backward opens
    forward = [Call(64**-0.5, False, final, packed) for packed in (False, True) for final in (False, True)]
    problem = Problem(1, 4, 64, 64, 64, "float16", "token", 2)
    passes = [job for call in forward for job in pass_jobs(problem, call)]
    kept = {(shape_generic(p, c, DEFAULT_ARCH), c, call) for p, c, call in [*jobs, *passes]}
    assert {(shape_generic(p, c, DEFAULT_ARCH), c, call) for p, c, call in both} == kept
    assert len(both) == len(kept) and any(call.reverse for _, _, call in both)
    problem, config, call = jobs[0]
    (warmed,) = prim_funcs(problem, config, call, arch=DEFAULT_ARCH)
    served = prim_func(shape_generic(problem, config, DEFAULT_ARCH), config, call, arch=DEFAULT_ARCH)
    assert warmed.script() == served.script()
    with pytest.raises(ValueError, match="no fused dk and dv pass"):
        prim_funcs(problem, config, Call(1.0, reverse=True, dkdv=True), arch=DEFAULT_ARCH)


# ---- on the GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_run_gate_token_measures_against_reference_c(studies_dir, capsys):
    """A GPU study of the per-token gate: every trial checked against reference C's
    per-token form under the tolerance, then timed."""
    assert main(["run", *GATED_FLAGS, "--n-trials", "3", "--no-progress"]) == 0, capsys.readouterr().err
    study = optuna.load_study(study_name=NAME, storage=f"sqlite:///{studies_dir / 'decay-tuner.db'}")
    ok = [t for t in study.trials if t.user_attrs.get("status") == "ok"]
    assert ok and all(t.user_attrs["rel_l2"] < 2e-2 and t.user_attrs["median_ms"] > 0 for t in ok)
    assert json.loads((studies_dir / NAME / "best.json").read_text())["mode"] == "gpu"


@pytest.mark.gpu
def test_gpu_dispatch_gate_token_serves_decay_attention(tmp_path, capsys):
    """``dispatch --gate token`` writes a table of gated entries; ``decay_attention(g=)``
    served from it runs the tuned config, as close to reference C as the rule's."""
    import refs
    from kernel.ops.attention import decay_attention
    from kernel.validate import gated_inputs

    out = tmp_path / "t.json"
    argv = ["dispatch", "--shapes", "1x2x256", "--dk", "64", "--dv", "64", "--gate", "token", "--groups", "1"]
    assert main([*argv, "--n-trials", "2", "--no-progress", "--out", str(out)]) == 0, capsys.readouterr().err
    table = load_dispatch(out)
    assert [e.problem for e in table.entries] == [GATED]
    q, k, v, g = gated_inputs(GATED, seed=3)
    want = refs.gated_kernel_mimic(q, k, v, g, 64, scale=64**-0.5)
    try:
        serve.use_table(table)
        with torch.no_grad():
            o, _ = decay_attention(q, k, v, g=g)
        assert refs.rel_l2(o, want) < 2e-2
    finally:
        serve.use_table(serve.DEFAULT)


@pytest.mark.gpu
def test_gpu_bench_gate_token_times_ours_and_fla_over_the_gated_floor(tmp_path, capsys):
    argv = ["bench", "--shapes", "1x2x256", "--dk", "64", "--dv", "64", "--gate", "token", "--groups", "1"]
    assert main([*argv, "--out", str(tmp_path)]) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "bench.jsonl").read_text().splitlines()]
    ours = [r for r in rows if r["impl"] in ("candidate", "out of the box")]
    assert ours and all(r["rel_l2"] < 2e-2 and r["decay"] == "per-token g, G=1" for r in ours)
