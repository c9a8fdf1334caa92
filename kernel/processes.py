"""Child processes that die with their parent and leave Ctrl-C to it: the compile pool
(``compile_pool``) and the tuner's GPU worker (``tuner.worker``) start theirs here; and
the blocks where Ctrl-C waits (``ctrl_c_ignored``) or takes effect where they say, else
at their end (``ctrl_c_at_checkpoints``). A SIGTERM handled by ``sigterm_stops`` stops
where a Ctrl-C would, also where SIGINT is ignored (``nohup``, ``cmd &`` in a script)."""

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


class Stop:
    """The signal that stopped the process last: SIGINT (Ctrl-C) unless a SIGTERM did."""

    signal: int = signal.SIGINT

    @classmethod
    def words(cls) -> tuple[str, str]:
        """What the stop was, and what stops now instead of waiting: ``("interrupted",
        "Ctrl-C")`` or ``("terminated", "SIGTERM (or kill -9)")``."""
        if cls.signal == signal.SIGTERM:
            return "terminated", "SIGTERM (or kill -9)"
        return "interrupted", "Ctrl-C"


def sigterm_stops(signum: int, frame: object) -> None:
    """SIGTERM's handler: it stops the main thread as a Ctrl-C does (``KeyboardInterrupt``),
    whatever SIGINT's handler; the blocks below treat it as they treat Ctrl-C."""
    Stop.signal = signal.SIGTERM
    raise KeyboardInterrupt


# Each stop signal's handler where it raises at once.
_RAISING: dict[int, Callable[[int, Any], Any]] = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGTERM: sigterm_stops,
}


def _raising() -> list[int]:
    """The stop signals that raise ``KeyboardInterrupt`` now (none outside the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return []
    return [s for s, handler in _RAISING.items() if signal.getsignal(s) is handler]


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
            what, again = Stop.words()
            print(
                f"{what}: waiting for {n} compile{'s' * (n != 1)} in flight to finish "
                f"({again} again to stop now)",
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
    """Ctrl-C does nothing in the block (in the main thread; elsewhere it cannot arrive); a
    SIGTERM (``sigterm_stops``) waits for its end, where it raises unless the block did."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    term = signal.getsignal(signal.SIGTERM) is sigterm_stops
    came = threading.Event()
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    if term:
        signal.signal(signal.SIGTERM, lambda signum, frame: came.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
        if term:
            signal.signal(signal.SIGTERM, sigterm_stops)
    if came.is_set():
        Stop.signal = signal.SIGTERM
        raise KeyboardInterrupt


@contextlib.contextmanager
def ctrl_c_at_checkpoints() -> Iterator[Callable[[], None]]:
    """Ctrl-C (or a SIGTERM, ``sigterm_stops``) in the block is noted, never raised where it
    lands (a storage write cut in two, or a garbage collector's callback, which swallows it
    with a traceback). The block calls the function it is given where it can stop cleanly,
    at least every ``CHECKPOINT_S`` in its waits: for a noted signal it raises
    ``KeyboardInterrupt`` and gives the signals back to Python, so a second one raises at
    once. A signal noted when the block ends raises there, so a block that never calls it
    is one that they do not cut. Main thread only, and only for the signals that raise:
    inside ``ctrl_c_ignored`` Ctrl-C stays ignored, and inside another such block the outer
    one notes it."""
    raising = _raising()
    if not raising:
        yield lambda: None
        return
    noted = threading.Event()

    def note(signum: int, frame: object) -> None:
        Stop.signal = signum
        noted.set()

    for s in raising:
        signal.signal(s, note)

    def give_back() -> None:
        for s in raising:
            signal.signal(s, _RAISING[s])

    def checkpoint() -> None:
        if noted.is_set():
            noted.clear()
            give_back()
            raise KeyboardInterrupt

    try:
        yield checkpoint
        checkpoint()
    finally:
        give_back()


def result_of(future: Future, checkpoint: Callable[[], None]) -> Any:
    """``future``'s result, calling ``checkpoint`` (``ctrl_c_at_checkpoints``) while it waits."""
    while not wait([future], timeout=CHECKPOINT_S).done:
        checkpoint()
    return future.result()
