"""kernel.ops.autotune: tuning on first use into the user's table, one process per bucket."""

import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from helpers import child_env, dispatch_file

from kernel import KernelConfig, Problem
from kernel.config import Call
from kernel.ops import autotune, serve
from kernel.ops.deploy import ExportError
from kernel.ops.dispatch import load_dispatch

PROBLEM = Problem(2, 8, 4096, 128, 128, "bfloat16")
TUNED = KernelConfig(64, 64, 3, 256, segments=2)


@pytest.fixture
def fresh_server():
    serve.use_table(serve.DEFAULT)
    autotune._failed.clear()
    yield
    serve.use_table(serve.DEFAULT)
    autotune._failed.clear()


def test_an_entry_covers_the_calls_within_one_doubling(tmp_path):
    table = load_dispatch(dispatch_file(tmp_path, [(PROBLEM, TUNED)]), allow_mismatch=True)
    assert autotune.covered(table, PROBLEM)
    assert autotune.covered(table, Problem(4, 8, 4096, 128, 128, "bfloat16"))  # B*H doubled
    assert autotune.covered(table, Problem(2, 8, 2048, 128, 128, "bfloat16"))  # S halved
    assert not autotune.covered(table, Problem(4, 8, 8192, 128, 128, "bfloat16"))  # both: 2 away
    assert not autotune.covered(table, Problem(2, 8, 4096, 128, 128, "float16"))  # another dtype
    assert not autotune.covered(table, Problem(2, 8, 4096, 64, 64, "bfloat16"))  # another head size
    assert not autotune.covered(None, PROBLEM)


def test_merge_adds_entries_and_replaces_a_retuned_one(tmp_path):
    old = json.loads(dispatch_file(tmp_path, [(PROBLEM, TUNED)]).read_text())
    other = Problem(1, 8, 32768, 128, 128, "bfloat16")
    new = json.loads(
        dispatch_file(tmp_path, [(other, TUNED), (PROBLEM, KernelConfig(64, 128, 2, 256))]).read_text()
    )
    merged = autotune.merge(old, new)
    assert [e["problem"]["seqlen"] for e in merged["entries"]] == [32768, 4096]
    assert merged["entries"][1]["config"]["block_dv"] == 128
    assert autotune.merge(None, new) == new
    elsewhere = new | {"environment": new["environment"] | {"arch": "sm_80"}}
    with pytest.raises(ExportError, match="arch"):
        autotune.merge(old, elsewhere)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU would run the study: tests/test_autotune_gpu")
