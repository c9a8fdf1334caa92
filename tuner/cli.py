"""python -m tuner: tune the scalar-decay kernel with Optuna.

Subcommands: run (search), trials (print the trial log), best (the best configs),
export (write the best-config JSON), dispatch (tune several shapes, write the dispatch
table), compare (against a yardstick study), report (one offline HTML page), bench (tuned
vs seed vs fla vs torch over shapes). A user mistake prints one line and exits with 2.
"""

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import optuna

from kernel import KernelConfig, Problem
from kernel.config import HEADLINE
from kernel.deploy import ExportError, read_export
from tuner.bench import SHAPES
from tuner.study import (
    SAMPLERS,
    STUDIES_DIR,
    Options,
    Tuner,
    UsageError,
    best_trials,
    default_storage,
    default_study_name,
    get_storage,
)

# Defaults: the headline problem of DESIGN.md 6, B=8, H=16, S=4096, DK=DV=128, alpha=0.99, fp16.
DEFAULTS = HEADLINE.to_dict()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: one line, exit 2
        raise UsageError(f"{self.prog}: {message}")


def _study_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--study", "--study-name", dest="study", help="study name (default: derived from the problem)"
    )
    p.add_argument("--storage", default=None, help=f"Optuna storage URL (default: {default_storage()})")


def _problem_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dk", type=int, default=DEFAULTS["dk"], help="key/query head dim (default %(default)s)")
    p.add_argument("--dv", type=int, default=DEFAULTS["dv"], help="value head dim (default %(default)s)")
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"])
    p.add_argument("--heads", type=int, default=DEFAULTS["heads"])
    p.add_argument("--seqlen", type=int, default=DEFAULTS["seqlen"])
    p.add_argument("--alpha", type=float, default=DEFAULTS["alpha"], help="decay in (0, 1]")
    p.add_argument("--dtype", default=DEFAULTS["dtype"], help="float16 or bfloat16")


def _problem(args: argparse.Namespace) -> Problem:
    return Problem(args.batch, args.heads, args.seqlen, args.dk, args.dv, args.alpha, args.dtype)


def _config(text: str) -> KernelConfig:
    """'64/128/2/256/smem/8' -> KernelConfig (scores optional, default smem; segments
    optional, default 1)."""
    parts = text.split("/")
    if len(parts) not in (4, 5, 6):
        raise UsageError(f"--enqueue wants C/bDV/stages/threads[/scores[/segments]], got {text!r}")
    try:
        return KernelConfig(*map(int, parts[:4]), *parts[4:5], *map(int, parts[5:]))
    except ValueError as exc:
        raise UsageError(f"--enqueue {text}: {exc}") from None


def _configs_from(paths: list[str]) -> tuple[KernelConfig, ...]:
    """The configs of best-config JSON files (``export``), to measure first."""
    configs = []
    for path in paths:
        for entry in read_export(path)["configs"]:
            try:
                configs.append(KernelConfig.from_dict(entry["config"]))
            except (KeyError, TypeError, ValueError) as exc:
                raise UsageError(f"{path}: malformed config entry: {exc}") from None
    return tuple(configs)


def _where(args: argparse.Namespace) -> tuple[str, str]:
    """(study name, storage URL) from the flags, defaulting to the problem's study in studies/."""
    return args.study or default_study_name(_problem(args)), args.storage or default_storage()


def _open(args: argparse.Namespace, name: str | None = None) -> optuna.Study:
    default_name, storage = _where(args)
    name = name or default_name
    try:
        return optuna.load_study(study_name=name, storage=get_storage(storage))
    except KeyError:
        raise UsageError(f"no study {name!r} in {storage}") from None


def _options(args: argparse.Namespace) -> Options:
    return Options(
        n_trials=args.n_trials,
        timeout_s=args.timeout,
        sampler=args.sampler,
        multi_objective=args.multi_objective,
        tolerance=args.tolerance,
        max_spill_bytes=args.max_spill_bytes,
        max_registers=args.max_registers,
        trial_timeout_s=args.trial_timeout,
        workers=args.workers,
        seed=args.seed,
        enqueue=tuple(_config(c) for c in args.enqueue) + _configs_from(args.enqueue_from),
        wave_seeds=not args.no_wave_seeds,
        progress=not args.no_progress,
    )


