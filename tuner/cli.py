"""python -m tuner: tune the scalar-decay kernel with Optuna.

A user mistake prints one line and exits with 2. Heavy libraries (torch, TileLang,
Optuna) load inside the command that needs them, so --help and argument errors answer at
once.
"""

import argparse
import dataclasses
import json
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kernel.arch import ARCHS
from kernel.config import HEADLINE, SEED_CONFIG, KernelConfig, Problem, model_call
from tuner import options
from tuner.options import (
    BENCH_PACKED,
    BENCH_SHAPES,
    PROBLEM_FLAGS,
    STUDIES_DIR,
    Options,
    UsageError,
    default_storage,
    parse_archs,
    parse_shapes,
)

if TYPE_CHECKING:
    import optuna
    import pandas as pd

    from tuner.study import Tuner

# The trial table's columns, as `trials` and `best` print them.
TABLE = (
    "number",
    "status",
    "config",
    "median_ms",
    "rel_l2",
    "spill_bytes",
    "smem_bytes",
    "registers",
    "reason",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: one line, exit 2
        raise UsageError(f"{self.prog}: {message}")


class _Help(argparse.RawDescriptionHelpFormatter):
    """Shows each flag's default, unless it has none to show or its help names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default  # not `in (None, False, True, [])`, which also hides 0 and 1 (0 == False)
        hidden = default is None or isinstance(default, bool) or default == []
        if hidden or "default" in text or action.nargs == 0:
            return text
        return f"{text} (default: %(default)s)"


def _storage_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--storage",
        default=None,
        help="Optuna storage: an SQLAlchemy URL, journal:PATH (or a plain file path) or grpc://HOST:PORT "
        f"(default: {default_storage()})",
    )


def _study_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--study", "--study-name", dest="study", help="study name (default: derived from the problem)"
    )
    _storage_flags(p)


def _problem_flags(p: argparse.ArgumentParser, names=tuple(PROBLEM_FLAGS)) -> None:
    defaults = HEADLINE.to_dict()
    for name in names:
        kind = type(defaults[name])
        p.add_argument(f"--{name}", type=kind, default=defaults[name], help=PROBLEM_FLAGS[name])


def _tuning_flags(p: argparse.ArgumentParser) -> None:
    """One flag per field of ``tuner.options.Options``, with its default and help."""
    for f in options.fields():
        meta = f.metadata
        if isinstance(f.default, bool):  # a switch that flips the default
            action = "store_true" if meta["flag"] is None else "store_false"
            p.add_argument(options.flag(f), dest=f.name, action=action, help=meta["help"])
            continue
        kind = next(t for t in typing.get_args(f.type) or (f.type,) if t is not type(None))
        extra = {"choices": meta["choices"]} if "choices" in meta else {}
        p.add_argument(options.flag(f), dest=f.name, type=kind, default=f.default, help=meta["help"], **extra)
    p.add_argument(
        "--enqueue",
        action="append",
        default=[],
        metavar="C/bDV/stages/threads[/scores[/segments]]",
        help="a config to measure first (repeatable); the seed's default always is",
    )
    p.add_argument(
        "--enqueue-from",
        action="append",
        default=[],
        metavar="BEST_JSON",
        help="measure first the configs of an exported best-config file (repeatable)",
    )


def _gpus_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gpus",
        help="start one worker process per GPU (0,1,... or all), all on this study's storage "
        "(a journal file or a database server, not SQLite); default: this process alone",
    )


def _env_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--env",
        help="the environment whose measurements to rank: its key or the key's start (a study of several "
        "environments lists them); default: the only one, else this machine's",
    )


def _shape_flags(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--shapes",
        default=",".join("x".join(map(str, s)) for s in BENCH_SHAPES),
        help=f"{what}: comma-separated BxHxS",
    )
    _problem_flags(p, ("dk", "dv", "dtype"))


def _problem(args: argparse.Namespace) -> Problem:
    return Problem(args.batch, args.heads, args.seqlen, args.dk, args.dv, args.dtype)


def _config(text: str, flag: str = "--enqueue") -> KernelConfig:
    """'64/128/2/256/smem/8' -> KernelConfig (scores optional, default smem; segments
    optional, default 1)."""
    parts = text.split("/")
    if len(parts) not in (4, 5, 6):
        raise UsageError(f"{flag} wants C/bDV/stages/threads[/scores[/segments]], got {text!r}")
    try:
        return KernelConfig(*map(int, parts[:4]), *parts[4:5], *map(int, parts[5:]))
    except ValueError as exc:
        raise UsageError(f"{flag} {text}: {exc}") from None


def _configs_from(paths: list[str]) -> tuple[KernelConfig, ...]:
    """The configs of best-config JSON files (``export``), to measure first."""
    from kernel.ops.deploy import read_export

    configs = []
    for path in paths:
        for entry in read_export(path)["configs"]:
            try:
                configs.append(KernelConfig.from_dict(entry["config"]))
            except (KeyError, TypeError, ValueError) as exc:
                raise UsageError(f"{path}: malformed config entry: {exc}") from None
    return tuple(configs)


def _options(args: argparse.Namespace) -> Options:
    values = {f.name: getattr(args, f.name) for f in options.fields()}
    for f in options.fields():
        minimum, value = f.metadata["minimum"], values[f.name]
        if minimum is not None and value is not None and not value >= minimum:  # `not >=` rejects NaN
            raise UsageError(
                f"{options.flag(f)} must be {'positive' if minimum > 0 else '>= 0'}, got {value}"
            )
    enqueue = tuple(_config(c) for c in args.enqueue) + _configs_from(args.enqueue_from)
    return Options(**values, enqueue=enqueue)


def _where(args: argparse.Namespace) -> tuple[str, str]:
    """(study name, storage URL) from the flags, defaulting to the problem's study in studies/."""
    from tuner.storage import check_study_name, default_study_name

    sweep = getattr(args, "sweep", "forward")  # run's; the read-only commands name a dkdv study with --study
    return check_study_name(
        args.study or default_study_name(_problem(args), sweep)
    ), args.storage or default_storage()


def _exports(storage: str, name: str) -> Path:
    """The folder of the study's files, keyed by storage and study (``tuner.storage.export_dir``)."""
    from tuner.storage import export_dir

    return export_dir(storage, name, STUDIES_DIR)


def _open(args: argparse.Namespace, name: str | None = None) -> "optuna.Study":
    """An existing study (read-only commands: a missing storage or study is a ``UsageError``)."""
    from tuner.storage import load_study

    default_name, storage = _where(args)
    return load_study(name or default_name, storage)


def _default_out(args: argparse.Namespace, file: str) -> Path:
    name, storage = _where(args)
    return _exports(storage, name) / file


def cmd_run(args: argparse.Namespace) -> int:
    """Run an Optuna study over the kernel's design space."""
    from tuner.study import Tuner

    name, storage = _where(args)
    if args.gpus is not None:
        return _run_on_gpus(args, name, storage)
    tuner = Tuner(_problem(args), _options(args), name=name, storage=storage)
    if not tuner.gpu:
        why = "no CUDA device" if tuner.env["gpu"] is None else f"this GPU is not {tuner.arch}"
        print(
            f"{why}: compile-only exploration for {tuner.arch} (probe resources, no latency is measured)",
            file=sys.stderr,
        )
    if tuner.interrupted:
        print(f"marked {tuner.interrupted} trial(s) of a killed run as failed", file=sys.stderr)
    study = _run_and_log(tuner, _exports(storage, name))
    if args.worker:  # started by --gpus: the parent exports once all workers are done
        return 0
    return _export_run(study, _exports(storage, name) / "best.json", tuner.env_key)


def _export_run(study: "optuna.Study", out: Path, env: str) -> int:
    """Export the best configs measured in environment ``env`` after a run; print the best."""
    from tuner.export import export_best

    try:
        data = export_best(study, out, env=env)
    except LookupError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    best, arch = data["configs"][0], (data["environment"] or {}).get("arch")
    label = (
        "median {:.4f} ms on {}".format(best["median_ms"], arch)
        if data["mode"] == "gpu"
        else f"compile-only for {arch}: {best['spill_bytes']} B spilled, {best['smem_bytes']} B smem, "
        "no latency"
    )
    print(f"best {KernelConfig.from_dict(best['config']).label} ({label}); exported {out}")
    return 0


def _gpus(args: argparse.Namespace, storage: str, jobs: int) -> list[int]:
    """The GPUs of ``--gpus``; ``UsageError`` for a malformed list, a storage that cannot
    serve that many processes at once, or a machine without CUDA."""
    from tuner.fleet import local_gpus, parse_gpus
    from tuner.storage import check_shared

    wanted = parse_gpus(args.gpus)
    if wanted is not None:  # before loading torch: a mistake answers at once
        check_shared(storage, min(len(wanted), jobs))
    gpus = local_gpus(wanted)
    check_shared(storage, min(len(gpus), jobs))
    return gpus


def _run_argv(problem: Problem, opts: Options, name: str, storage: str) -> tuple[str, ...]:
    """The ``run`` command line of a worker of ``--gpus``: ``problem`` and ``opts`` as flags."""
    argv = ["run", "--worker", "--study", name, "--storage", storage]
    argv += [a for key in PROBLEM_FLAGS for a in (f"--{key}", str(getattr(problem, key)))]
    for f in options.fields():
        value = getattr(opts, f.name)
        if isinstance(f.default, bool):
            argv += [options.flag(f)] * (value != f.default)
        elif value is not None:
            argv += [options.flag(f), str(value)]
    return (*argv, *(a for c in opts.enqueue for a in ("--enqueue", c.label)))


def _worker_options(opts: Options, workers: int) -> Options:
    """Each of ``workers`` concurrent workers: its share of the cores. Its progress bar
    reaches the terminal as a line per update (``tuner.fleet``)."""
    import dataclasses
    import os

    cores = os.cpu_count() or 1
    return dataclasses.replace(opts, workers=opts.workers or max(1, cores // workers - 2))


def _run_on_gpus(args: argparse.Namespace, name: str, storage: str) -> int:
    """``run --gpus``: one worker per GPU on the study, its trials split between them."""
    import dataclasses

    from kernel.environment import env_key, environment
    from tuner.fleet import Job, run_jobs
    from tuner.storage import load_study

    problem, opts = _problem(args), _options(args)
    gpus = _gpus(args, storage, opts.n_trials)[: opts.n_trials]
    base = _worker_options(opts, len(gpus))
    jobs = [
        Job(f"worker{i}", _run_argv(problem, dataclasses.replace(base, n_trials=share), name, storage))
        for i, share in enumerate(_shares(opts.n_trials, len(gpus)))
    ]
    folder = _exports(storage, name)
    print(
        f"{len(jobs)} workers on study {name!r} in {storage} (logs in {folder / 'workers'})", file=sys.stderr
    )
    outcomes = run_jobs(jobs, gpus, log_dir=folder / "workers")
    failed = [o for o in outcomes if o.returncode != 0]
    study = load_study(name, storage)
    _log(study, folder)
    return _export_run(study, folder / "best.json", env_key(environment(opts.arch))) or int(bool(failed))


def _shares(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` nearly equal positive shares."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def _run_and_log(tuner: "Tuner", folder: Path) -> "optuna.Study":
    """Run the study, then save its trial log (CSV and Parquet) in ``folder``, with its exports."""
    study = tuner.run()
    _log(study, folder, f", {tuner.gpu_evaluations} GPU evaluations this run")
    return study


def _log(study: "optuna.Study", folder: Path, note: str = "") -> None:
    """Save the study's trial log (CSV and Parquet) in ``folder`` and say so in one line."""
    from tuner.trials import save_frame, trials_frame

    paths = save_frame(trials_frame(study), folder / "trials")
    finished = sum(t.state.is_finished() for t in study.trials)
    queued = len(study.trials) - finished  # enqueued configs the next run measures first
    print(
        f"study {study.study_name!r}: {finished} trial{'s' * (finished != 1)}"
        + (f" ({queued} queued for the next run)" if queued else "")
        + f"{note}; log {', '.join(map(str, paths))}"
    )


def cmd_dispatch(args: argparse.Namespace) -> int:
    """Tune several shapes, one resumable study each, and write the dispatch table: the
    best config per shape, which ``kernel.ops.dispatch.load_dispatch`` serves by shape (with
    ``--backward``, for DK x DV and DV x DK)."""
    import torch

    from kernel.arch import resolve
    from kernel.environment import env_key, environment
    from tuner.export import export_dispatch
    from tuner.storage import default_study_name
    from tuner.study import Tuner

    out = Path(args.out) if args.out else STUDIES_DIR / "dispatch.json"
    if out.is_dir():
        raise UsageError(f"--out wants a file path for the table, got the directory {str(out)!r}")
    storage = args.storage or default_storage()
    opts = _options(args)
    tasks = _dispatch_tasks(args, opts, resolve(opts.arch)[0])
    if opts.arch is not None and not resolve(opts.arch)[1]:
        return _explore_shapes(tasks, storage)
    if args.gpus is not None:
        studies = _dispatch_on_gpus(tasks, storage, _gpus(args, storage, len(tasks)))
    elif not torch.cuda.is_available():
        raise UsageError("dispatch ranks configs by measured latency and needs a CUDA device (or --arch)")
    else:
        studies = [
            _run_and_log(
                Tuner(problem, o, name=default_study_name(problem, o.sweep), storage=storage),
                _exports(storage, default_study_name(problem, o.sweep)),
            )
            for problem, o in tasks
        ]
    if studies is None:
        return 1
    try:
        data = export_dispatch(studies, out, env=env_key(environment(opts.arch)))
    except LookupError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror or exc} (the studies are saved)") from None
    print(f"dispatch table for {data['environment']['arch']}:")
    for entry in data["entries"]:
        p, c = entry["problem"], KernelConfig.from_dict(entry["config"])
        shape = f"{p['dk']}x{p['dv']} B*H={p['batch'] * p['heads']:>4} S={p['seqlen']:>6}"
        print(
            f"{shape}: {c.label} {entry['median_ms']:.4f} ms" + (" (dk+dv sweep)" if "sweep" in entry else "")
        )
    print(out)
    return 0


def _dispatch_tasks(args: argparse.Namespace, opts: Options, arch: str) -> list[tuple[Problem, Options]]:
    """The studies of ``dispatch``, a (problem, options) each: per shape the forward's at DK x
    DV; with ``--backward`` also at DV x DK (the dq sweep's shape) and the fused dk and dv
    sweep's (``--sweep dkdv``) where it serves the shape on ``arch``; with ``--sweep dkdv``
    only those."""
    from kernel.defaults import dkdv_config

    shapes = parse_shapes(args.shapes)
    swapped = args.backward and args.dk != args.dv
    heads = [(args.dk, args.dv)] + ([(args.dv, args.dk)] if swapped else [])
    tasks: list[tuple[Problem, Options]] = []
    if opts.sweep == "forward":
        tasks += [(Problem(b, h, s, dk, dv, args.dtype), opts) for dk, dv in heads for b, h, s in shapes]
    if args.backward or opts.sweep == "dkdv":
        fused = dataclasses.replace(opts, sweep="dkdv")
        problems = [Problem(b, h, s, args.dk, args.dv, args.dtype) for b, h, s in shapes]
        tasks += [(p, fused) for p in problems if dkdv_config(p, arch) is not None]
    if not tasks:
        raise UsageError(
            f"the fused dk and dv sweep serves none of these shapes on {arch} (Hopper, DK x DV <= 128 x 128)"
        )
    return tasks


def _explore_shapes(tasks: list[tuple[Problem, Options]], storage: str) -> int:
    """``dispatch --arch`` for an architecture that is not this GPU's: one compile-only
    study per shape, its best config printed; no table, which ranks by latency."""
    from tuner.storage import default_study_name
    from tuner.study import Tuner
    from tuner.trials import best_trials, trial_config

    arch = tasks[0][1].arch
    print(f"compile-only exploration for {arch}: no latency is measured, no table written", file=sys.stderr)
    for problem, opts in tasks:
        name = default_study_name(problem, opts.sweep)
        tuner = Tuner(problem, opts, name=name, storage=storage)
        study = _run_and_log(tuner, _exports(storage, name))
        best = best_trials(study, tuner.env_key)
        found = (
            f"{trial_config(best[0]).label} ({best[0].user_attrs['spill_bytes']} B spilled, "
            f"{best[0].user_attrs['smem_bytes']} B smem)"
            if best
            else "no feasible config"
        )
        p, what = problem, " dk+dv" if opts.sweep == "dkdv" else ""
        print(f"{arch} {p.dk}x{p.dv}{what} B*H={p.batch * p.heads:>4} S={p.seqlen:>6}: {found}, compile-only")
    return 0


def _dispatch_on_gpus(
    tasks: list[tuple[Problem, Options]], storage: str, gpus: list[int]
) -> "list[optuna.Study] | None":
    """``dispatch --gpus``: the shapes' studies handed out whole, one at a time per GPU, the
    next to the first GPU that comes free; None when a shape's worker failed."""
    from tuner.fleet import Job, run_jobs
    from tuner.storage import default_study_name, load_study

    names = [default_study_name(p, o.sweep) for p, o in tasks]
    share = min(len(gpus), len(tasks))
    jobs = [
        Job(
            f"{p.batch}x{p.heads}x{p.seqlen}" + ("/dkdv" if o.sweep == "dkdv" else ""),
            _run_argv(p, _worker_options(o, share), name, storage),
        )
        for (p, o), name in zip(tasks, names)
    ]
    outcomes = run_jobs(jobs, gpus, log_dir=STUDIES_DIR / "dispatch-workers")
    for o in outcomes:
        print(f"{o.job.label}: GPU {o.gpu}, {o.wall_s:.0f} s, exit {o.returncode}", file=sys.stderr)
    if any(o.returncode != 0 for o in outcomes):
        print("a shape's worker failed: no table written (run the same command to go on)", file=sys.stderr)
        return None
    return [load_study(name, storage) for name in names]


def table(frame: "pd.DataFrame", columns=TABLE) -> str:
    """The trial log as text: the config as its label, whole numbers without a decimal
    point, empty cells blank, each reason's first line whole."""
    import pandas as pd

    from kernel.trial_schema import PARAMS

    shown = frame.assign(
        config=[KernelConfig(**{k: row[k] for k in PARAMS}).label for _, row in frame.iterrows()],
        reason=frame.reason.map(
            lambda r: r.strip().splitlines()[0] if isinstance(r, str) and r.strip() else None
        ),
    )[list(columns)]
    for column in shown.columns:
        values = shown[column]
        numeric = pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values)
        if numeric and values.dropna().map(lambda x: float(x).is_integer()).all():  # ints and floats
            shown[column] = values.astype("Int64")
    return shown.astype(object).where(shown.notna(), "").to_string(index=False)


def _heading(study: "optuna.Study") -> str:
    """The study's name, kernel and mode; a compile-only study says that nothing was timed."""
    mode, arch = study.user_attrs.get("mode", "unknown mode"), study.user_attrs.get("arch")
    where = f" for {arch}" if arch and mode == "compile-only" else f" on {arch}" if arch else ""
    note = ": resources from the compiler, no latency measured" if mode == "compile-only" else ""
    kernel = "the backward's fused dk+dv sweep, " if study.user_attrs.get("sweep") == "dkdv" else ""
    return f"study {study.study_name!r} ({kernel}{mode}{where}{note})"


def cmd_trials(args: argparse.Namespace) -> int:
    """Print the trial log of a study."""
    from tuner.trials import trials_frame

    study = _open(args)
    frame = trials_frame(study)
    print(_heading(study))
    print(frame.to_string(index=False) if args.all_columns else table(frame))
    return 0


def cmd_best(args: argparse.Namespace) -> int:
    """Print the best configs of a study, best first, as `trials` prints trials."""
    from tuner.trials import best_trials, trials_frame

    study = _open(args)
    env = _env(args, study)
    best = [t.number for t in best_trials(study, env)[: args.top]]
    if not best:
        print(f"study {study.study_name!r} has no feasible, correct trial yet", file=sys.stderr)
        return 1
    frame = trials_frame(study).set_index("number", drop=False).loc[best]
    print(f"{_heading(study)}, {_env_line(study, env)}")
    print(table(frame))
    return 0


def _env(args: argparse.Namespace, study: "optuna.Study") -> str | None:
    """The environment ``best`` and ``export`` report (``tuner.trials.choose_env``)."""
    from tuner.trials import choose_env

    def here() -> str:
        from kernel.environment import env_key, environment

        return env_key(environment())

    return choose_env(study, args.env, here)


def _env_line(study: "optuna.Study", env: str | None) -> str:
    from tuner.trials import describe_env, environments

    return f"measured in environment {describe_env(env, environments(study).get(env, (None, 0))[0])}"


def _out_file(args: argparse.Namespace, default: Path, suffixes: tuple[str, ...]) -> Path:
    """``--out`` or ``default``: a file path with one of ``suffixes``, never a directory."""
    out = Path(args.out) if args.out else default
    if out.is_dir() or args.out and args.out.endswith(("/", "\\")) or out.suffix.lower() not in suffixes:
        raise UsageError(f"--out wants a {' or '.join(suffixes)} file path, got {str(args.out or out)!r}")
    return out


def cmd_export(args: argparse.Namespace) -> int:
    """Write the best-config JSON of a study (what ``kernel.ops.deploy.load_kernel`` loads)."""
    from tuner.export import export_best

    out = _out_file(args, _default_out(args, "best.json"), (".json",))
    study = _open(args)
    env = _env(args, study)
    try:
        export_best(study, out, env=env)
    except LookupError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror or exc}") from None
    print(_env_line(study, env), file=sys.stderr)
    print(out)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Compare a study with a yardstick study (e.g. the exhaustive grid) of the same problem.

    With ``--remeasure`` on a GPU, both best configs are timed again, alternately, in this
    one process, so the final ratio does not depend on when each study ran.
    """
    from kernel.environment import write_json
    from tuner.trials import compare, trials_frame

    study, yardstick = _open(args), _open(args, args.against)
    if study.user_attrs.get("problem") != yardstick.user_attrs.get("problem"):
        raise UsageError(f"{study.study_name!r} and {args.against!r} tuned different problems")
    for s in (study, yardstick):
        if s.user_attrs.get("mode") != "gpu":
            raise UsageError(f"study {s.study_name!r} is compile-only: it timed nothing to compare")
    try:
        summary = compare(trials_frame(study), trials_frame(yardstick))
    except LookupError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    summary |= {"study": study.study_name, "yardstick": args.against}
    if args.remeasure:
        summary["remeasured"] = _remeasure(
            Problem.from_dict(study.user_attrs["problem"]),
            KernelConfig(**summary["best_config"]),
            KernelConfig(**summary["yardstick_best_config"]),
        )
    if args.out:
        write_json(Path(args.out), summary)
    print(json.dumps(summary, indent=1))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Write one self-contained HTML report of a study (works offline)."""
    from reports import StudyInfo, write_report
    from tuner.trials import environments, problem_trials, trials_frame

    out = _out_file(args, _default_out(args, "report.html"), (".html", ".htm"))
    study = _open(args)
    if not study.trials:
        raise UsageError(f"study {study.study_name!r} has no trials yet: nothing to report")
    env = None
    if len(environments(study)) > 1:  # workers on several GPU kinds: one environment's trials
        env = _env(args, study)
        print(f"report of study {study.study_name!r}, {_env_line(study, env)}", file=sys.stderr)
    frame = trials_frame(study, env=env)
    try:
        info = StudyInfo.from_attrs(study.study_name, study.user_attrs)
        write_report(frame, info, out, across=problem_trials(study))
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror or exc}") from None
    print(out)
    if args.open:
        import webbrowser

        if not webbrowser.open(out.resolve().as_uri()):
            print(f"no browser to open here; the report is {out}", file=sys.stderr)
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    """Compile one config for one or more GPU architectures (no GPU needed) and print its
    resources side by side, or why it cannot exist there."""
    from kernel.arch import resolve
    from kernel.resources import ProbeFailure, probe
    from tuner import space

    problem, config = _problem(args), _config(args.config, "--config")
    config.check_fits(problem)
    archs = parse_archs(args.arch) if args.arch else [resolve(None)[0]]
    print(f"{config.label} for {problem} in the model form, compile-only")
    heads = ("registers", "spill B", "smem B", "limit B", "threads")
    print(f"{'arch':<8} {'status':<14} " + " ".join(f"{h:>9}" for h in heads) + "  reason")
    for arch in archs:
        reasons = space.violated(problem, config, arch)
        res = None if reasons else probe(problem, config, arch=arch, call=model_call(problem))
        if res is None or isinstance(res, ProbeFailure):
            why = "; ".join(reasons) if res is None else f"{res.stage}: {res.error_type}: {res.message}"
            status = "restricted" if res is None else "compile_failed"
            print(f"{arch:<8} {status:<14} " + " ".join([" " * 9] * 5) + f"  {why.splitlines()[0][:160]}")
            continue
        status = "ok" if res.fits_smem else "over_smem"
        figures = (res.registers, res.spill_bytes, res.smem_bytes, res.smem_limit, res.threads_launched)
        print(f"{arch:<8} {status:<14} " + " ".join(f"{n:>9}" for n in figures))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Time the tuned kernel, the seed's config, fla and plain torch over shapes, then a
    packed batch, in the model form (RetNet's decays, scale, final state), then the
    backward and forward plus backward against fla's, each against its HBM floor."""
    import torch

    from kernel.ops.dispatch import load_dispatch
    from tuner.bench import bench_and_write

    shapes = parse_shapes(args.shapes)
    Problem(1, 1, 1, args.dk, args.dv, args.dtype)  # validates the flags up front
    if args.packed < 0:
        raise UsageError(f"--packed wants a number of sequences >= 0, got {args.packed}")
    packed = BENCH_PACKED._replace(sequences=args.packed) if args.packed else None
    dispatch = load_dispatch(args.dispatch, allow_mismatch=args.allow_mismatch) if args.dispatch else None
    if not torch.cuda.is_available():
        raise UsageError("bench times kernels and needs a CUDA device; none is visible")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out wants a directory, got the file {str(out)!r}")
    bench_and_write(
        shapes,
        out,
        dk=args.dk,
        dv=args.dv,
        dtype=args.dtype,
        dispatch=dispatch,
        packed=packed,
        backward=not args.no_backward,
    )
    return 0


def _remeasure(problem: Problem, mine: KernelConfig, theirs: KernelConfig, rounds: int = 3) -> dict:
    from functools import partial

    import torch

    from kernel.builder import build
    from kernel.timing import alternating
    from kernel.validate import random_qkv

    if not torch.cuda.is_available():
        raise UsageError("--remeasure needs a CUDA device")
    q, k, v = random_qkv(problem, seed=12345)
    out = torch.empty_like(v)
    final = torch.empty(problem.batch, problem.heads, problem.dk, problem.dv, device=q.device)
    call = model_call(problem)  # the form the studies measured, with its default decay
    kernels = {"study": build(problem, mine, call), "yardstick": build(problem, theirs, call)}
    times = alternating(
        {name: partial(kern, q, k, v, out=out, final_state=final) for name, kern in kernels.items()},
        rounds=rounds,
    )
    med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    return {"median_ms": med, "all_ms": times, "study_over_yardstick": med["study"] / med["yardstick"]}


# Subcommand -> (function, flag groups). The first line of the function's docstring is its help.
COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], tuple[Callable, ...]]] = {
    "run": (cmd_run, (_study_flags, _problem_flags, _tuning_flags, _gpus_flag)),
    "dispatch": (cmd_dispatch, (_storage_flags, _tuning_flags, _gpus_flag)),
    "trials": (cmd_trials, (_study_flags, _problem_flags)),
    "best": (cmd_best, (_study_flags, _problem_flags, _env_flag)),
    "export": (cmd_export, (_study_flags, _problem_flags, _env_flag)),
    "compare": (cmd_compare, (_study_flags, _problem_flags)),
    "report": (cmd_report, (_study_flags, _problem_flags, _env_flag)),
    "bench": (cmd_bench, ()),
    "probe": (cmd_probe, (_problem_flags,)),
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m tuner", description=__doc__, formatter_class=_Help)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    for name, (func, groups) in COMMANDS.items():
        doc = func.__doc__ or ""
        summary = " ".join(doc.split("\n\n")[0].split())
        p = sub.add_parser(name, help=summary, description=doc, formatter_class=_Help)
        p.set_defaults(func=func)
        for group in groups:
            group(p)
    _shape_flags(sub.choices["dispatch"], "the shapes to tune, one study each")
    sub.choices["dispatch"].add_argument("--out", help="path of the table (default: studies/dispatch.json)")
    sub.choices["dispatch"].add_argument(
        "--backward",
        action="store_true",
        help="also tune DK and DV swapped, where they differ: the shape of the backward's dq "
        "sweep, and of its dk sweep where dk and dv do not run fused (kernel.ops.backward), so that "
        "the table serves training",
    )
    sub.choices["run"].add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # of --gpus
    sub.choices["trials"].add_argument("--all-columns", action="store_true", help="every column of the log")
    sub.choices["best"].add_argument("--top", type=int, default=5, help="how many configs to print")
    sub.choices["export"].add_argument(
        "--out", help="path of the JSON (default: best.json in the study's folder)"
    )
    cmp = sub.choices["compare"]
    cmp.add_argument("--against", required=True, help="the yardstick study, in the same storage")
    cmp.add_argument("--remeasure", action="store_true", help="time both best configs again, alternately")
    cmp.add_argument("--out", help="also write the summary JSON here")
    report = sub.choices["report"]
    report.add_argument("--out", help="path of the HTML (default: report.html in the study's folder)")
    report.add_argument("--open", action="store_true", help="open the report in a web browser")
    probe = sub.choices["probe"]
    probe.add_argument("--config", default=SEED_CONFIG.label, help="C/bDV/stages/threads[/scores[/segments]]")
    probe.add_argument(
        "--arch", help=f"architectures, comma-separated, or all ({', '.join(ARCHS)}); default: this GPU's"
    )
    bench = sub.choices["bench"]
    _shape_flags(bench, "the shapes to time")
    bench.add_argument("--dispatch", help="a dispatch table (python -m tuner dispatch): its pick is 'tuned'")
    bench.add_argument(
        "--packed",
        type=int,
        default=BENCH_PACKED.sequences,
        help=f"sequences in the packed batch timed after the shapes, {BENCH_PACKED.shortest} to "
        f"{BENCH_PACKED.longest} tokens each, {BENCH_PACKED.heads} heads (0: none)",
    )
    bench.add_argument(
        "--no-backward", action="store_true", help="skip the backward and forward plus backward rows"
    )
    bench.add_argument(
        "--allow-mismatch",
        action="store_true",
        help="use a dispatch table measured in another environment (GPU, libraries or kernel code)",
    )
    bench.add_argument(
        "--out", default=str(STUDIES_DIR / "bench"), help="directory for bench.csv and bench.html"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "top", 1) < 1:
            raise UsageError(f"--top must be positive, got {args.top}")
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        return args.func(args)
    except (UsageError, ValueError) as exc:  # ExportError is a ValueError
        print(f"error: {exc}".splitlines()[0], file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)  # one line, however often Ctrl-C is pressed now
        print(
            "interrupted: finished trials are kept in the study; run the same command to go on",
            file=sys.stderr,
        )
        return 130
