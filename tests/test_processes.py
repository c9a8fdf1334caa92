"""Ctrl-C where the code says (kernel.processes): real SIGINTs to this process, and to a
child's process group as a terminal sends them."""

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import as_at_a_terminal, child_env

from kernel.processes import Stop, ctrl_c_at_checkpoints, ctrl_c_ignored, sigterm_stops


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # Python runs its handler between two bytecodes of this thread


class _Finalised:
    """An object whose finaliser meets a Ctrl-C: where Python raises it there, it is swallowed."""

    def __del__(self) -> None:
        _ctrl_c()


def test_a_ctrl_c_is_raised_at_the_next_checkpoint_even_one_a_finaliser_met(ctrl_c_raises):
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_at_checkpoints() as checkpoint:
            checkpoint()
            _Finalised()  # collected at once: the Ctrl-C lands in its finaliser
            steps.append("after the Ctrl-C")
            checkpoint()
            steps.append("after the checkpoint")
    assert steps == ["after the Ctrl-C"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_after_a_checkpoint_raised_raises_at_once(ctrl_c_raises):
    with ctrl_c_at_checkpoints() as checkpoint:
        _ctrl_c()
        with pytest.raises(KeyboardInterrupt):
            checkpoint()
        with pytest.raises(KeyboardInterrupt):
            _ctrl_c()  # Python's handler again: the waits for compiles in flight rely on it


def test_a_ctrl_c_no_checkpoint_saw_is_raised_as_the_block_ends_and_an_ignored_one_never(ctrl_c_raises):
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_at_checkpoints():
            _ctrl_c()
            steps.append("rest of the block")
    assert steps == ["rest of the block"]
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with ctrl_c_at_checkpoints() as checkpoint:
            _ctrl_c()
            checkpoint()
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.fixture
def sigterm_stops_with_sigint_ignored():
    """SIGTERM handled as a command handles it, SIGINT ignored as ``nohup`` leaves it."""
    term = signal.signal(signal.SIGTERM, sigterm_stops)
    sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
    Stop.signal = signal.SIGINT
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, term)
        signal.signal(signal.SIGINT, sigint)


def _sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)


def test_a_sigterm_stops_at_checkpoints_and_after_an_ignoring_block_where_sigint_is_ignored(
    sigterm_stops_with_sigint_ignored,
):
    """Where SIGINT is ignored from the start, a SIGTERM still takes effect where a Ctrl-C
    would: at the next checkpoint, at once after one raised, and as a block that ignores
    Ctrl-C ends; and says so (``Stop``)."""
    steps = []
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_at_checkpoints() as checkpoint:
            _sigterm()
            steps.append("after the SIGTERM")
            checkpoint()
    assert steps == ["after the SIGTERM"] and Stop.words() == ("terminated", "SIGTERM (or kill -9)")
    with pytest.raises(KeyboardInterrupt):
        _sigterm()  # raises at once again: a second SIGTERM stops the waits for compiles in flight
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_ignored():
            _sigterm()
            steps.append("rest of the ignoring block")
    assert steps[-1] == "rest of the ignoring block"
    assert signal.getsignal(signal.SIGTERM) is sigterm_stops


_POOL_SCRIPT = """
import subprocess, sys
from kernel.processes import compile_pool

def compile_like_nvcc(marker):
    # a compiler resets SIGINT (nvcc, cicc and gcc do), then works a while
    code = ("import pathlib, signal, sys, time; signal.signal(signal.SIGINT, signal.SIG_DFL); "
            "pathlib.Path(sys.argv[1]).touch(); time.sleep(2); print('compiled')")
    run = subprocess.run([sys.executable, "-c", code, marker], capture_output=True, text=True)
    return run.stdout.strip() or f"died, exit {run.returncode}"

if __name__ == "__main__":
    try:
        with compile_pool(1) as pool:
            future = pool.submit(compile_like_nvcc, sys.argv[1])
            future.result()
    except KeyboardInterrupt:
        print(future.result())
"""


def test_a_terminals_ctrl_c_leaves_the_compilers_in_flight_to_finish(tmp_path):
    script, marker = tmp_path / "pool.py", tmp_path / "compiling"
    script.write_text(_POOL_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(marker)],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a group of its own, as a terminal's foreground job has
        preexec_fn=as_at_a_terminal,
    )
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals its whole foreground group
    out, err = proc.communicate(timeout=60)
    assert out.strip() == "compiled", err
    assert "waiting for 1 compile in flight" in err


def test_a_script_that_compiles_at_its_top_level_is_told_to_guard_it(tmp_path):
    """The compile processes start by spawn, which runs the caller's script again: without
    ``if __name__ == "__main__":`` each of them dies, and the caller learns why."""
    script = tmp_path / "unguarded.py"
    lines = [
        "from kernel.processes import compile_pool",
        "with compile_pool(1) as pool:",
        "    pool.submit(abs, -1).result()",
    ]
    script.write_text("\n".join(lines) + "\n")
    run = subprocess.run(
        [sys.executable, str(script)], env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: a compile process died") and 'if __name__ == "__main__":' in last
