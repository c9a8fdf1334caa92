"""What several tuner test files share: a problem small enough to compile in seconds, a
compile-only run of it through the CLI, and hand-written best-config and dispatch files."""

import os
import signal
from pathlib import Path

import optuna

from kernel import KernelConfig, Problem
from kernel.arch import DEFAULT_ARCH
from kernel.constraints import tiling_error
from kernel.environment import GATED_KERNEL, GATED_MODULES, environment, kernel_key
from kernel.files import write_json
from kernel.ops.deploy import FORMAT, VERSION
from kernel.ops.dispatch import DISPATCH_FORMAT, DISPATCH_VERSION
from tuner import space
from tuner.cli import main

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
# Small enough that one config compiles in a few seconds on one core.
SMALL = ["--dk", "64", "--dv", "64", "--batch", "1", "--heads", "2", "--seqlen", "256"]
SMALL_PROBLEM = Problem(1, 2, 256, 64, 64)


def tiled_grid(problem: Problem) -> list[KernelConfig]:
    """``problem``'s grid (tuner.space.grid) where sm_90a's MMA tiles it, as a study there keeps it."""
    return [c for c in space.search_space(problem).grid if not tiling_error(DEFAULT_ARCH, problem, c)]


GRID = tiled_grid(SMALL_PROBLEM)
LAYOUT_FAILURE = "32/32/2/128/regs"  # TileLang 0.1.15 cannot lay out register scores at C = 32


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child Python, with the checkout first on its
    ``PYTHONPATH`` and what was there kept (the GPU machine's packages live on it), plus
    ``extra``."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return os.environ | {"PYTHONPATH": path} | extra


def as_at_a_terminal() -> None:
    """A child's SIGINT as a terminal's foreground job has it (a ``preexec_fn``): a shell
    that starts the tests as a background job ignores SIGINT in them and, through them, in
    every process they start, where Ctrl-C would reach none."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def selected(request, *names: str) -> list[tuple]:
    """The values of the parameters ``names`` in each selected test of the requesting
    module that uses the requesting fixture and takes them, in order, once each: what a
    fixture that compiles ahead must compile, and no more where ``-k`` or node IDs pick a
    few tests."""
    values: list[tuple] = []
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        uses = item.module is request.module and request.fixturename in item.fixturenames
        if uses and spec is not None and all(n in spec.params for n in names):
            value = tuple(spec.params[n] for n in names)
            if value not in values:  # not a set: a parameter may be a list
                values.append(value)
    return values


def run_small(storage: str, study: str, *extra: str) -> int:
    """``python -m tuner run`` on ``SMALL_PROBLEM`` with two compile workers."""
    return main(
        ["run", *SMALL, "--storage", storage, "--study", study, "--workers", "2", "--no-progress", *extra]
    )


def best_config_file(tmp_path: Path, **changes) -> Path:
    """A best-config file of this environment for ``SMALL_PROBLEM``, with ``changes``."""
    data = {
        "format": FORMAT,
        "version": VERSION,
        "problem": SMALL_PROBLEM.to_dict(),
        "environment": environment(),
        "configs": [{"config": KernelConfig(64, 64, 1, 128).to_dict()}],
    }
    path = tmp_path / "best.json"
    write_json(path, data | changes)
    return path


def dispatch_file(tmp_path: Path, pairs: list[tuple[Problem, KernelConfig]], **changes) -> Path:
    """A dispatch table of this environment with one entry per (tuned problem, config), a
    per-token gate's with this gated kernel's code key."""
    gated = {GATED_KERNEL: kernel_key(modules=GATED_MODULES)}
    data = {
        "format": DISPATCH_FORMAT,
        "version": DISPATCH_VERSION,
        "environment": environment(),
        "entries": [
            {"problem": p.to_dict(), "config": c.to_dict(), "median_ms": 0.1}
            | (gated if p.gate == "token" else {})
            for p, c in pairs
        ],
    }
    path = tmp_path / "dispatch.json"
    write_json(path, data | changes)
    return path


def add_small_trial(study: optuna.Study, config: KernelConfig, value: float, **attrs) -> None:
    """A finished trial of ``SMALL_PROBLEM``'s space in ``study``, with ``attrs``."""
    distributions = space.search_space(SMALL_PROBLEM).distributions
    study.add_trial(
        optuna.trial.create_trial(
            params=config.to_dict(), distributions=distributions, value=value, user_attrs=attrs
        )
    )


def gpu_study(
    latencies: list[float | None],
    *,
    storage: str | None = None,
    name: str | None = None,
    env: dict | None = None,
    sweep: str = "forward",
    problem: Problem = SMALL_PROBLEM,
) -> optuna.Study:
    """A hand-built GPU study of ``problem`` (default ``SMALL_PROBLEM``): one trial per
    latency (None: failed to compile), on the configs of its ``tiled_grid`` in order (the
    fused pass's: its grid, unsplit first)."""
    study = optuna.create_study(storage=storage, study_name=name)
    study.set_user_attr("problem", problem.to_dict())
    study.set_user_attr("mode", "gpu")
    study.set_user_attr("objectives", ["median_ms"])
    if sweep != "forward":
        study.set_user_attr("sweep", sweep)
    built = space.search_space(problem, sweep)
    configs = tiled_grid(problem) if sweep == "forward" else built.grid
    dists = built.distributions
    for config, ms in zip(configs, latencies):
        attrs = {"mode": "gpu", "status": "ok" if ms else "compile_failed", "environment": env}
        state = optuna.trial.TrialState.COMPLETE if ms else optuna.trial.TrialState.FAIL
        study.add_trial(
            optuna.trial.create_trial(
                params=config.to_dict(),
                distributions=dists,
                state=state,
                value=ms,
                user_attrs=attrs | ({"median_ms": ms, "rel_l2": 1e-3} if ms else {}),
            )
        )
    return study
