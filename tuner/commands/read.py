"""The commands that read a study back: ``trials``, ``best``, ``export``, ``compare`` and
``report``. None of them creates a storage or a study: a missing one is a ``UsageError``."""

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kernel.config import KernelConfig, Problem
from kernel.environment import env_key, environment
from kernel.files import write_json
from kernel.trial_schema import NO_MODEL, UNCALIBRATED
from tuner.commands.args import default_out, named, open_study, out_file
from tuner.lines import fit
from tuner.options import UsageError

if TYPE_CHECKING:
    import optuna
    import pandas as pd


def _heading(study: "optuna.Study", frame: "pd.DataFrame", arch: str | None = None) -> str:
    """The study's name, kernel and mode; a compile-only study says that nothing was timed.
    ``arch``: the architecture of the trials shown (default: the study's last run's)."""
    mode, arch = study.user_attrs.get("mode", "unknown mode"), arch or study.user_attrs.get("arch")
    where = f" for {arch}" if arch and mode == "compile-only" else f" on {arch}" if arch else ""
    note = ": no latency measured, ranked by predicted time" if mode == "compile-only" else ""
    by = frame.predicted_by.astype(str)
    if note and by.str.startswith(UNCALIBRATED).any():  # as its trials were ranked
        why = NO_MODEL if by.str.endswith(NO_MODEL).any() else "the latency model was not calibrated for it"
        if study.user_attrs.get("sweep") == "decode":
            why = "no latency model is fitted to the decode step"
        note += f" (the analytic part alone: {why})"
    sweep = study.user_attrs.get("sweep")
    kernel = {"dkdv": "the backward's fused dk+dv pass, ", "decode": "the decode step, "}.get(sweep, "")
    if (study.user_attrs.get("problem") or {}).get("gate") == "token":
        kernel = "the per-token gate's forward, "
    return f"study {study.study_name!r} ({kernel}{mode}{where}{note})"


def cmd_trials(args: argparse.Namespace) -> int:
    """Print the trial log of a study."""
    from tuner.trials import listing, trials_frame  # loads Optuna and pandas

    study = open_study(args)
    frame = trials_frame(study)
    print(fit(_heading(study, frame)))
    if frame.empty:
        print("no trials yet")
        return 0
    print(frame.to_string(index=False) if args.all_columns else listing(frame))
    return 0


def cmd_best(args: argparse.Namespace) -> int:
    """Print the best configs of a study, best first, as `trials` prints trials."""
    from tuner.trials import best_trials, listing, trials_frame  # loads Optuna and pandas

    study = open_study(args)
    env = _env(args, study)
    best = [t.number for t in best_trials(study, env)[: args.top]]
    if not best:
        print(f"study {study.study_name!r} has no feasible, correct trial yet", file=sys.stderr)
        return 1
    frame = trials_frame(study).set_index("number", drop=False).loc[best]
    print(fit(f"{_heading(study, frame, _saved_env(study, env).get('arch'))}, {_env_line(study, env)}"))
    print(listing(frame))
    return 0


def _env(args: argparse.Namespace, study: "optuna.Study") -> str | None:
    """The environment ``best``, ``export``, ``compare`` and ``report`` report
    (``tuner.trials.choose_env``)."""
    from tuner.trials import choose_env  # loads Optuna and pandas

    named(args, "env")
    return choose_env(study, args.env, lambda: env_key(environment()))


def _saved_env(study: "optuna.Study", env: str | None) -> dict:
    """The environment ``env`` (a key) as the study's trials recorded it; {} where none did."""
    from tuner.trials import environments  # loads Optuna and pandas

    return environments(study).get(env, (None, 0))[0] or {}


def _env_line(study: "optuna.Study", env: str | None) -> str:
    from tuner.trials import describe_env  # loads Optuna and pandas

    done = "compiled" if study.user_attrs.get("mode") == "compile-only" else "measured"
    return f"{done} in environment {describe_env(env, _saved_env(study, env) or None)}"


def cmd_export(args: argparse.Namespace) -> int:
    """Write the best-config JSON of a study (what ``kernel.ops.deploy.load_kernel`` loads)."""
    from tuner.export import export_best  # loads torch, Optuna and pandas

    out = out_file(args, default_out(args, "best.json"), (".json",))
    study = open_study(args)
    env = _env(args, study)
    try:
        export_best(study, out, env=env)
    except LookupError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror or exc}") from None
    print(fit(_env_line(study, env)), file=sys.stderr)
    print(out)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Compare a study with a yardstick study (e.g. the exhaustive grid) of the same problem,
    on the trials both measured in one environment (as ``best`` chooses it, ``--env``).

    With ``--remeasure`` on a GPU, both best configs are timed again, alternately, in this
    one process, so the final ratio does not depend on when each study ran.
    """
    from tuner.trials import choose_env, compare, trials_frame  # loads Optuna and pandas

    named(args, "against")
    out = out_file(args, Path(), (".json",)) if args.out else None
    study, yardstick = open_study(args), open_study(args, args.against)
    if study.user_attrs.get("problem") != yardstick.user_attrs.get("problem"):
        raise UsageError(f"{study.study_name!r} and {args.against!r} tuned different problems")
    for s in (study, yardstick):
        if s.user_attrs.get("mode") != "gpu":
            raise UsageError(f"study {s.study_name!r} is compile-only: it timed nothing to compare")
    env = _env(args, study)
    if env is not None:  # the yardstick's trials of the same environment, or one line naming its own
        choose_env(yardstick, env, lambda: env)
    try:
        summary = compare(trials_frame(study, env=env), trials_frame(yardstick, env=env))
    except LookupError as exc:
        print(f"{exc} ({study.study_name!r} against {args.against!r})", file=sys.stderr)
        return 1
    summary |= {"study": study.study_name, "yardstick": args.against, "env": env}
    print(fit(_env_line(study, env)), file=sys.stderr)
    if args.remeasure:
        from tuner.remeasure import remeasure  # loads torch and TileLang

        summary["remeasured"] = remeasure(
            Problem.from_dict(study.user_attrs["problem"]),
            KernelConfig(**summary["best_config"]),
            KernelConfig(**summary["yardstick_best_config"]),
        )
    if out is not None:
        try:
            write_json(out, summary)
        except OSError as exc:
            raise UsageError(f"cannot write {out}: {exc.strerror or exc}") from None
    print(json.dumps(summary, indent=1))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Write one self-contained HTML report of a study (works offline)."""
    from reports import StudyInfo, write_report  # loads plotly, pandas and Optuna
    from tuner.trials import environments, problem_trials, trials_frame

    out = out_file(args, default_out(args, "report.html"), (".html", ".htm"))
    study = open_study(args)
    if not study.trials:
        print(f"study {study.study_name!r} has no trials yet: nothing to report", file=sys.stderr)
        return 1
    env = None
    if args.env is not None or len(environments(study)) > 1:  # several GPU kinds: one's trials
        env = _env(args, study)
        print(fit(f"report of study {study.study_name!r}, {_env_line(study, env)}"), file=sys.stderr)
    frame = trials_frame(study, env=env)
    try:
        info = StudyInfo.from_attrs(study.study_name, study.user_attrs)
        write_report(frame, info, out, across=problem_trials(study))
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror or exc}") from None
    print(out)
    if args.open:
        import webbrowser  # a slow import; --open alone needs it

        if not webbrowser.open(out.resolve().as_uri()):
            print(f"no browser to open here; the report is {out}", file=sys.stderr)
    return 0
