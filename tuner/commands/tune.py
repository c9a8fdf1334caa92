"""The commands that tune: ``run`` (one study) and ``dispatch`` (a study per shape, then
the dispatch table), each on this process or spread over the local GPUs (``tuner.fleet``)."""

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kernel.arch import resolve
from kernel.config import KernelConfig, Problem
from kernel.constraints import head_size_error
from kernel.decode import DecodeCase, DecodeConfig
from kernel.environment import decode_environment, env_key, environment, gated_environment
from kernel.rule import dkdv_config
from kernel.trial_schema import predicted_text
from tuner import fleet
from tuner.commands.args import decode_case_of, exports, named, options_of, out_file, problem_of, where
from tuner.lines import fit
from tuner.options import Options, UsageError, default_storage, parse_shapes

if TYPE_CHECKING:
    import optuna

    from tuner.tuner import Tuner


def cmd_run(args: argparse.Namespace) -> int:
    """Run an Optuna study over the kernel's design space."""
    from tuner.tuner import Tuner  # loads torch, Optuna and pandas

    if args.sweep == "decode":
        return _run_decode(args)
    name, storage = where(args)
    # refuses a folder it cannot make or write, before any work
    folder = exports(args.studies_dir, storage, name, write=True)
    if args.gpus is not None:
        return _run_on_gpus(args, name, storage, folder)
    tuner = Tuner(problem_of(args), options_of(args), name=name, storage=storage)
    if not tuner.gpu:
        why = "no CUDA device" if tuner.env["gpu"] is None else f"this GPU is not {tuner.arch}"
        print(
            fit(
                f"{why}: compile-only exploration for {tuner.arch}: no latency is measured, configs rank "
                "by the latency model's predicted time"
            ),
            file=sys.stderr,
        )
    if tuner.interrupted:
        print(f"marked {tuner.interrupted} trial(s) of a killed run as failed", file=sys.stderr)
    study = _run_and_log(tuner, folder)
    if args.worker:  # started by --gpus: the parent exports once all workers are done
        return 0
    return _export_run(study, folder / "best.json", tuner.env_key)


def _run_decode(args: argparse.Namespace) -> int:
    """``run --sweep decode``: one study of the decode step at ``--batch`` sequences
    (``tuner.decode_tuner``), this process alone."""
    from tuner.decode_tuner import DecodeTuner
    from tuner.studies import check_study_name, default_study_name

    case = decode_case_of(args, args.batch)
    if args.gpus is not None:
        raise UsageError("--gpus runs forward and dkdv studies; a decode study runs in one process")
    named(args, "study", "storage")
    name, storage = (
        check_study_name(args.study or default_study_name(case)),
        args.storage or default_storage(),
    )
    folder = exports(args.studies_dir, storage, name, write=True)
    tuner = DecodeTuner(case, options_of(args), name=name, storage=storage)
    if not tuner.gpu:
        why = "no CUDA device" if tuner.env["gpu"] is None else f"this GPU is not {tuner.arch}"
        print(
            fit(
                f"{why}: compile-only exploration of the decode step for {tuner.arch}: no latency is "
                "measured, and no latency model is fitted to it: configs rank by how full their grid's "
                "waves keep the SMs"
            ),
            file=sys.stderr,
        )
    if tuner.interrupted:
        print(f"marked {tuner.interrupted} trial(s) of a killed run as failed", file=sys.stderr)
    study = _run_and_log(tuner, folder)
    if args.worker:
        return 0
    return _export_run(study, folder / "best.json", tuner.env_key)


