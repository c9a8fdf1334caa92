"""A study in a storage (``tuner.storage``): its name, the folder of its files, opening
it for a run (and recording what its trials are), and loading it for the commands that
read it."""

import dataclasses
import hashlib
from pathlib import Path

import optuna
from optuna.storages import BaseStorage

from kernel import formats
from kernel.config import KernelConfig, Problem
from kernel.decode import DecodeCase
from tuner.options import STUDIES_DIR, STUDIES_VARIABLE, UsageError, default_storage
from tuner.storage import get_storage, storage_key

# Where claims (``tuner.claims``) live inside a study's name; refused in a user's study name.
CLAIM_MARK = "/claim/"
STORAGES = "storages"  # the studies folder's folder of other storages' study files
# What a file storage keeps beside its file, which no study's folder may take: SQLite's
# journals, and the lock of Optuna's journal file
BESIDE = {"sqlite": ("-journal", "-wal", "-shm"), "journal": (".lock",)}


def forward_study_name(problem: Problem, sweep: str = "forward") -> str:
    """``b8-h16-s4096-dk128-dv128-float16``, then ``-gated`` for a per-token gate (and
    ``-g1`` for its groups) and ``-dkdv`` for the fused pass's sweep."""
    p = problem
    gate = ("-gated" + (f"-g{p.groups}" if p.groups else "")) if p.gate == "token" else ""
    return f"b{p.batch}-h{p.heads}-s{p.seqlen}-dk{p.dk}-dv{p.dv}-{p.dtype}{gate}" + (
        "-dkdv" if sweep == "dkdv" else ""
    )


def check_study_name(name: str) -> str:
    """``name``, or a ``UsageError`` when it is unusable as a folder of the studies folder:
    one that leaves it, one under ``STORAGES``, where other storages' studies write, or one
    with a character that does not print."""
    parts = name.replace("\\", "/").split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts) or CLAIM_MARK in name:
        raise UsageError(
            f"study name {name!r} would leave the studies folder (or is reserved): "
            "use names joined by '/', none of them empty, '.' or '..'"
        )
    if parts[0] == STORAGES:
        raise UsageError(
            f"study name {name!r} is reserved: the studies folder's {STORAGES}/ holds the files of "
            "studies in other storages"
        )
    if not name.isprintable():
        raise UsageError(f"study name {name!r} holds a character that does not print: it names folders")
    return name


