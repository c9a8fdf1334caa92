"""tuner.storage, tuner.studies and tuner.liveness: storages, study names, and the trials
a killed run left running."""

import json
import os
import signal
import socket
import time

import optuna
import pytest
from helpers import SMALL_PROBLEM

from kernel import Problem
from tuner.cli import main
from tuner.liveness import HEARTBEAT_ATTR, fail_interrupted, fail_stale, record_heartbeat, unfinished_summary
from tuner.options import UsageError
from tuner.storage import get_storage
from tuner.studies import default_study_name, export_dir, load_study, open_study


def test_default_study_name_is_the_problem():
    assert default_study_name(SMALL_PROBLEM) == "b1-h2-s256-dk64-dv64-float16"
    assert json.loads(json.dumps(SMALL_PROBLEM.to_dict())) == SMALL_PROBLEM.to_dict()


def test_a_study_keeps_its_problem(tmp_path):
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    study = open_study(SMALL_PROBLEM, name="s", storage=storage)
    assert study.user_attrs["problem"] == SMALL_PROBLEM.to_dict()
    assert open_study(SMALL_PROBLEM, name="s", storage=storage).study_name == "s"  # resumed
    with pytest.raises(UsageError, match="study 's' was made for"):
        open_study(Problem(2, 2, 256, 64, 64), name="s", storage=storage)
    with pytest.raises(UsageError, match="no study 'other' in"):
        load_study("other", storage)


def test_a_study_tuned_with_one_alpha_is_not_resumed(tmp_path):
    """A study made before the decay became a run-time input measured the plain call at
    one alpha; the tuner now measures the model form, so a run refuses to add to it."""
    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    old = optuna.create_study(study_name="old", storage=storage)
    old.set_user_attr("problem", SMALL_PROBLEM.to_dict() | {"alpha": 0.99})
    with pytest.raises(UsageError, match=r"study 'old' was tuned with one compile-time alpha \(0.99\)"):
        open_study(SMALL_PROBLEM, name="old", storage=storage)
    with pytest.raises(UsageError, match="cannot open storage 'nosuchdb://x'"):
        get_storage("nosuchdb://x")


def test_trials_of_a_dead_process_are_marked_interrupted(tmp_path):
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'db.sqlite'}")
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    for pid in (dead, os.getpid()):  # a process that is gone, and this live one
        trial = study.ask()
        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("pid", pid)
    assert fail_interrupted(study) == 1
    first, second = study.get_trials()
    assert first.state == optuna.trial.TrialState.FAIL and first.user_attrs["status"] == "interrupted"
    assert f"process {dead} died" in first.user_attrs["reason"]
    assert second.state == optuna.trial.TrialState.RUNNING


def test_storage_strings_name_every_kind(tmp_path):
    from optuna.storages import JournalStorage, RDBStorage

    journal = tmp_path / "j.log"
    assert isinstance(get_storage(f"journal:{journal}"), JournalStorage) and journal.is_file()
    assert isinstance(get_storage(str(journal)), JournalStorage)  # a plain path, as optuna-dashboard
    db = tmp_path / "db.sqlite"
    optuna.create_study(study_name="x", storage=f"sqlite:///{db}")
    assert isinstance(get_storage(str(db)), RDBStorage)  # a plain path to an SQLite file
    assert load_study("x", str(db)).study_name == "x"
    with pytest.raises(UsageError, match="grpc://HOST:PORT wants a host and a port"):
        get_storage("grpc://nohost")


