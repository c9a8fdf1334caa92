"""What a command reads from its parsed flags: the problem, the tuning options, a config,
the study and its storage, and where the study's files go."""

import argparse
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernel.config import HEADLINE, KernelConfig, Problem
from kernel.constraints import size_error
from kernel.decode import DecodeCase, DecodeProblem
from tuner import options
from tuner.options import PROBLEM_FLAGS, Options, UsageError, check_writable, default_storage, parse_config

if TYPE_CHECKING:
    import optuna


def problem_of(args: argparse.Namespace, **fields: Any) -> Problem:
    """The problem of the flags (``tuner.options.PROBLEM_FLAGS``; the headline's where a
    command has no such flag), ``fields`` in place of theirs (a shape of ``--shapes``);
    ``UsageError`` naming the flag for ``--groups`` without ``--gate token`` or not dividing
    the heads, and for sizes no kernel takes (``kernel.constraints.size_error``)."""
    values = dataclasses.asdict(HEADLINE) | {f: getattr(args, f) for f in PROBLEM_FLAGS if hasattr(args, f)}
    values |= fields
    groups, heads = values["groups"], values["heads"]
    if groups is not None and values["gate"] != "token":
        raise UsageError("--groups needs --gate token: q and k in groups run the per-token gate's kernel")
    if groups is not None and not 1 <= groups <= heads or groups and heads % groups:
        raise UsageError(f"--groups {groups} must divide the heads, {heads}")
    problem = Problem(**values)
    if reason := size_error(problem):
        raise UsageError(reason)
    return problem


def decode_case_of(args: argparse.Namespace, batch: int, heads: int | None = None) -> DecodeCase:
    """The decode step of ``batch`` sequences of ``heads`` heads (default: ``--heads``), the
    flags' head sizes, dtype and ``--pool-dtype``, scaled by DK^-1/2 (fla's default) with
    int32 slots; ``UsageError`` for ``--seqlen`` given (a decode step has one token per
    sequence)."""
    if "seqlen" in getattr(args, "given", ()):
        raise UsageError("--seqlen does not apply to the decode step: it takes one token per sequence")
    if getattr(args, "gate", "head") != "head" or getattr(args, "groups", None) is not None:
        raise UsageError("the decode step's studies are of a constant decay: --gate token is not tuned there")
    try:
        problem = DecodeProblem(
            heads or args.heads, args.dk, args.dv, args.dtype, args.pool_dtype, "int32", args.dk**-0.5
        )
        return DecodeCase(batch, problem)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def configs_from(paths: list[str]) -> tuple[KernelConfig, ...]:
    """The configs of best-config JSON files (``export``), to measure first: each file's
    problem and every knob of each config given (``kernel.ops.deploy``'s checks); the
    problem may be another than the study's."""
    from kernel.ops.deploy import file_config, file_problem, json_object, read_export  # loads torch

    configs = []
    for path in paths:
        data = read_export(path)
        try:
            file_problem(data.get("problem"), "problem")
            for i, entry in enumerate(data["configs"]):
                configs.append(
                    file_config(json_object(entry, f"configs[{i}]").get("config"), f"configs[{i}].config")
                )
        except (TypeError, ValueError) as exc:
            raise UsageError(f"{path}: malformed entry: {exc}") from None
    return tuple(configs)


def options_of(args: argparse.Namespace) -> Options:
    """The tuning options of the flags; ``UsageError`` for a value outside its field's bounds,
    or a grace period no longer than the heartbeat."""
    values = {f.name: getattr(args, f.name) for f in options.fields()}
    for f in options.fields():
        minimum, maximum, value = f.metadata["minimum"], f.metadata["maximum"], values[f.name]
        if minimum is not None and value is not None and not value >= minimum:  # `not >=` rejects NaN
            raise UsageError(
                f"{options.flag(f)} must be {'positive' if minimum > 0 else '>= 0'}, got {value}"
            )
        if maximum is not None and value is not None and not value <= maximum:
            raise UsageError(f"{options.flag(f)} must be at most {maximum:g}, got {value}")
    if values["grace_s"] <= values["heartbeat_s"]:
        raise UsageError(
            f"--grace ({values['grace_s']} s) must be longer than --heartbeat ({values['heartbeat_s']} s): "
            "a live worker would count as dead"
        )
    enqueue = tuple(parse_config(c) for c in args.enqueue) + configs_from(args.enqueue_from)
    return Options(**values, enqueue=enqueue)


def named(args: argparse.Namespace, *flags: str) -> None:
    """``UsageError`` for a name flag given as the empty string."""
    for flag in flags:
        if getattr(args, flag, None) == "":
            raise UsageError(f"--{flag.replace('_', '-')} wants a name, got ''")


def where(args: argparse.Namespace) -> tuple[str, str]:
    """(study name, storage URL) from the flags, defaulting to the problem's study in studies/."""
    from tuner.studies import check_study_name, default_study_name  # loads Optuna

    named(args, "study", "storage", "for_gpu")
    sweep = getattr(args, "sweep", "forward")  # run's; the read-only commands name a dkdv study with --study
    return check_study_name(
        args.study or default_study_name(problem_of(args), sweep)
    ), args.storage or default_storage()


def exports(studies: Path, storage: str, name: str, *, write: bool = False) -> Path:
    """The folder of the study's files under ``studies``, keyed by storage and study
    (``tuner.studies.export_dir``); with ``write``, a ``UsageError`` where it could not be
    made or written (its nearest existing folder is read-only), before any work."""
    from tuner.studies import export_dir  # loads Optuna

    folder = export_dir(storage, name, studies)
    if write:
        check_writable(folder, "the study's files", f" ({options.STUDIES_VARIABLE} moves the studies folder)")
    return folder


def open_study(args: argparse.Namespace, name: str | None = None) -> "optuna.Study":
    """An existing study (read-only commands: a missing storage or study is a ``UsageError``,
    and so is a problem flag given beside ``--study`` that the study's problem contradicts)."""
    from tuner.studies import load_study  # loads Optuna

    default_name, storage = where(args)
    study = load_study(name or default_name, storage)
    saved = study.user_attrs.get("problem") or {}
    clash = [f for f in sorted(getattr(args, "given", ())) if f in saved and saved[f] != getattr(args, f)]
    if clash:
        flags = " ".join(f"--{f} {getattr(args, f)}" for f in clash)
        raise UsageError(
            f"study {study.study_name!r} was made for {Problem.from_dict(saved)}: {flags} contradicts it "
            "(drop the flag, or name another --study)"
        )
    return study


def default_out(args: argparse.Namespace, file: str) -> Path:
    """``file`` in the folder of the flags' study."""
    name, storage = where(args)
    return exports(args.studies_dir, storage, name) / file


def out_file(args: argparse.Namespace, default: Path, suffixes: tuple[str, ...]) -> Path:
    """``--out`` or ``default``: a file path with one of ``suffixes``, never a directory,
    nor under a file."""
    out = Path(args.out) if args.out else default
    if out.is_dir() or args.out and args.out.endswith(("/", "\\")) or out.suffix.lower() not in suffixes:
        raise UsageError(f"--out wants a {' or '.join(suffixes)} file path, got {str(args.out or out)!r}")
    blocked = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise UsageError(f"--out {str(out)!r}: {str(blocked)!r} is a file, not a folder")
    check_writable(out, "--out")
    return out