def _run_on_gpus(args: argparse.Namespace, name: str, storage: str, folder: Path) -> int:
    """``run --gpus``: the study's trials split between one worker per GPU
    (``tuner.fleet.run_study``), then its log and export; 1 when a worker failed."""
    from tuner.studies import load_study  # loads Optuna
    from tuner.tuner import trial_environment

    problem, opts = problem_of(args), options_of(args)
    gpus = fleet.gpus_for(args.gpus, storage, opts.n_trials)
    outcomes = fleet.run_study(problem, opts, name, storage, gpus, folder)
    failed = [o for o in outcomes if o.returncode != 0]
    study = load_study(name, storage)
    _log(study, folder, opts.grace_s)
    here = env_key(trial_environment(problem, opts.arch))
    return _export_run(study, folder / "best.json", here) or int(bool(failed))


def _export_run(study: "optuna.Study", out: Path, env: str) -> int:
    """Export the best configs measured in environment ``env`` after a run; print the best,
    then the file."""
    from tuner.export import export_best  # loads torch, Optuna and pandas
    from tuner.trials import config_of

    try:
        data = export_best(study, out, env=env)
    except LookupError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    best, arch = data["configs"][0], (data["environment"] or {}).get("arch")
    label = (
        "median {:.4f} ms on {}".format(best["median_ms"], arch)
        if data["mode"] == "gpu"
        else f"compile-only for {arch}: {predicted_text(best)}, {best['spill_bytes']} B spilled, "
        f"{best['smem_bytes']} B smem, no latency measured"
    )
    if "x_floor" in best:  # a decode study's: its floor, the copy of its states, timed beside it
        label += f", {best['x_floor']:.2f}x the floor"
    print(fit(f"best {config_of(best['config']).label} ({label})"))
    print(f"exported {out}")
    return 0


def _run_and_log(tuner: "Tuner", folder: Path) -> "optuna.Study":
    """Say which latency model ranks the study, run it, then save its trial log (CSV and
    Parquet) in ``folder``, with its exports, and refresh the GPU's latency model from its
    measured trials (``Tuner.refresh_model``); a run stopped by Ctrl-C or SIGTERM does both
    for its trials so far (a second Ctrl-C cuts that short)."""
    forward = tuner.sweep != "decode"  # the decode step's study ranks by its waves, no model
    if forward:
        print(fit(tuner.model_line), file=sys.stderr)
    try:
        tuner.run()
    except KeyboardInterrupt:  # goes on after the log
        _log(tuner.study, folder, tuner.options.grace_s, f"{_this_run(tuner)}, stopped")
        if forward and (line := tuner.refresh_model()):
            print(fit(line), file=sys.stderr)
        raise
    _log(tuner.study, folder, tuner.options.grace_s, f"{_this_run(tuner)} this run")
    if forward and (line := tuner.refresh_model()):
        print(fit(line), file=sys.stderr)
    return tuner.study


def _this_run(tuner: "Tuner") -> str:
    """The run's GPU evaluations and configs new to the study (a repeat is neither)."""
    new = tuner.explored
    return f", {tuner.gpu_evaluations} GPU evaluations, {new} config{'s' * (new != 1)} new to the study"


def _log(study: "optuna.Study", folder: Path, grace_s: float, note: str = "") -> None:
    """Save the study's trial log (CSV and Parquet) in ``folder`` and say so in one line,
    with its unfinished trials counted apart (``tuner.liveness.unfinished_summary``)."""
    from reports.search import prediction_check
    from tuner.liveness import unfinished_summary  # loads Optuna
    from tuner.trials import save_frame, trials_frame  # loads Optuna and pandas

    frame = trials_frame(study)
    paths = save_frame(frame, folder / "trials")
    finished = sum(t.state.is_finished() for t in study.trials)
    unfinished = unfinished_summary(study, grace_s)
    print(
        fit(
            f"study {study.study_name!r}: {finished} trial{'s' * (finished != 1)}"
            + (f" ({unfinished})" if unfinished else "")
            + f"{note}; log {', '.join(map(str, paths))}"
        )
    )
    for line in prediction_check(frame):
        print(fit(line))


