"""kernel.ops.tables: which table a process serves when its model names none."""

import json

import pytest
from helpers import dispatch_file

from kernel import KernelConfig, Problem
from kernel.arch import ARCHS
from kernel.config import Call
from kernel.environment import GATED_MODULES, environment, kernel_key
from kernel.ops import serve
from kernel.ops.deploy import ExportError
from kernel.ops.dispatch import load_dispatch
from kernel.ops.tables import SHIPPED, TABLE_VARIABLE, default_table, shipped_table

PROBLEM = Problem(4, 16, 8192, 128, 128, "bfloat16")
TUNED = KernelConfig(64, 64, 3, 256, segments=2)  # not the rule's config for PROBLEM


@pytest.fixture
def fresh_server():
    """Each test starts as a new process does, and leaves the next one the same."""
    serve.use_table(serve.DEFAULT)
    yield
    serve.use_table(serve.DEFAULT)


def test_every_shipped_table_is_tuned_for_these_kernels():
    """The stale policy: a change to the kernels' code re-tunes the shipped tables in the
    same change (docs/ops.md). Each is a dispatch table of one GPU model and architecture,
    forward and fused-pass entries, measured on these kernels. (None ships today:
    docs/evidence.md#rule-family says why.)"""
    for path in sorted(SHIPPED.glob("*.json")):
        table = load_dispatch(path, allow_mismatch=True)
        env = table.environment
        assert env["kernel"] == kernel_key(), f"{path.name} is stale: re-tune it (docs/ops.md)"
        gated = {e.kernel for e in table.entries if e.problem.gate == "token"}
        assert gated <= {kernel_key(modules=GATED_MODULES)}, f"{path.name}'s gated entries are stale"
        assert env["arch"] in ARCHS and env["gpu"], path.name
        assert {e.sweep for e in table.entries} == {"forward", "dkdv"}, path.name


def test_a_shipped_table_serves_only_its_gpu_architecture_and_kernels(tmp_path):
    here = environment("sm_90a") | {"gpu": "NVIDIA H200"}
    path = dispatch_file(tmp_path, [(PROBLEM, TUNED)], environment=here)
    assert shipped_table(here, tmp_path).pick(PROBLEM).config == TUNED
    assert shipped_table(here | {"gpu": None}, tmp_path) is not None  # compiling ahead, no GPU
    assert shipped_table(here | {"torch": "2.99"}, tmp_path) is not None  # noted, not refused
    assert shipped_table(here | {"arch": "sm_80"}, tmp_path) is None
    assert shipped_table(here | {"gpu": "NVIDIA H100 80GB HBM3"}, tmp_path) is None
    with pytest.warns(UserWarning, match="not served"):
        assert shipped_table(here | {"kernel": "0" * 12}, tmp_path) is None
    path.write_text(json.dumps(json.loads(path.read_text()) | {"environment": here | {"arch": "sm_80"}}))
    assert shipped_table(here, tmp_path) is None


def test_the_users_table_comes_before_the_shipped_one(tmp_path, monkeypatch, fresh_server):
    """``DECAY_TUNER_TABLE`` names a table served before the shipped one, and
    ``use_table`` overrides both: ``None`` serves the rule alone."""
    path = dispatch_file(tmp_path, [(PROBLEM, TUNED)], environment=environment("sm_90a"))
    monkeypatch.setenv(TABLE_VARIABLE, str(path))
    call = Call(128**-0.5, False, True)
    assert serve.kernel_job(PROBLEM, call, 4, arch="sm_90a", sms=132)[1] == TUNED
    serve.use_table(None)
    rule = serve.kernel_job(PROBLEM, call, 4, arch="sm_90a", sms=132)[1]
    assert rule != TUNED
    monkeypatch.setenv(
        TABLE_VARIABLE, str(dispatch_file(tmp_path, [(PROBLEM, TUNED)], environment={"arch": "sm_80"}))
    )
    with pytest.raises(
        ExportError, match="DECAY_TUNER_TABLE: .* tuned for sm_80"
    ):  # names where it came from
        default_table("sm_90a")
    with pytest.raises(ExportError, match="cannot read dispatch table shipped"):
        serve.use_table("shipped")  # a string names a table file
    with pytest.raises(
        ValueError, match="use_table wants a Dispatch, a table file's path, None or 'default'"
    ):
        serve.use_table(123)


def test_a_corrupt_user_table_is_refused_by_name_and_never_served(tmp_path, monkeypatch, fresh_server):
    path = dispatch_file(tmp_path, [(PROBLEM, TUNED)], environment=environment("sm_90a"))
    path.write_text(path.read_text()[:-40])
    monkeypatch.setenv(TABLE_VARIABLE, str(path))
    call = Call(128**-0.5, False, True)
    for _ in range(2):  # every call is refused, not only the first
        with pytest.raises(ExportError, match=f"DECAY_TUNER_TABLE: cannot read dispatch table {path}"):
            serve.kernel_job(PROBLEM, call, 4, arch="sm_90a", sms=132)