def cmd_run(args: argparse.Namespace) -> int:
    name, storage = _where(args)
    tuner = Tuner(_problem(args), _options(args), name=name, storage=storage)
    if not tuner.gpu:
        print(
            "no CUDA device: compile-only exploration (probe resources, no latency is measured)",
            file=sys.stderr,
        )
    if tuner.interrupted:
        print(f"marked {tuner.interrupted} trial(s) of a killed run as failed", file=sys.stderr)
    study = _run_and_log(tuner)
    from tuner.trials import export_best

    out_dir = STUDIES_DIR / name
    try:
        data = export_best(study, out_dir / "best.json")
    except LookupError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    best = data["configs"][0]
    label = (
        "median {:.4f} ms".format(best["median_ms"])
        if data["mode"] == "gpu"
        else f"compile-only: {best['spill_bytes']} B spilled, {best['smem_bytes']} B smem, no latency measured"
    )
    print(f"best {best['config']} ({label}); exported {out_dir / 'best.json'}")
    return 0


def _run_and_log(tuner: Tuner) -> optuna.Study:
    """Run the study, then save its trial log (CSV and Parquet) next to its exports."""
    from tuner.trials import save_frame, trials_frame

    study = tuner.run()
    paths = save_frame(trials_frame(study), STUDIES_DIR / study.study_name / "trials")
    finished = sum(t.state.is_finished() for t in study.trials)
    queued = len(study.trials) - finished  # enqueued configs the next run measures first
    print(
        f"study {study.study_name!r}: {finished} trial{'s' * (finished != 1)}"
        + (f" ({queued} queued for the next run)" if queued else "")
        + f", {tuner.gpu_evaluations} GPU evaluations this run; log {', '.join(map(str, paths))}"
    )
    return study


def cmd_dispatch(args: argparse.Namespace) -> int:
    """Tune each shape in its own study (resumable, as ``run``), then write the dispatch
    table: the best config per shape, which ``kernel.deploy.load_dispatch`` serves by shape."""
    import torch

    from tuner.bench import parse_shapes
    from tuner.trials import export_dispatch

    shapes = parse_shapes(args.shapes)
    problems = [Problem(b, h, s, args.dk, args.dv, args.alpha, args.dtype) for b, h, s in shapes]
    out = Path(args.out) if args.out else STUDIES_DIR / "dispatch.json"
    if out.is_dir():
        raise UsageError(f"--out wants a file path for the table, got the directory {str(out)!r}")
    if not torch.cuda.is_available():
        raise UsageError("dispatch ranks configs by measured latency and needs a CUDA device")
    storage = args.storage or default_storage()
    options = _options(args)
    studies = [
        _run_and_log(Tuner(problem, options, name=default_study_name(problem), storage=storage))
        for problem in problems
    ]
    try:
        data = export_dispatch(studies, out)
    except LookupError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror or exc} (the studies are saved)") from None
    for entry in data["entries"]:
        p, c = entry["problem"], KernelConfig.from_dict(entry["config"])
        print(f"B*H={p['batch'] * p['heads']:>4} S={p['seqlen']:>6}: {c} {entry['median_ms']:.4f} ms")
    print(out)
    return 0


def cmd_trials(args: argparse.Namespace) -> int:
    from tuner.trials import trials_frame

    study = _open(args)
    frame = trials_frame(study)
    cols = [
        "number",
        "status",
        "chunk",
        "block_dv",
        "num_stages",
        "threads",
        "scores",
        "segments",
        "median_ms",
        "rel_l2",
        "spill_bytes",
        "smem_bytes",
        "reason",
    ]
    shown = frame if args.all_columns else frame[cols].assign(reason=frame.reason.str.slice(0, 60))
    print(_heading(study))
    print(shown.to_string(index=False))
    return 0


def _heading(study: optuna.Study) -> str:
    """The study's name and mode; a compile-only study says that nothing was timed."""
    mode = study.user_attrs.get("mode", "unknown mode")
    note = ": resources from the compiler, no latency measured" if mode == "compile-only" else ""
    return f"study {study.study_name!r} ({mode}{note})"


