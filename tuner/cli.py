"""python -m tuner: tune the scalar-decay kernel with Optuna.

A user mistake prints one line and exits with 2. Heavy libraries (torch, TileLang,
Optuna) load inside the command that needs them, so --help and argument errors answer at
once.
"""

import _thread
import argparse
import dataclasses
import inspect
import os
import signal
import sys
import threading
import time
import typing
from collections.abc import Callable
from typing import TextIO

from kernel.arch import ARCHS
from kernel.config import GATES, HEADLINE
from kernel.decode import POOL_DTYPES
from kernel.processes import Stop, sigterm_stops
from tuner import options
from tuner.commands.device import cmd_bench, cmd_probe, cmd_warmup
from tuner.commands.model import cmd_model
from tuner.commands.read import cmd_best, cmd_compare, cmd_export, cmd_report, cmd_trials
from tuner.commands.tune import cmd_dispatch, cmd_run
from tuner.latency import MODEL_BANDWIDTH
from tuner.options import BENCH_PACKED, BENCH_SHAPES, PROBLEM_FLAGS, STUDIES_DIR, UsageError, default_storage


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


class _Given(argparse.Action):
    """Stores a problem flag's value and notes it in ``given``: a flag a user typed, unlike a
    default, must agree with the study it reads (``tuner.commands.args.open_study``)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), self.dest}


def _problem_flags(p: argparse.ArgumentParser, names=tuple(PROBLEM_FLAGS)) -> None:
    defaults = dataclasses.asdict(HEADLINE)  # the gate's fields too, at a constant decay's
    for name in names:
        kind = int if name == "groups" else type(defaults[name])
        extra = {"choices": GATES} if name == "gate" else {}
        p.add_argument(
            f"--{name}", type=kind, default=defaults[name], action=_Given, help=PROBLEM_FLAGS[name], **extra
        )


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
    _problem_flags(p, ("dk", "dv", "dtype", "gate", "groups"))


def _decode_flags(run: argparse.ArgumentParser, dispatch: argparse.ArgumentParser) -> None:
    """The decode step's: its pool's dtype (run --sweep decode, dispatch --decode), and the
    numbers of sequences dispatch tunes it at."""
    for p in (run, dispatch):
        p.add_argument(
            "--pool-dtype", choices=POOL_DTYPES, default=POOL_DTYPES[0], help="the decode step's state pool"
        )
    dispatch.add_argument(
        "--decode",
        action="store_true",
        help="also tune the decode step (--sweep decode) of each head count of --shapes at --batches",
    )
    dispatch.add_argument(
        "--batches", default="1,8,64,256", help="with --decode: the numbers of sequences, comma-separated"
    )


# Subcommand -> (function, flag groups). The first line of the function's docstring is its help.
COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], tuple[Callable, ...]]] = {
    "run": (cmd_run, (_study_flags, _problem_flags, _tuning_flags, _gpus_flag)),
    "dispatch": (cmd_dispatch, (_storage_flags, _tuning_flags, _gpus_flag)),
    "trials": (cmd_trials, (_study_flags, _problem_flags)),
    "best": (cmd_best, (_study_flags, _problem_flags, _env_flag)),
    "export": (cmd_export, (_study_flags, _problem_flags, _env_flag)),
    "compare": (cmd_compare, (_study_flags, _problem_flags, _env_flag)),
    "report": (cmd_report, (_study_flags, _problem_flags, _env_flag)),
    "bench": (cmd_bench, ()),
    "probe": (cmd_probe, (_problem_flags,)),
    "warmup": (cmd_warmup, ()),
    "model": (cmd_model, ()),
}

# What a command interrupted by Ctrl-C leaves for the same command to go on from.
RESUMES = {
    "run": "finished trials are kept in the study",
    "dispatch": "finished trials are kept in their studies",
    "warmup": "the kernels compiled so far are in TileLang's disk cache",
}


def _plain(doc: str | None) -> str:
    """A docstring as help text: its indentation and its ``literal`` marks gone."""
    return inspect.cleandoc(doc or "").replace("``", "")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("decay-tuner")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command. Each command's arguments carry ``studies_dir``: the
    folder of the studies' files, ``STUDIES_DIR`` as it is when the parser is built."""
    parser = _Parser(prog="python -m tuner", description=_plain(__doc__), formatter_class=_Help)
    parser.set_defaults(studies_dir=STUDIES_DIR)
    parser.add_argument("--version", action="version", version=f"decay-tuner {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    for name, (func, groups) in COMMANDS.items():
        doc = _plain(func.__doc__)
        summary = " ".join(doc.split("\n\n")[0].split())
        p = sub.add_parser(name, help=summary, description=doc, formatter_class=_Help)
        p.set_defaults(func=func)
        for group in groups:
            group(p)
    _shape_flags(sub.choices["dispatch"], "the shapes to tune, one study each")
    sub.choices["dispatch"].add_argument(
        "--out", help="path of the table (default: dispatch.json in the studies folder)"
    )
    sub.choices["dispatch"].add_argument(
        "--backward",
        action="store_true",
        help="also tune DK and DV swapped, where they differ: the shape of the backward's dq "
        "sweep, and of its dk sweep where dk and dv do not run fused (kernel.ops.backward), so that "
        "the table serves training",
    )
    sub.choices["run"].add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # of --gpus
    _decode_flags(sub.choices["run"], sub.choices["dispatch"])
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
    probe.add_argument(
        "--config",
        help="C/bDV/stages/threads[/scores[/segments]] (default: each architecture's config of the rule "
        "kernel.rule.default_config for the problem)",
    )
    probe.add_argument(
        "--arch", help=f"architectures, comma-separated, or all ({', '.join(ARCHS)}); default: this GPU's"
    )
    warm = sub.choices["warmup"]
    _problem_flags(warm, ("heads", "dk", "dv", "dtype", "gate", "groups"))
    warm.add_argument("--backward", action="store_true", help="also the kernels of the backward's passes")
    warm.add_argument(
        "--arch", choices=list(ARCHS), help="the architecture to compile for; default: this GPU's"
    )
    warm.add_argument(
        "--dispatch",
        help="a dispatch table whose configs to compile, refused if tuned for another architecture "
        "(default: the table a process serves, DECAY_TUNER_TABLE's or the shipped one, else the rule)",
    )
    warm.add_argument("--workers", type=int, help="compile processes (default: one per CPU core)")
    model = sub.choices["model"]
    model.add_argument("action", choices=("fit", "show"), help="fit a model, or show the one in use")
    model.add_argument("--data", action="append", help="a sweep's JSON lines to fit to (repeatable)")
    model.add_argument("--storage", help="an Optuna storage whose GPU trials to fit to")
    model.add_argument(
        "--hold-out",
        help="shapes BxHxS[,...] judged on and never fitted to (default: each shape left out in turn, "
        "then a fit to all)",
    )
    model.add_argument(
        "--bandwidth",
        type=float,
        help="the GPU's copy rate in bytes/s, for the floor (default: that of the GPU the shipped model "
        f"was fitted on, {MODEL_BANDWIDTH:.3g})",
    )
    model.add_argument(
        "--out", help="path of the fitted model (default: latency_model.json in the studies' folder)"
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


def _ctrl_c_unraised(unraisable) -> None:
    """``sys.unraisablehook``: a Ctrl-C that lands in a finaliser or a weak reference's
    callback (SQLAlchemy's, Optuna's), where Python would print it and drop it, is raised
    again in the main thread a moment later, once the callback is done; anything else is
    printed as Python does."""
    if not issubclass(unraisable.exc_type, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)
        return

    def again() -> None:
        time.sleep(0.05)  # past the callback: raised there, it would be dropped again
        _thread.interrupt_main(Stop.signal)  # its handler's: SIGINT may be ignored, SIGTERM not

    threading.Thread(target=again, daemon=True).start()


class _ReaderMayLeave:
    """An output stream whose reader may go away (``run ... | tee log``, stopped by the same
    Ctrl-C): from then on what is written to it is dropped, where Python would raise a
    ``BrokenPipeError`` in the middle of what the command keeps."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop()

    def _drop(self) -> None:
        """Point the stream's file at /dev/null: its buffer and later writes go there."""
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self._stream.fileno())
        finally:
            os.close(null)

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    command = None
    sys.unraisablehook = _ctrl_c_unraised
    main_thread = threading.current_thread() is threading.main_thread()
    term = signal.signal(signal.SIGTERM, sigterm_stops) if main_thread else None
    Stop.signal = signal.SIGINT
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _ReaderMayLeave(out), _ReaderMayLeave(err)
    try:
        args = build_parser().parse_args(argv)
        command = args.command
        if getattr(args, "top", 1) < 1:
            raise UsageError(f"--top must be positive, got {args.top}")
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        return args.func(args)
    except (UsageError, ValueError) as exc:  # ExportError is a ValueError
        print(f"error: {exc}".splitlines()[0], file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if main_thread:  # one line, however often Ctrl-C is pressed or SIGTERM sent now
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        how = Stop.words()[0]
        kept = RESUMES.get(command)
        print(f"{how}: {kept}; run the same command to go on" if kept else how, file=sys.stderr)
        return 143 if Stop.signal == signal.SIGTERM else 130
    finally:
        sys.unraisablehook = sys.__unraisablehook__
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = out, err
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if term is None else term)
