"""Child processes that die with their parent and leave Ctrl-C to it: the compile pool
(``compile_pool``) and the tuner's GPU worker (``tuner.worker``) start theirs here; and
the blocks where Ctrl-C waits (``ctrl_c_ignored``) or takes effect where they say, else
at their end (``ctrl_c_at_checkpoints``)."""

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

PR_SET_PDEATHSIG = 1  # Linux's prctl option: a signal for this process when its parent dies
CHECKPOINT_S = 0.2  # the longest a wait goes between two checks for a Ctrl-C (ctrl_c_at_checkpoints)


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread for the block: a child process started in it starts
    with SIGINT blocked (the mask survives fork and exec), so a Ctrl-C during its start-up
    waits until ``bind_to_parent`` ignores it, instead of raising in its imports."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def bind_to_parent(parent: int) -> None:
    """In a child process of ``parent`` (started under ``sigint_blocked``): Ctrl-C is left
    to the parent, and the child is killed when the parent dies, even by SIGKILL (Linux's
    parent-death signal; elsewhere a thread that watches the parent). The terminal sends
    Ctrl-C to its whole foreground process group, so the child leaves it for a group of its
    own: the processes it starts (nvcc, cicc, gcc, which reset SIGINT) stay out of reach too,
    and a compile in flight finishes instead of dying as a compile failure."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # also drops a Ctrl-C pending since the start
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    os.setpgid(0, 0)
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError(ctypes.get_errno(), "prctl")
    except (OSError, AttributeError):  # not Linux
        threading.Thread(target=_watch, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # the parent died before the signal was set
        os._exit(1)


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(1)


class CompilePool(ProcessPoolExecutor):
    """A ``ProcessPoolExecutor`` that knows its futures (``compile_pool``'s)."""

    def __init__(self, workers: int) -> None:
        # spawn: the parent may hold a CUDA context, which a forked child must not inherit
        ctx = multiprocessing.get_context("spawn")
        super().__init__(workers, mp_context=ctx, initializer=bind_to_parent, initargs=(os.getpid(),))
        self.futures: set[Future] = set()

    def _spawn_process(self) -> None:  # the one place the executor starts a process
        with sigint_blocked():
            super()._spawn_process()  # type: ignore[misc]

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future = super().submit(fn, *args, **kwargs)
        self.futures.add(future)
        future.add_done_callback(self.futures.discard)
        return future

    def kill(self) -> None:
        """Kill the pool's processes now, compiles in flight and all."""
        for process in list((self._processes or {}).values()):  # no public way before Python 3.14
            process.kill()


@contextlib.contextmanager
def compile_pool(workers: int) -> Iterator[CompilePool]:
    """A pool of ``workers`` compile processes, which die with this process and leave
    Ctrl-C to it; a ``RuntimeError`` where one of them dies. On Ctrl-C in the block,
    queued compiles are cancelled and those in flight are waited for, saying so on stderr;
    a second Ctrl-C kills them. Either way the ``KeyboardInterrupt`` goes on."""
    pool = CompilePool(workers)
    try:
        yield pool
    except BrokenProcessPool as exc:
        raise RuntimeError(
            "a compile process died (killed, or out of memory; where a script compiles at its top "
            'level, put that under if __name__ == "__main__": the compile processes start by spawn, '
            "which runs the script's top level again)"
        ) from exc
    except KeyboardInterrupt:
        for future in list(pool.futures):
            future.cancel()  # those not started yet
        flying = [f for f in pool.futures if not f.done()]
        if flying:
            n = len(flying)
            print(
                f"interrupted: waiting for {n} compile{'s' * (n != 1)} in flight to finish "
                "(Ctrl-C again to stop now)",
                file=sys.stderr,
                flush=True,
            )
            try:
                wait(flying)
            except KeyboardInterrupt:
                pool.kill()
                raise
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def ctrl_c_ignored() -> Iterator[None]:
    """Ctrl-C does nothing in the block (in the main thread; elsewhere it cannot arrive)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@contextlib.contextmanager
def ctrl_c_at_checkpoints() -> Iterator[Callable[[], None]]:
    """Ctrl-C in the block is noted, never raised where it lands (a storage write cut in two,
    or a garbage collector's callback, which swallows it with a traceback). The block calls
    the function it is given where it can stop cleanly, at least every ``CHECKPOINT_S`` in its
    waits: for a noted Ctrl-C it raises ``KeyboardInterrupt`` and gives Ctrl-C back to Python,
    so a second one raises at once. A Ctrl-C noted when the block ends raises there, so a
    block that never calls it is one that Ctrl-C does not cut. Main thread only, and only
    where Ctrl-C raises: inside ``ctrl_c_ignored`` it stays ignored, and inside another such
    block the outer one notes it."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield lambda: None
        return
    pressed = threading.Event()
    signal.signal(signal.SIGINT, lambda signum, frame: pressed.set())

    def checkpoint() -> None:
        if pressed.is_set():
            pressed.clear()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt

    try:
        yield checkpoint
        checkpoint()
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def result_of(future: Future, checkpoint: Callable[[], None]) -> Any:
    """``future``'s result, calling ``checkpoint`` (``ctrl_c_at_checkpoints``) while it waits."""
    while not wait([future], timeout=CHECKPOINT_S).done:
        checkpoint()
    return future.result()