def cmd_dispatch(args: argparse.Namespace) -> int:
    """Tune several shapes, one resumable study each, and write the dispatch table: the
    best config per shape, which ``kernel.ops.dispatch.load_dispatch`` serves by shape (with
    ``--backward``, for DK x DV and DV x DK)."""
    from tuner.export import export_dispatch  # loads torch, Optuna and pandas
    from tuner.studies import default_study_name, load_study

    out = out_file(args, args.studies_dir / "dispatch.json", (".json",))
    storage = args.storage or default_storage()
    opts = options_of(args)
    arch, runs_here = resolve(opts.arch)
    tasks = dispatch_tasks(args, opts, arch)
    if opts.arch is not None and not runs_here:
        return _explore_shapes(tasks, arch, storage, args.studies_dir)
    names = [default_study_name(p, o.sweep) for p, o in tasks]
    if args.gpus is not None and any(o.sweep == "decode" for _, o in tasks):
        raise UsageError("--gpus runs forward and dkdv studies; decode studies run in one process")
    if args.gpus is not None:
        gpus = fleet.gpus_for(args.gpus, storage, len(tasks))
        tasks_named = [(p, o, name) for (p, o), name in zip(tasks, names)]
        outcomes = fleet.run_studies(tasks_named, storage, gpus, args.studies_dir / "dispatch-workers")
        if any(o.returncode != 0 for o in outcomes):
            print(
                "a shape's worker failed: no table written (run the same command to go on)", file=sys.stderr
            )
            return 1
        studies = [load_study(name, storage) for name in names]
    elif not runs_here:  # a table ranks by measured latency; exploring needs asking for
        raise UsageError(
            f"dispatch times its configs and needs a CUDA device (--arch {arch} explores compile-only: "
            "no table is written)"
        )
    else:
        studies = [
            _run_and_log(
                _tuner(problem, o, name, storage), exports(args.studies_dir, storage, name, write=True)
            )
            for (problem, o), name in zip(tasks, names)
        ]
    try:
        envs = {"env": environment, "decode_env": decode_environment, "gated_env": gated_environment}
        data = export_dispatch(studies, out, **{k: env_key(e(opts.arch)) for k, e in envs.items()})
    except LookupError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror or exc} (the studies are saved)") from None
    print(f"dispatch table for {data['environment']['arch']}:")
    for entry in data["entries"]:
        if entry["sweep"] == "decode":
            p, c = entry["problem"], DecodeConfig.from_dict(entry["config"])
            shape = f"decode {p['dk']}x{p['dv']} H={p['heads']} N={p['batch']:>4}"
            floor = entry.get("x_floor", math.nan)
            print(f"{shape}: {c.label} {entry['median_ms']:.4f} ms, {floor:.2f}x floor")
            continue
        p, c = Problem.from_dict(entry["problem"]), KernelConfig.from_dict(entry["config"])
        shape = f"{_heads_text(p)} B*H={p.batch * p.heads:>4} S={p.seqlen:>6}"
        print(
            f"{shape}: {c.label} {entry['median_ms']:.4f} ms" + (" (dk+dv sweep)" if "sweep" in entry else "")
        )
    print(out)
    return 0