def test_a_study_that_yields_nothing_warns_once_and_serves_the_rule(tmp_path, monkeypatch, fresh_server):
    """Without a GPU, the real ``dispatch`` child refuses: the call falls back to the rule
    with one warning, the table file is not written, and the bucket is not tried again. The
    child is the project's tuner, whatever ``tuner/`` the caller's working directory holds."""
    (tmp_path / "tuner").mkdir()
    (tmp_path / "tuner" / "__init__.py").write_text("")
    (tmp_path / "tuner" / "__main__.py").write_text("print('not the project')\n")
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "mine.json"
    with pytest.warns(UserWarning, match="tuning on first use at .* gave no config .*needs a CUDA device"):
        assert autotune.tuned(path, PROBLEM, None) is None
    assert not path.exists()
    assert json.loads((tmp_path / "mine.json.failed.json").read_text()) == [PROBLEM.to_dict()]
    monkeypatch.setattr(autotune, "_study", lambda *_: pytest.fail("a second study of a failed bucket"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert autotune.tuned(path, PROBLEM, None) is None  # no second study, no second warning
        assert autotune.tuned(path, Problem(2, 8, 3000, 128, 128, "bfloat16"), None) is None  # its bucket
    autotune._failed.clear()  # another process: the failure kept beside the table stops it too
    with pytest.warns(
        UserWarning, match=r"a study of its bucket failed before \(delete .*mine.json.failed.json"
    ):
        assert autotune.tuned(path, PROBLEM, None) is None


def test_a_table_that_cannot_be_written_warns_and_serves_the_table_as_it_is(tmp_path, fresh_server):
    """A table path under a file (an OSError before any study): one warning, no exception,
    and the call's bucket is left to the rule (the table covers it not)."""
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    far = load_dispatch(dispatch_file(tmp_path, [(Problem(1, 8, 65536, 128, 128, "bfloat16"), TUNED)]))
    with pytest.warns(UserWarning, match=r"gave no config \((NotADirectoryError|FileExistsError)"):
        assert autotune.tuned(blocker / "mine.json", PROBLEM, far) is far
    assert not autotune.covered(far, PROBLEM)


def test_the_switch_reads_on_and_off_and_refuses_a_guess(monkeypatch, capsys):
    """``DECAY_TUNER_AUTOTUNE=false`` turns tuning off, as a user means it; a value that is
    neither on nor off is one clear error, from Python and from the CLI, not a guess."""
    from tuner.cli import main

    for value, on in {"1": True, "TRUE": True, "on": True, "0": False, "false": False, "Off": False}.items():
        monkeypatch.setenv(autotune.AUTOTUNE_VARIABLE, value)
        assert autotune.enabled() is on
    monkeypatch.delenv(autotune.AUTOTUNE_VARIABLE)
    assert not autotune.enabled()
    monkeypatch.setenv(autotune.AUTOTUNE_VARIABLE, "maybe")
    said = r"wants 1, true, yes or on \(on\), or 0, false, no or off \(off\), got 'maybe'"
    with pytest.raises(ValueError, match=said):
        autotune.enabled()
    assert main(["warmup", "--arch", "sm_90a", "--heads", "4", "--dk", "64", "--dv", "64"]) == 2
    err = capsys.readouterr().err
    assert "DECAY_TUNER_AUTOTUNE wants" in err and err.count("\n") == 1


def test_compiling_ahead_neither_needs_the_table_yet_nor_fixes_the_process_s_table(
    tmp_path, monkeypatch, fresh_server
):
    """With tuning on first use on, compiling ahead (``warmup``) before the table file exists
    serves the rule, and with it serves the table; neither is kept, so the process's first
    call on its GPU still finds the table to tune into."""
    path = tmp_path / "mine.json"
    monkeypatch.setenv(autotune.AUTOTUNE_VARIABLE, "1")
    monkeypatch.setenv("DECAY_TUNER_TABLE", str(path))
    call = Call(128**-0.5)
    rule = serve.kernel_job(PROBLEM, call, 2, arch="sm_90a", sms=132)[1]
    assert rule != TUNED and serve._SERVER.table == serve.DEFAULT and serve._SERVER.autotune is None
    dispatch_file(tmp_path, [(PROBLEM, TUNED)], environment=serve.environment("sm_90a"))
    path.write_text((tmp_path / "dispatch.json").read_text())
    assert serve.kernel_job(PROBLEM, call, 2, arch="sm_90a", sms=132)[1] == TUNED
    assert serve._SERVER.table == serve.DEFAULT


def test_a_second_process_waits_for_the_first_and_finds_its_entry(tmp_path, fresh_server):
    """Process A holds the table's lock while it writes an entry; process B, asking for the
    same bucket meanwhile, waits, then serves A's entry without a study of its own (on a
    machine without a GPU a study would warn: B must not)."""
    path = tmp_path / "mine.json"
    entry = dispatch_file(tmp_path, [(PROBLEM, TUNED)]).read_text()
    writer = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from kernel.ops import autotune
        path = Path({str(path)!r})
        with autotune._locked(path):
            print("locked", flush=True)
            time.sleep(3)
            __import__("kernel.files").files.write_json(path, __import__("json").loads({entry!r}))
        """
    )
    reader = textwrap.dedent(
        f"""
        import warnings
        from pathlib import Path
        from kernel import Problem
        from kernel.ops import autotune
        warnings.simplefilter("error")
        table = autotune.tuned(Path({str(path)!r}), Problem(*{tuple(PROBLEM.to_dict().values())!r}), None)
        print(table.entries[0].config.label)
        """
    )
    env = child_env()
    a = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True, env=env)
    assert a.stdout.readline().strip() == "locked"
    b = subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True, env=env, timeout=120)
    assert a.wait(timeout=60) == 0
    assert b.returncode == 0, b.stderr[-2000:]
    assert b.stdout.strip() == TUNED.label


def test_use_table_with_autotune_takes_a_path(tmp_path, fresh_server):
    with pytest.raises(ValueError, match="takes the path"):
        serve.use_table(None, autotune=True)
    with pytest.raises(ValueError, match="autotune must be True or False, got 'no'"):
        serve.use_table(tmp_path / "nothing.json", autotune="no")
    with pytest.raises(ExportError, match="nothing.json"):
        serve.use_table(tmp_path / "nothing.json")  # no autotune: the file must exist
    serve.use_table(tmp_path / "nothing.json", autotune=True)  # tuned into on first use
    assert serve.served_table() is None and serve._SERVER.autotune == tmp_path / "nothing.json"
    path = dispatch_file(tmp_path, [(PROBLEM, TUNED)])
    serve.use_table(str(path))
    assert serve.kernel_job(PROBLEM, Call(128**-0.5), 2, arch="sm_90a", sms=132)[1] == TUNED


@pytest.mark.gpu
def test_gpu_a_first_call_tunes_its_shape_and_a_second_process_serves_it(tmp_path):
    """A process with tuning on first use meets a new shape: it runs one study, writes the
    entry into the table and serves it, correct against reference C; a second process
    serves the same shape from the table without a study (the file is not rewritten)."""
    path = tmp_path / "mine.json"
    script = textwrap.dedent(
        """
        import time, torch
        import refs
        from kernel.builder import constant_decay
        from kernel.config import retnet_decay
        from kernel.ops import decay_attention
        q, k, v = (torch.randn(2, 512, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        decay = constant_decay(retnet_decay(4), 4, torch.device("cuda"))
        t = time.perf_counter()
        o, _ = decay_attention(q, k, v, decay, scale=64**-0.5)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        ref = refs.kernel_mimic(q, k, v, decay, 64, scale=64**-0.5, output_final_state=True)[0]
        print(seconds, refs.rel_l2(o, ref))
        """
    )
    env = child_env(**{autotune.AUTOTUNE_VARIABLE: "1", "DECAY_TUNER_TABLE": str(path)})
    run = lambda: subprocess.run(  # noqa: E731
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=1200
    )
    first = run()
    assert first.returncode == 0, first.stderr[-3000:]
    seconds, err = map(float, first.stdout.split())
    assert err < 2e-2
    table = json.loads(path.read_text())
    assert [(e["problem"]["batch"], e["problem"]["seqlen"]) for e in table["entries"]] == [(2, 512)]
    written = path.stat().st_mtime_ns
    second = run()
    assert second.returncode == 0, second.stderr[-3000:]
    assert float(second.stdout.split()[1]) < 2e-2
    assert path.stat().st_mtime_ns == written and float(second.stdout.split()[0]) < seconds / 3


def test_the_child_imports_this_tuner_from_any_folder_or_says_in_one_line_it_cannot(
    tmp_path, monkeypatch, fresh_server
):
    """The study's child is this interpreter's ``python -m tuner`` and imports the tuner
    beside this package from a folder outside the checkout (an installed wheel: where it is
    installed, ``.ci/run``); an interpreter that cannot import it is one line of warning."""
    import tuner

    monkeypatch.chdir(tmp_path)
    cmd, env = autotune.child_command(PROBLEM, tmp_path / "t.json", tmp_path / "studies")
    assert cmd[:4] == [sys.executable, "-m", "tuner", "dispatch"] and env["DECAY_TUNER_STUDIES"].endswith(
        "studies"
    )
    found = subprocess.run(
        [sys.executable, "-c", "import tuner; print(tuner.__file__)"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout.strip() == tuner.__file__
    real = autotune.child_command
    no_site = lambda *args: ([sys.executable, "-I", "-S", *real(*args)[0][1:]], real(*args)[1])  # noqa: E731
    monkeypatch.setattr(autotune, "child_command", no_site)
    said = r"gave no config \(.* cannot import the tuner: install decay-tuner for it\): serving the rule"
    with pytest.warns(UserWarning, match=said):
        assert autotune.tuned(tmp_path / "mine.json", PROBLEM, None) is None
