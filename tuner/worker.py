"""GPU measurements in an isolated worker process.

The parent sends one job at a time and waits with a timeout. A hung kernel, an illegal
memory access or a segfault costs the worker, never the study: the parent records the
failure, kills what is left and starts a fresh worker for the next trial.
"""

import multiprocessing
import os
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from kernel.builder import build
from kernel.config import Call, KernelConfig, Problem, model_call
from kernel.processes import CHECKPOINT_S, bind_to_parent, sigint_blocked

# Fault injection for the tests: "LABEL=FAULT,..." (``KernelConfig.label``, e.g.
# "64/64/1/128/smem/1") makes the worker misbehave on those configs, so isolation is
# tested end to end. FAULT is "hang" (never answers), "segfault" (the process dies of
# SIGSEGV) or "illegal_address" (a real CUDA illegal memory access from a Triton kernel,
# which poisons the CUDA context).
INJECT_ENV = "DECAY_TUNER_INJECT"


def _inject(config: Any) -> None:  # a KernelConfig or a DecodeConfig: its label
    faults = dict(item.split("=") for item in os.environ.get(INJECT_ENV, "").split(",") if "=" in item)
    fault = faults.get(config.label)
    if fault == "hang":
        while True:
            time.sleep(1)
    if fault == "segfault":
        import ctypes

        ctypes.string_at(0)
    if fault == "illegal_address":
        import torch
        import triton
        import triton.language as tl

        @triton.jit
        def poke(ptr):
            tl.store(ptr + (1 << 40), 1.0)

        poke[(1,)](torch.zeros(1, device="cuda"))
        torch.cuda.synchronize()


def _measure(job: dict[str, Any]) -> dict[str, Any]:
    if job.get("sweep") == "decode":
        return _measure_decode(job)
    from kernel.validate import check_and_time, check_and_time_gated

    problem, config = Problem.from_dict(job["problem"]), KernelConfig.from_dict(job["config"])
    _inject(config)
    call = Call(**job["call"]) if "call" in job else model_call(problem)
    if problem.gate == "token":  # per-token gates against reference C's per-token form
        return check_and_time_gated(problem, config, call, seed=job["seed"], tolerance=job["tolerance"])
    kernel = build(problem, config, call)  # RetNet's decays: check_and_time's default
    return check_and_time(kernel, seed=job["seed"], tolerance=job["tolerance"])


def _measure_decode(job: dict[str, Any]) -> dict[str, Any]:
    """A decode trial (``run --sweep decode``): one step checked against reference A, timed,
    and the copy of its states timed beside it (``kernel.validate.check_and_time_decode``)."""
    from kernel.decode import DecodeCase, DecodeConfig
    from kernel.decode_build import build_decode
    from kernel.validate import check_and_time_decode

    case, config = DecodeCase.from_dict(job["problem"]), DecodeConfig.from_dict(job["config"])
    _inject(config)
    kern = build_decode(case.problem, config)
    return check_and_time_decode(kern, case.batch, seed=job["seed"], tolerance=job["tolerance"])


def _warm() -> None:
    """Import what a measurement needs and make the CUDA context while the first configs
    compile, where the first measurement took many times the others
    (docs/evidence.md#first-measurement)."""
    import torch

    import kernel.validate  # noqa: F401  (torch, TileLang)

    if torch.cuda.is_available():
        torch.cuda.init()


def _serve(conn: Connection, parent: int) -> None:
    bind_to_parent(parent)  # Ctrl-C is the parent's, which closes this worker; dies with the parent
    _warm()
    while (job := conn.recv()) is not None:
        try:
            conn.send({"ok": True, **_measure(job)})
        except Exception as exc:  # sent to the parent, which records it with the trial
            conn.send({"ok": False, "error_type": type(exc).__name__, "message": str(exc)[:2000]})
            return  # a CUDA error poisons the context: the next job gets a fresh worker


class GpuWorker:
    """A persistent worker process, started at once so that it is ready by the first
    measurement; ``measure`` never raises for what happens inside it."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._proc: Any = None
        self._conn: Connection | None = None
        self._start()

    def _start(self) -> None:
        self._conn, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_serve, args=(child, os.getpid()), daemon=True)
        with sigint_blocked():
            self._proc.start()
        child.close()

    def measure(self, job: dict[str, Any], checkpoint: Callable[[], None] = lambda: None) -> dict[str, Any]:
        """``job``'s result, calling ``checkpoint`` while it waits (``ctrl_c_at_checkpoints``)."""
        if self._proc is None or not self._proc.is_alive():
            self._start()
        self._conn.send(job)
        deadline = time.monotonic() + self.timeout_s
        while not self._conn.poll(CHECKPOINT_S):
            checkpoint()
            if time.monotonic() > deadline:
                self.close()
                return {
                    "ok": False,
                    "error_type": "Timeout",
                    "message": f"no result within {self.timeout_s:.0f} s (hung kernel?)",
                }
        try:
            result = self._conn.recv()
        except (EOFError, ConnectionError):
            self._proc.join(5)
            code = self._proc.exitcode
            self.close()
            return {
                "ok": False,
                "error_type": "WorkerCrashed",
                "message": f"worker died with exit code {code}",
            }
        if not result["ok"]:
            self.close()  # the worker exits after an error; wait for it, the next job gets a fresh one
        return result

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.is_alive():
                try:
                    self._conn.send(None)
                except (OSError, ValueError):
                    pass
                self._proc.join(2)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        self._proc = self._conn = None