def cmd_best(args: argparse.Namespace) -> int:
    study = _open(args)
    best = best_trials(study)
    if not best:
        print(f"study {study.study_name!r} has no feasible, correct trial yet", file=sys.stderr)
        return 1
    print(_heading(study))
    for t in best[: args.top]:
        print(t.number, KernelConfig(**t.params), dict(zip(study.user_attrs.get("objectives", []), t.values)))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from tuner.trials import export_best

    study = _open(args)
    out = Path(args.out) if args.out else STUDIES_DIR / study.study_name / "best.json"
    try:
        export_best(study, out)
    except LookupError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    print(out)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """The study against a yardstick study (e.g. the exhaustive grid) of the same problem.

    With ``--remeasure`` on a GPU, both best configs are timed again, alternately, in this
    one process, so the final ratio does not depend on when each study ran.
    """
    from kernel.deploy import write_json
    from tuner.trials import compare, trials_frame

    study, yardstick = _open(args), _open(args, args.against)
    if study.user_attrs.get("problem") != yardstick.user_attrs.get("problem"):
        raise UsageError(f"{study.study_name!r} and {args.against!r} tuned different problems")
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
    """One self-contained HTML page of the study's fronts, knobs, failures and numerics."""
    from reports import write_report

    study = _open(args)
    out = Path(args.out) if args.out else STUDIES_DIR / study.study_name / "report.html"
    if out.is_dir() or out.suffix.lower() not in (".html", ".htm"):
        raise UsageError(f"--out wants an .html file path, got {str(out)!r}")
    if not study.trials:
        raise UsageError(f"study {study.study_name!r} has no trials yet: nothing to report")
    try:
        write_report(study, out)
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror or exc}") from None
    print(out)
    if args.open:
        import webbrowser

        if not webbrowser.open(out.resolve().as_uri()):
            print(f"no browser to open here; the report is {out}", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Tuned kernel, seed config, fla and plain torch over shapes, against the HBM floor."""
    import torch

    from kernel.deploy import load_dispatch
    from tuner.bench import bench_and_write, parse_shapes

    shapes = parse_shapes(args.shapes)
    Problem(1, 1, 1, args.dk, args.dv, args.alpha)  # validates dk, dv and alpha up front
    dispatch = load_dispatch(args.dispatch, allow_mismatch=args.allow_mismatch) if args.dispatch else None
    if not torch.cuda.is_available():
        raise UsageError("bench times kernels and needs a CUDA device; none is visible")
    bench_and_write(shapes, Path(args.out), dk=args.dk, dv=args.dv, alpha=args.alpha, dispatch=dispatch)
    return 0


def _remeasure(problem: Problem, mine: KernelConfig, theirs: KernelConfig, rounds: int = 3) -> dict:
    import torch

    from kernel import build
    from kernel.timing import alternating
    from kernel.validate import random_qkv

    if not torch.cuda.is_available():
        raise UsageError("--remeasure needs a CUDA device")
    q, k, v = random_qkv(problem, seed=12345)
    out = torch.empty_like(v)
    kernels = {"study": build(problem, mine), "yardstick": build(problem, theirs)}
    times = alternating(
        {name: partial(kern, q, k, v, out=out) for name, kern in kernels.items()}, rounds=rounds
    )
    med = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    return {"median_ms": med, "all_ms": times, "study_over_yardstick": med["study"] / med["yardstick"]}


def _tuning_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n-trials", type=int, default=40, help="trials this run adds to the study (default 40)")
    p.add_argument(
        "--timeout", type=float, default=None, help="stop asking for trials after this many seconds"
    )
    p.add_argument("--sampler", choices=SAMPLERS, default="tpe")
    p.add_argument("--multi-objective", action="store_true", help="minimise latency and error together")
    p.add_argument("--tolerance", type=float, default=2e-2, help="relative L2 bound against reference C")
    p.add_argument("--max-spill-bytes", type=int, default=0)
    p.add_argument("--max-registers", type=int, default=255)
    p.add_argument(
        "--trial-timeout", type=float, default=180.0, help="seconds before a GPU trial counts as hung"
    )
    p.add_argument(
        "--workers", type=int, default=None, help="parallel compile processes (default: CPU count)"
    )
    p.add_argument("--seed", type=int, default=0)
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
    p.add_argument(
        "--no-wave-seeds",
        action="store_true",
        help="skip the configs measured first for a grid of about one wave (tuner.space.wave_seeds)",
    )
    p.add_argument("--no-progress", action="store_true")


def _shape_flags(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--shapes",
        default=",".join("x".join(map(str, s)) for s in SHAPES),
        help=f"{what}: comma-separated BxHxS (default: %(default)s)",
    )
    p.add_argument("--dk", type=int, default=DEFAULTS["dk"])
    p.add_argument("--dv", type=int, default=DEFAULTS["dv"])
    p.add_argument("--alpha", type=float, default=DEFAULTS["alpha"])


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m tuner", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    commands: dict[str, tuple[Callable[[argparse.Namespace], int], str]] = {
        "run": (cmd_run, "run an Optuna study over the kernel's design space"),
        "trials": (cmd_trials, "print the trial log of a study"),
        "best": (cmd_best, "print the best configs of a study"),
        "export": (cmd_export, "write the best-config JSON of a study"),
        "compare": (cmd_compare, "compare a study with a yardstick study (e.g. the grid)"),
        "report": (cmd_report, "write one self-contained HTML report of a study (works offline)"),
    }
    for name, (func, help_text) in commands.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=func)
        _study_flags(p)
        _problem_flags(p)
    _tuning_flags(sub.choices["run"])
    dispatch = sub.add_parser(
        "dispatch", help="tune several shapes and write the dispatch table", description=cmd_dispatch.__doc__
    )
    dispatch.set_defaults(func=cmd_dispatch)
    _tuning_flags(dispatch)
    _shape_flags(dispatch, "the shapes to tune, one study each")
    dispatch.add_argument("--dtype", default=DEFAULTS["dtype"], help="float16 or bfloat16")
    dispatch.add_argument(
        "--storage", default=None, help=f"Optuna storage URL (default: {default_storage()})"
    )
    dispatch.add_argument("--out", help="path of the table (default: studies/dispatch.json)")
    sub.choices["trials"].add_argument("--all-columns", action="store_true")
    sub.choices["best"].add_argument("--top", type=int, default=5)
    sub.choices["export"].add_argument("--out", help="path of the JSON (default: studies/<study>/best.json)")
    bench = sub.add_parser("bench", help=cmd_bench.__doc__, description=cmd_bench.__doc__)
    bench.set_defaults(func=cmd_bench)
    _shape_flags(bench, "the shapes to time")
    bench.add_argument("--dispatch", help="a dispatch table (python -m tuner dispatch): its pick is 'tuned'")
    bench.add_argument(
        "--allow-mismatch",
        action="store_true",
        help="use a dispatch table measured in another environment (GPU, libraries or kernel source)",
    )
    bench.add_argument("--out", default="reports", help="directory for bench.csv and bench.html")
    cmp = sub.choices["compare"]
    cmp.add_argument("--against", required=True, help="the yardstick study, in the same storage")
    cmp.add_argument("--remeasure", action="store_true", help="time both best configs again, alternately")
    cmp.add_argument("--out", help="also write the summary JSON here")
    report = sub.choices["report"]
    report.add_argument("--out", help="path of the HTML (default: studies/<study>/report.html)")
    report.add_argument("--open", action="store_true", help="open the report in a web browser")
    return parser


def main(argv: list[str] | None = None) -> int:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        args = build_parser().parse_args(argv)
        _check_numbers(args)
        return args.func(args)
    except (UsageError, ExportError, ValueError) as exc:
        print(f"error: {exc}".splitlines()[0], file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "interrupted: finished trials are kept in the study; run the same command to go on",
            file=sys.stderr,
        )
        return 130


# flag -> smallest allowed value (None when unset means "no limit" or "the default")
_MINIMA = {
    "n_trials": 1,
    "workers": 1,
    "trial_timeout": 1e-3,
    "timeout": 1e-3,
    "tolerance": 1e-12,
    "max_spill_bytes": 0,
    "max_registers": 1,
    "top": 1,
}


def _check_numbers(args: argparse.Namespace) -> None:
    for name, minimum in _MINIMA.items():
        value = getattr(args, name, None)
        if value is not None and not value >= minimum:  # `not >=` also rejects NaN
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} must be {'positive' if minimum > 0 else '>= 0'}, got {value}")
