"""Ctrl-C where the code says (kernel.processes): real SIGINTs to this process."""

import os
import signal
import time

import pytest

from kernel.processes import ctrl_c_at_checkpoints


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # Python runs its handler between two bytecodes of this thread


class _Finalised:
    """An object whose finaliser meets a Ctrl-C: where Python raises it there, it is swallowed."""

    def __del__(self) -> None:
        _ctrl_c()


def test_a_ctrl_c_is_raised_at_the_next_checkpoint_even_one_a_finaliser_met():
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


def test_a_second_ctrl_c_after_a_checkpoint_raised_raises_at_once():
    with ctrl_c_at_checkpoints() as checkpoint:
        _ctrl_c()
        with pytest.raises(KeyboardInterrupt):
            checkpoint()
        with pytest.raises(KeyboardInterrupt):
            _ctrl_c()  # Python's handler again: the waits for compiles in flight rely on it


def test_a_ctrl_c_no_checkpoint_saw_is_raised_as_the_block_ends_and_an_ignored_one_never():
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