def export_dir(storage: str, name: str, studies: Path | None = None) -> Path:
    """The folder of a study's files (trials.csv, best.json, report.html): ``STUDIES/<study>``
    for the default storage, ``STUDIES/storages/<storage>/<study>`` for any other, so two
    storages holding a study of the same name never write to the same files."""
    studies = STUDIES_DIR if studies is None else studies
    check_study_name(name)
    key = storage_key(storage)
    if key == storage_key(default_storage()):
        root = studies
    else:
        stem = (
            Path(key.split(":", 1)[-1]).stem if key.startswith(("sqlite:", "journal:")) else key.split(":")[0]
        )
        root = studies / STORAGES / f"{stem}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    out = (root / name).resolve()
    if not out.is_relative_to(studies.resolve()):
        raise UsageError(f"study name {name!r} would leave the studies folder {str(studies)!r}")
    if key.startswith(("sqlite:", "journal:")):
        kind, file = key.split(":", 1)
        taken = {file + end for end in ("", *BESIDE[kind])}
        if clash := next((p for p in (out, *out.parents) if str(p) in taken), None):
            raise UsageError(
                f"study name {name!r} names the storage's file {str(clash)!r}: choose another --study"
            )
    blocked = next((p for p in (root / name, *(root / name).parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise UsageError(
            f"the study's folder {str(root / name)!r} cannot be made: {str(blocked)!r} is a file "
            f"(the studies folder is {str(studies)!r}; {STUDIES_VARIABLE} moves it)"
        )
    return root / name


def open_study(
    problem: Problem,
    *,
    name: str,
    storage: str | BaseStorage,
    sampler: optuna.samplers.BaseSampler | None = None,
    directions: list[str] | None = None,
) -> optuna.Study:
    """Create the study, or load it when it exists (resuming a killed run, or joining the
    workers already on it)."""
    check_study_name(name)
    backend = get_storage(storage) if isinstance(storage, str) else storage
    try:
        study = optuna.create_study(
            study_name=name,
            storage=backend,
            sampler=sampler,
            directions=directions or ["minimize"],
            load_if_exists=True,
        )
    except ValueError as exc:  # e.g. the study exists with other directions
        raise UsageError(f"cannot open study {name!r}: {exc}") from None
    record = _check_ours(study, storage if isinstance(storage, str) else None)
    saved = record.get("problem")
    if saved is None:
        study.set_user_attr(formats.STUDY_VERSION_ATTR, formats.VERSIONS[formats.STUDY])
        study.set_user_attr("problem", problem.to_dict())
    elif record.get("decays"):
        raise UsageError(
            f"study {name!r} was tuned with one compile-time alpha ({record['decays'][0]}) and the plain "
            "call; the tuner now measures the model form (kernel.config.model_call): use another --study"
        )
    elif saved != problem.to_dict():
        raise UsageError(f"study {name!r} was made for {describe_problem(saved)}, not {problem}")
    return study


def describe_problem(saved: dict) -> str:
    """A study's recorded problem in words: the forward's, or the decode step's (its
    ``pool_dtype``, ``kernel.decode.DecodeCase``)."""
    return str(DecodeCase.from_dict(saved) if "pool_dtype" in saved else Problem.from_dict(saved))


def default_study_name(problem: Problem | DecodeCase, sweep: str = "forward") -> str:
    """The name of ``problem``'s study of ``sweep``."""
    if isinstance(problem, DecodeCase):
        p = problem.problem
        return f"n{problem.batch}-h{p.heads}-dk{p.dk}-dv{p.dv}-{p.dtype}-pool-{p.pool_dtype}-decode"
    return forward_study_name(problem, sweep)


def load_study(name: str, storage: str) -> optuna.Study:
    """An existing study; ``UsageError`` naming the study and storage when there is none.
    Creates nothing, not even an empty storage."""
    check_study_name(name)
    try:
        study = optuna.load_study(study_name=name, storage=get_storage(storage, create=False))
    except KeyError:
        raise UsageError(f"no study {name!r} in {storage}") from None
    _check_ours(study, storage)
    return study


KNOBS = frozenset(f.name for f in dataclasses.fields(KernelConfig))


def _check_ours(study: optuna.Study, storage: str | None) -> dict:
    """The study's record (``kernel.formats.study_record``: its sweep is left unread); a
    ``UsageError`` for a study of another program in the storage (trials but no problem
    recorded, which ``open_study`` records before any trial: named by its parameters that
    are no knobs) or of a record version this tool does not read. A study of ours reads no
    trial here."""
    try:
        record = formats.study_record(study.user_attrs, name=study.study_name)
    except formats.FormatError as exc:
        raise UsageError(str(exc)) from None
    if record.get("problem") is not None:
        return record
    trials = study.get_trials(deepcopy=False)
    if trials:
        params = {p for t in trials for p in (t.params or t.system_attrs.get("fixed_params", {}))}
        why = f"parameters {sorted(params - KNOBS)}" if params - KNOBS else "no problem recorded"
        where = f" in {storage}" if storage else ""
        raise UsageError(f"study {study.study_name!r}{where} is no decay-tuner study ({why})")
    return record


def hold(
    study: optuna.Study,
    storage: str,
    *,
    objectives: list[str],
    sweep: str,
    mode: str,
    arch: str,
    ranked_by: str | None = None,
) -> None:
    """Record in ``study`` what a run's trials are (their objectives, the kernel's sweep, the
    mode, the architecture of its last run); a ``UsageError`` when it holds trials of other
    objectives, of another sweep, or ranked by another latency model (compile-only,
    ``ranked_by`` the model's ``key``: ranks of two models do not compare). Workers on
    other architectures or GPUs may share a study: their trials stay apart by environment."""
    name = study.study_name
    held_objectives = study.user_attrs.get("objectives", objectives)
    if held_objectives != objectives:
        why = (
            "ranked by spill bytes, as decay-tuner did before its latency model"
            if held_objectives == ["spill_bytes"]
            else f"holding {held_objectives} trials"
        )
        raise UsageError(
            f"study {name!r} is {why}; this run records {objectives} ({mode} mode): use another "
            f"--study, or delete it (optuna delete-study --study-name {name} --storage {storage})"
        )
    trials = lambda: bool(study.get_trials(deepcopy=False))  # noqa: E731
    held = formats.study_record(study.user_attrs, name=name, has_trials=trials)["sweep"]
    if held not in (None, sweep):
        raise UsageError(
            f"study {name!r} tunes the {held} kernel; this run asks for --sweep {sweep}: use another --study"
        )
    held_model = study.user_attrs.get("ranked_by")
    if mode == "compile-only" and held_model not in (None, ranked_by) and study.get_trials(deepcopy=False):
        raise UsageError(
            f"study {name!r} was ranked by the latency model {held_model}; the model in use is "
            f"{ranked_by} (DECAY_TUNER_LATENCY_MODEL or --for-gpu chooses it), and the ranks of two "
            "models do not compare: use another --study"
        )
    if mode == "compile-only":
        study.set_user_attr("ranked_by", ranked_by)
    for key, value in (("sweep", sweep), ("objectives", objectives), ("mode", mode), ("arch", arch)):
        study.set_user_attr(key, value)