def dispatch_tasks(args: argparse.Namespace, opts: Options, arch: str) -> list[tuple[Problem, Options]]:
    """The studies of ``dispatch``, a (problem, options) each: per shape the forward's at DK x
    DV (with ``--gate token``, the per-token gate's forward of ``--groups``); with
    ``--backward`` also at DV x DK (the dq pass's shape) and the fused dk and dv sweep's
    (``--sweep dkdv``) where it serves the shape on ``arch``; with ``--sweep dkdv`` only
    those."""
    shapes = parse_shapes(args.shapes)
    if args.gate == "token" and (args.backward or opts.sweep == "dkdv"):
        raise UsageError(
            "the per-token gate's backward (--gate token) runs its passes at the rule's config "
            "(kernel.gated_build.pass_job), no table entry to tune: drop --backward"
        )
    swapped = args.backward and args.dk != args.dv
    heads = [(args.dk, args.dv)] + ([(args.dv, args.dk)] if swapped else [])
    tasks: list[tuple[Problem, Options]] = []
    if opts.sweep == "forward":
        tasks += [
            (problem_of(args, batch=b, heads=h, seqlen=s, dk=dk, dv=dv), opts)
            for dk, dv in heads
            for b, h, s in shapes
        ]
    if args.backward or opts.sweep == "dkdv":
        fused = dataclasses.replace(opts, sweep="dkdv")
        problems = [problem_of(args, batch=b, heads=h, seqlen=s) for b, h, s in shapes]
        tasks += [(p, fused) for p in problems if dkdv_config(p, arch) is not None]
    if args.decode or opts.sweep == "decode":
        decode = dataclasses.replace(opts, sweep="decode")
        heads_of = dict.fromkeys(h for _, h, _ in shapes)
        tasks += [(decode_case_of(args, n, h), decode) for h in heads_of for n in parse_batches(args.batches)]
    if not tasks:
        raise UsageError(
            f"the fused dk and dv pass serves none of these shapes on {arch} (Hopper, DK x DV <= 128 x 128)"
        )
    for dk, dv in heads if opts.sweep != "decode" else ():  # before any study: the swapped sweeps would fail
        if reason := head_size_error(arch, dk, dv):
            raise UsageError(reason)
    return tasks


def parse_batches(text: str) -> list[int]:
    """'1,8,64,256' -> [1, 8, 64, 256], each once: ``dispatch --decode``'s numbers of sequences."""
    try:
        batches = [int(n) for n in text.split(",")]
    except ValueError:
        batches = []
    if not batches or min(batches) < 1:
        raise UsageError(f"--batches wants positive numbers of sequences, comma-separated, got {text!r}")
    return list(dict.fromkeys(batches))


def _tuner(problem: "Problem | DecodeCase", opts: Options, name: str, storage: str) -> "Tuner":
    """The study's process: the forward's and dkdv's ``Tuner``, the decode step's ``DecodeTuner``."""
    from tuner.decode_tuner import DecodeTuner
    from tuner.tuner import Tuner

    if opts.sweep == "decode":
        return DecodeTuner(problem, opts, name=name, storage=storage)
    return Tuner(problem, opts, name=name, storage=storage)


def _explore_shapes(tasks: list[tuple[Problem, Options]], arch: str, storage: str, studies: Path) -> int:
    """``dispatch --arch`` for an architecture that is not this GPU's: one compile-only
    study per shape, its best config printed; no table, which ranks by latency."""
    from tuner.studies import default_study_name  # loads Optuna
    from tuner.trials import best_trials, trial_config

    print(f"compile-only exploration for {arch}: no latency is measured, no table written", file=sys.stderr)
    for problem, opts in tasks:
        name = default_study_name(problem, opts.sweep)
        tuner = _tuner(problem, opts, name, storage)
        study = _run_and_log(tuner, exports(studies, storage, name, write=True))
        best = best_trials(study, tuner.env_key)
        found = (
            f"{trial_config(best[0]).label} ({predicted_text(best[0].user_attrs)}, "
            f"{best[0].user_attrs['spill_bytes']} B spilled)"
            if best
            else "no feasible config"
        )
        p, what = problem, " dk+dv" if opts.sweep == "dkdv" else ""
        if opts.sweep == "decode":
            shape = f"{arch} decode {p.problem.dk}x{p.problem.dv} H={p.problem.heads} N={p.batch:>4}"
        else:
            shape = f"{arch} {_heads_text(p)}{what} B*H={p.batch * p.heads:>4} S={p.seqlen:>6}"
        print(fit(f"{shape}: {found}, compile-only"))
    return 0


def _heads_text(problem: Problem) -> str:
    """'128x64', then ' gated G=1' for a per-token gate's problem (its groups, where given)."""
    p = problem
    gate = (" gated" + (f" G={p.groups}" if p.groups else "")) if p.gate == "token" else ""
    return f"{p.dk}x{p.dv}{gate}"
