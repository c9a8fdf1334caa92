"""tuner.worker: a hung or crashing GPU job costs the worker process, never the caller."""

import time

from helpers import SMALL_PROBLEM

import refs
from kernel import SEED_CONFIG, KernelConfig
from tuner.worker import INJECT_ENV, GpuWorker


def test_worker_survives_hang_and_segfault(monkeypatch):
    hang, crash = KernelConfig(64, 32, 1, 128), KernelConfig(64, 64, 1, 128)
    monkeypatch.setenv(INJECT_ENV, f"{hang.label}=hang,{crash.label}=segfault")
    # The hang is waited for in full: a timeout that leaves the worker's start (torch's and
    # TileLang's import, 3 s alone, twice that under the suite's load) time to reach it, and a
    # longer one for the jobs after, which each start a fresh worker.
    worker = GpuWorker(timeout_s=12)

    def job(config: KernelConfig) -> dict:
        problem = SMALL_PROBLEM.to_dict()
        return {"problem": problem, "config": config.to_dict(), "seed": 0, "tolerance": refs.TOLERANCE}

    try:
        t0 = time.monotonic()
        hung = worker.measure(job(hang))
        assert hung["ok"] is False and hung["error_type"] == "Timeout"
        assert 12 <= time.monotonic() - t0 < 32
        worker.timeout_s = 60
        crashed = worker.measure(job(crash))
        assert crashed["ok"] is False and crashed["error_type"] == "WorkerCrashed"
        assert "-11" in crashed["message"]  # SIGSEGV
        # A fresh worker takes the next job; here without a GPU it reports why it cannot build.
        # Twice in a row: a worker that reported an error exits, and the next job must not
        # race its exit (on the H200 that once recorded a good config as a crash).
        for _ in range(2):
            plain = worker.measure(job(SEED_CONFIG))
            assert (
                plain["ok"] is False and plain["error_type"] == "RuntimeError" and "CUDA" in plain["message"]
            )
    finally:
        worker.close()
