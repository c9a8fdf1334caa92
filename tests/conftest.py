"""Test set-up: the gpu marker, a temporary studies folder for every test, Ctrl-C that
raises in this process, and a PostgreSQL server of the session's own."""

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped where there is none")


# Module-scoped fixtures that run a tuner, compiling: xdist runs a fixture once in each
# process that runs a test using it, so their tests share one process (``--dist
# loadgroup``, pyproject.toml), where the fixture runs once.
SHARED_ONCE = ("explored", "over_budget", "archs")


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items if config.pluginmanager.hasplugin("xdist") else ():
        for name in SHARED_ONCE:
            if name in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.xdist_group(name))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def studies_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The studies folder of this test, a temporary one (never the checkout's ``studies/``),
    for the processes it starts (``DECAY_TUNER_STUDIES``) and in this one: every loaded
    module's ``STUDIES_DIR``, which ``tuner.options`` reads from the environment at import
    and other modules import from it. The per-GPU latency models go to an empty folder of
    the test's too (``DECAY_TUNER_MODEL_CACHE``): a GPU test's run refits one, which would
    rank the next test's studies."""
    folder = tmp_path_factory.mktemp("studies")
    monkeypatch.setenv("DECAY_TUNER_STUDIES", str(folder))
    monkeypatch.setenv("DECAY_TUNER_MODEL_CACHE", str(tmp_path_factory.mktemp("latency-models")))
    for module in list(sys.modules.values()):
        if isinstance(getattr(module, "STUDIES_DIR", None), Path):
            monkeypatch.setattr(module, "STUDIES_DIR", folder)
    return folder


@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """Ctrl-C raises in this process for the test, as at a terminal: a shell that starts the
    tests as a background job (or ``nohup``) has them ignore SIGINT, where a test's
    ``os.kill(os.getpid(), signal.SIGINT)`` would do nothing."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def _pg_bin() -> Path | None:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    return versions[-1].parent if versions else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def postgres() -> Iterator[str]:
    """A PostgreSQL server of its own on a free loopback port; its SQLAlchemy URL."""
    bindir = _pg_bin()
    if bindir is None:
        if os.environ.get("DECAY_TUNER_REQUIRE_POSTGRES"):  # .ci/run sets it: CI never skips
            pytest.fail("no PostgreSQL server binaries, and DECAY_TUNER_REQUIRE_POSTGRES is set")
        pytest.skip("no PostgreSQL server binaries (.ci/run installs Debian's postgresql)")
    # Not under pytest's temporary folder: that is private to root, and the server runs as postgres.
    data = Path(tempfile.mkdtemp(prefix="decay-tuner-pg-")) / "data"
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses root: run the server as Debian's postgres user
        shutil.chown(data.parent, "postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    port = _free_port()
    run = lambda *cmd: subprocess.run([*as_user, *map(str, cmd)], check=True, capture_output=True)
    run(bindir / "initdb", "-D", data, "-A", "trust", "-U", "postgres")
    opts = f"-p {port} -k {data.parent} -c listen_addresses=127.0.0.1"
    run(bindir / "pg_ctl", "-D", data, "-o", opts, "-l", data.parent / "log", "-w", "start")
    # Where this process dies before its teardown (a timeout killed the tests), a watchdog
    # stops the server and removes its folder: no server outlives the tests.
    stop = shlex.join(map(str, [*as_user, bindir / "pg_ctl", "-D", data, "-m", "immediate", "stop"]))
    watch = f"while kill -0 {os.getpid()}; do sleep 1; done; {stop}; rm -rf {shlex.quote(str(data.parent))}"
    quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    subprocess.Popen(["sh", "-c", watch], start_new_session=True, **quiet)
    yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres"
    run(bindir / "pg_ctl", "-D", data, "-m", "immediate", "stop")
    shutil.rmtree(data.parent, ignore_errors=True)