def test_a_grpc_storage_nothing_answers_at_says_it_waits_then_exits_2(tmp_path, capsys):
    port = _free_port()  # nothing listens there
    assert main(["trials", "--storage", f"grpc://127.0.0.1:{port}", "--study", "s"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"waiting up to 10 s for a gRPC storage proxy at grpc://127.0.0.1:{port}",
        f"error: no gRPC storage proxy answered at grpc://127.0.0.1:{port} in 10 s",
    ]


def test_the_grpc_proxy_serves_a_study(tmp_path):
    import subprocess
    import sys

    port = _free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import optuna, sys; optuna.storages.run_grpc_proxy_server("
            "optuna.storages.get_storage(sys.argv[1]), host='127.0.0.1', port=int(sys.argv[2]))",
            f"sqlite:///{tmp_path / 'db.sqlite'}",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        study = open_study(SMALL_PROBLEM, name="g", storage=f"grpc://127.0.0.1:{port}")
        assert study.user_attrs["problem"] == SMALL_PROBLEM.to_dict()
        assert load_study("g", f"grpc://127.0.0.1:{port}").user_attrs == study.user_attrs
    finally:
        server.kill()
        server.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _open_at_once(url: str, barrier) -> str:
    barrier.wait()
    try:
        open_study(SMALL_PROBLEM, name="s", storage=url)
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def _new_database(server: str) -> str:
    """The URL of a new, empty database on the PostgreSQL ``server``."""
    import uuid

    import sqlalchemy

    name = f"fresh_{uuid.uuid4().hex[:12]}"
    engine = sqlalchemy.create_engine(server, isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(sqlalchemy.text(f"CREATE DATABASE {name}"))
    engine.dispose()
    return f"{server.rsplit('/', 1)[0]}/{name}"


@pytest.mark.parametrize("kind", ["sqlite", "journal", "postgres"])
def test_processes_creating_one_new_storage_at_once_all_succeed(kind, tmp_path, request):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    url = {
        "sqlite": lambda: f"sqlite:///{tmp_path / 'new.db'}",
        "journal": lambda: f"journal:{tmp_path / 'new.log'}",
        "postgres": lambda: _new_database(request.getfixturevalue("postgres")),
    }[kind]()
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Manager().Barrier(4)
    with ProcessPoolExecutor(4, mp_context=ctx) as pool:
        results = list(pool.map(_open_at_once, [url] * 4, [barrier] * 4))
    assert results == ["ok"] * 4
    assert len(optuna.get_all_study_names(storage=get_storage(url))) == 1


@pytest.mark.parametrize(
    "url", ["sqlite:///{}/no.db", "journal:{}/no.log", "{}/no.log", "sqlite:///{}/d/no.db"]
)
def test_read_only_opening_never_creates_a_storage(url, tmp_path):
    url = url.format(tmp_path)
    with pytest.raises(UsageError, match="no storage at"):
        load_study("s", url)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "name", ["../../tmp/evil", "/abs", "a/../../b", "..", "", "a//b", "s/claim/x", "a\nb"]
)
def test_a_study_name_leaving_the_studies_folder_is_refused(name, tmp_path):
    with pytest.raises(UsageError, match="study name"):
        export_dir(f"sqlite:///{tmp_path / 'db'}", name, tmp_path)
    with pytest.raises(UsageError, match="study name"):
        open_study(SMALL_PROBLEM, name=name, storage=f"journal:{tmp_path / 'j.log'}")
    assert list(tmp_path.iterdir()) == []


def test_exports_are_keyed_by_storage_and_study(tmp_path):
    from tuner.options import default_storage

    a, b = f"sqlite:///{tmp_path / 'a.db'}", f"journal:{tmp_path / 'a.db'}"
    folders = {export_dir(url, "s", tmp_path) for url in (a, b, default_storage())}
    assert len(folders) == 3 and tmp_path / "s" in folders  # the default storage keeps studies/<study>
    assert export_dir(a, "s", tmp_path) == export_dir(f"sqlite:///{tmp_path}/./a.db", "s", tmp_path)
    assert all(f.resolve().is_relative_to(tmp_path) for f in folders)


@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_a_study_opens_in_optuna_dashboard(kind, tmp_path):
    """optuna-dashboard, started on loopback, serves the study back over its HTTP API."""
    import subprocess
    import sys
    import time
    import urllib.request

    from helpers import gpu_study

    url = f"journal:{tmp_path / 'j.log'}" if kind == "journal" else f"sqlite:///{tmp_path / 'db.sqlite'}"
    gpu_study([0.5, None, 0.3], storage=get_storage(url), name="dash")
    port = _free_port()
    target = str(tmp_path / "j.log") if kind == "journal" else url  # a plain path, as the README says
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from optuna_dashboard._cli import main; main()",
            target,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )

    def get(path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return json.loads(response.read())

    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                studies = get("/api/studies")["study_summaries"]
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, server.stderr.read()[-2000:]
                time.sleep(0.3)
        (study,) = [s for s in studies if s["study_name"] == "dash"]
        detail = get(f"/api/studies/{study['study_id']}")
        assert [t["state"] for t in detail["trials"]] == ["Complete", "Fail", "Complete"]
        assert detail["trials"][0]["values"] == [0.5]
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize("url", ["journal:{}/no/dir/j.log", "{}/no/dir/j.log", "sqlite:///{}/no/dir/a.db"])
def test_a_file_storage_in_a_missing_folder_exits_2_and_makes_none(url, tmp_path, capsys):
    """Every kind of file storage alike: a missing folder other than the studies folder is
    one line, where SQLite's made it and hid the new storage there."""
    argv = ["run", "--batch", "1", "--heads", "2", "--seqlen", "256", "--dk", "64", "--dv", "64"]
    assert main([*argv, "--storage", url.format(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no folder") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["journal:{}/decay-tuner.journal", "sqlite:///{}/decay-tuner.db"])
def test_the_studies_folder_is_made_for_a_storage_in_it(name, studies_dir):
    studies_dir.rmdir()
    get_storage(name.format(studies_dir))
    assert studies_dir.is_dir()


@pytest.mark.parametrize("command", ["run", "trials"])
def test_a_file_that_is_no_storage_exits_2_saying_so(command, tmp_path, capsys):
    bad = tmp_path / "bad.log"
    bad.write_bytes(bytes([0xD1, 0x00, 0xFF, 0x80]) * 64)
    for url in (str(bad), f"journal:{bad}"):
        assert main([command, "--storage", url, "--no-progress"][: 3 + (command == "run")]) == 2
        err = capsys.readouterr().err
        assert "is neither an Optuna journal file nor an SQLite database" in err, err
        assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_the_summary_counts_queued_running_and_dead_trials_apart(kind, tmp_path):
    """WAITING trials are queued; RUNNING ones are another worker's while it lives, a dead
    worker's once its process is gone from this host or its heartbeat is stale."""
    if kind == "journal":
        storage = get_storage(f"journal:{tmp_path / 'j.log'}")
    else:
        storage = get_storage(f"sqlite:///{tmp_path / 'db.sqlite'}", heartbeat_s=1, grace_s=1)
    study = optuna.create_study(study_name="s", storage=storage)
    dead_pid = os.fork()
    if dead_pid == 0:
        os._exit(0)
    os.waitpid(dead_pid, 0)
    stale, gone, live = (study.ask() for _ in range(3))
    for trial, pid in ((stale, 1), (gone, dead_pid), (live, os.getpid())):
        trial.set_user_attr("host", socket.gethostname() if trial is not stale else "elsewhere")
        trial.set_user_attr("pid", pid)
    if kind == "journal":
        storage.set_trial_system_attr(stale._trial_id, HEARTBEAT_ATTR, time.time() - 100)
    else:
        record_heartbeat(storage, stale._trial_id)
        time.sleep(2.2)  # past the grace period of 1 s
    for trial in (gone, live):
        record_heartbeat(storage, trial._trial_id)
    for n in (1, 2):
        study.enqueue_trial({"x": n}, skip_if_exists=False)
    assert unfinished_summary(study, grace_s=60) == (
        "2 queued for the next run, 1 running in another worker, 2 left by a dead worker"
    )
    for trial in (stale, gone, live, study.ask(), study.ask()):
        study.tell(trial, 1.0)
    assert unfinished_summary(study, grace_s=60) == ""


@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_a_trial_its_worker_died_asking_for_is_failed_and_queued_again(kind, tmp_path):
    """A worker killed between Optuna's ask and its first write leaves a RUNNING trial with
    no heartbeat, host or pid: it is dead once older than the grace period, and its config
    is queued again."""
    if kind == "journal":
        storage = get_storage(f"journal:{tmp_path / 'j.log'}")
    else:
        storage = get_storage(f"sqlite:///{tmp_path / 'db.sqlite'}", heartbeat_s=1, grace_s=1)
    study = optuna.create_study(study_name="s", storage=storage)
    orphan = study.ask({"x": optuna.distributions.IntDistribution(0, 9)})
    live = study.ask()
    live.set_user_attr("host", socket.gethostname())
    live.set_user_attr("pid", os.getpid())
    assert fail_stale(study, grace_s=60) == 0
    assert unfinished_summary(study, grace_s=60) == "2 running in another worker"
    time.sleep(1.2)
    assert unfinished_summary(study, grace_s=1) == "1 running in another worker, 1 left by a dead worker"
    assert fail_stale(study, grace_s=1) == 1
    failed = study.trials[orphan.number]
    assert failed.state == optuna.trial.TrialState.FAIL and failed.user_attrs["status"] == "interrupted"
    assert "as it asked" in failed.user_attrs["reason"]
    queued = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert [t.system_attrs["fixed_params"] for t in queued] == [failed.params]
    assert study.trials[live.number].state == optuna.trial.TrialState.RUNNING


def test_a_study_folder_that_cannot_be_made_is_refused_before_any_work(tmp_path, studies_dir):
    """The study named as its storage's file, or a studies folder that is a file: one line."""
    storage = f"sqlite:///{studies_dir / 'decay-tuner.db'}"  # the default storage
    for name in ("decay-tuner.db", "decay-tuner.db-journal", "decay-tuner.db-wal/x"):  # SQLite's files
        with pytest.raises(UsageError, match="names the storage's file"):
            export_dir(storage, name, studies_dir)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(UsageError, match="'.*afile' is a file .*DECAY_TUNER_STUDIES moves it"):
        export_dir(f"sqlite:///{tmp_path / 'db.sqlite'}", "s", afile)
    assert export_dir(storage, "s", studies_dir) == studies_dir / "s"


@pytest.mark.parametrize("command", ["run", "trials"])
@pytest.mark.parametrize("prefix", ["", "journal:"])
def test_a_folder_named_as_storage_exits_2_saying_so(command, prefix, tmp_path, capsys):
    assert main([command, "--storage", f"{prefix}{tmp_path}"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {str(tmp_path)!r} is a folder, not a storage: name a file in it, "
        f"e.g. {str(tmp_path / 'studies.journal')!r}"
    ]


def test_a_ctrl_c_during_a_journal_append_takes_effect_once_the_append_is_done(tmp_path, ctrl_c_raises):
    """Ctrl-C while a worker holds the journal's lock: the append finishes and drops the lock
    (others would wait 30 s for it to go stale), then the KeyboardInterrupt goes on."""
    storage = get_storage(f"journal:{tmp_path / 'j.log'}")
    lock = storage._backend._lock
    take = lock.acquire

    def take_then_ctrl_c() -> bool:
        taken = take()
        os.kill(os.getpid(), signal.SIGINT)  # as a terminal's Ctrl-C reaches the run
        return taken

    lock.acquire = take_then_ctrl_c
    with pytest.raises(KeyboardInterrupt):
        optuna.create_study(study_name="s", storage=storage)
    assert not os.path.lexists(lock._lock_file)
    lock.acquire = take
    assert optuna.get_all_study_names(get_storage(f"journal:{tmp_path / 'j.log'}")) == ["s"]
