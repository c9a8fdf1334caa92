"""The tuner (``Tuner``): the loop that runs one Optuna study over the kernel's design space.

Each round asks the sampler for a batch of configs, probes them across the CPU cores
(compile for the study's architecture, ``--arch`` or this GPU's: resources or a compiler
failure, no GPU), then measures the feasible ones one at a time on the GPU in an
isolated worker; where the GPU is of another architecture, or there is none, the study is
compile-only for its architecture. Every trial is told to the
storage as soon as it is known, so a killed run loses only the trials in flight; those
are marked failed ("interrupted") and their configs queued again: at once on Ctrl-C,
when the study is opened again on the same host (by pid), or by any live worker on any
host once their heartbeats stop (``tuner.liveness.fail_stale``).

Workers: several ``run`` processes on one study (same --storage, same --study) share the
work. Each claims a config in the storage before it compiles it (``tuner.claims``), so no
config is compiled or measured twice in one environment; a trial whose config another
trial owns waits for that owner and copies its outcome (``cached_from``).

``n_trials`` counts configs new to the study in this environment: a sampler's repeat of a
config tried before is served from that trial, is not one of them, and queues a config not
yet tried in its place (one the restrictions allow, where one is left). A run that finds no
config left untried stops early and says so.

Each trial outcome is told as ``tuner.outcomes`` says.
"""

import math
import os
import random
import socket
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import optuna

from kernel.arch import resolve
from kernel.builder import memory_bandwidth, sm_count
from kernel.config import KernelConfig, Problem
from kernel.decode import DecodeCase
from kernel.environment import env_key, environment, gated_environment
from kernel.probe import ProbeFailure, probe
from kernel.processes import CHECKPOINT_S, compile_pool, ctrl_c_at_checkpoints, ctrl_c_ignored, result_of
from kernel.trial_schema import EXTRAPOLATED, MEASURES
from tuner import outcomes, space
from tuner.claims import Claimed, Claims, Owned, interrupted, worker_index
from tuner.latency_cache import gpu_key, model_for, refresh
from tuner.liveness import fail_interrupted, fail_stale, interrupt, record_heartbeat
from tuner.occupancy import BlockResources
from tuner.options import Options, UsageError
from tuner.samplers import make_sampler
from tuner.storage import get_storage
from tuner.studies import hold, open_study
from tuner.trials import best_trials, enqueue, measured_before, trial_config, trial_params
from tuner.worker import GpuWorker


def trial_environment(problem: Problem, arch: str | None) -> dict[str, Any]:
    """What a trial of ``problem`` is measured in: ``environment(arch)``, with the gated
    kernel's code key for a per-token gate's (``kernel.environment.gated_environment``), so
    that a changed gated kernel never reuses its trials and leaves the constant decay's."""
    return (gated_environment if problem.gate == "token" else environment)(arch)


class Tuner:
    """One ``run`` process. Several may share a study through its storage."""

    def __init__(self, problem: Problem, options: Options, *, name: str, storage: str) -> None:
        self.problem, self.options = problem, options
        # What the worker builds and measures, and the probe compiles: the same kernel.
        self.sweep = options.sweep
        self.arch, self.gpu = resolve(options.arch)  # gpu: the kernels run and are timed here
        self.space = space.search_space(problem, self.sweep, self.arch)  # built once: the run's
        if self.space.unusable:
            raise UsageError(f"{self.space.unusable}: nothing to tune")
        self.space.check(options.enqueue)
        self.call = self.space.call
        self.env = trial_environment(problem, self.arch)
        self.env_key = env_key(self.env)
        named = self.env["gpu"] if self.gpu else options.for_gpu
        if self.gpu and options.for_gpu and gpu_key(options.for_gpu, self.arch) != gpu_key(named, self.arch):
            raise UsageError(
                f"--for-gpu names the GPU a compile-only run ranks for; this run measures on {named}"
            )
        # ranks compile-only trials, predicts beside measured ones; the line says which it is
        self.model, self.model_line = model_for(named, self.arch)
        self.objectives = outcomes.objective_names(self.gpu, options.multi_objective)
        self._open(problem, name=name, storage=storage, ranked_by=self.model.key)
        self.storage_url = storage
        self.bandwidth = rate = memory_bandwidth() if self.gpu else None
        first = space.first_configs(self.space, self.model, options, sms=self.sms, bandwidth=rate)
        enqueue(self.study, first, self.env_key)

    def _open(self, problem: Problem | DecodeCase, *, name: str, storage: str, ranked_by: str) -> None:
        """Open (or join) the study of ``problem`` for this run's ``space``, ``objectives``,
        ``sweep``, ``arch`` and ``options``, hold it for them (``ranked_by``: what ranks its
        compile-only trials), fail the trials a killed run left, and size the run's workers."""
        options = self.options
        self.storage = get_storage(storage, heartbeat_s=options.heartbeat_s, grace_s=options.grace_s)
        self.study = open_study(
            problem,
            name=name,
            storage=self.storage,
            sampler=make_sampler(options.sampler, self.space.knobs, options.seed),
            directions=["minimize"] * len(self.objectives),
        )
        # Workers on one study with one --seed would otherwise propose the same configs.
        self.worker_index = worker_index(self.study)
        if self.worker_index:
            self.study.sampler = make_sampler(
                options.sampler, self.space.knobs, options.seed + self.worker_index
            )
        mode = "gpu" if self.gpu else "compile-only"
        hold(
            self.study,
            storage,
            objectives=self.objectives,
            sweep=self.sweep,
            mode=mode,
            arch=self.arch,
            ranked_by=ranked_by,
        )
        self.interrupted = fail_interrupted(self.study) + fail_stale(self.study, options.grace_s)
        self.claims = Claims(self.study, self.env_key, options.grace_s)
        self._live: set[int] = set()  # ids of this worker's trials in flight, kept alive by heartbeats
        self._pool: ProcessPoolExecutor | None = None
        self._checkpoint: Callable[[], None] = lambda: None  # raises for a Ctrl-C (run's)
        self.sms = sm_count() if self.gpu else None  # None: the architecture's reference GPU's
        self._fills = random.Random(options.seed + self.worker_index)  # which untried config fills a repeat
        self.explored = 0  # configs new to the study in this environment, this run
        cores = os.cpu_count() or 1
        # Beside a GPU, leave cores to the process that launches and times the kernels.
        self.workers = options.workers or (max(1, cores - 2) if self.gpu else cores)
        # Trials asked ahead of the GPU. A single-pass config compiles in ~6 s on one core,
        # a sequence-split one (three kernels) in ~18 s, and either measures in ~1-2 s, so
        # 8 in flight keep the GPU busy; asking more would hand the sampler less feedback
        # per decision. Compile-only runs have no GPU to wait for. The grid's order needs
        # no feedback, so it asks as far ahead as there are workers.
        self.depth = min(self.workers, 8) if self.gpu and options.sampler != "grid" else self.workers
        self.gpu_evaluations = 0

    def run(self) -> optuna.Study:
        """Ask, probe and measure until ``n_trials`` configs new to the study are done, no
        config is left untried, or the timeout passes.

        Up to ``depth`` asked trials compile in the pool while the GPU measures the oldest
        one, so compiling overlaps measuring.
        """
        from tqdm import tqdm

        opts = self.options
        deadline = time.monotonic() + opts.timeout_s if opts.timeout_s else math.inf
        bar = tqdm(total=opts.n_trials, disable=not opts.progress, unit="trial", dynamic_ncols=True)
        worker = GpuWorker(opts.trial_timeout_s) if self.gpu else None
        # each asked trial, its config, its compile (or owner) and whether the config is new
        pending: deque[tuple[optuna.Trial, KernelConfig, Future | Owned | None, bool]] = deque()
        untried = self._untried()
        self.explored = 0
        stop = threading.Event()
        beats = threading.Thread(target=self._heartbeats, args=(stop,), daemon=True)
        beats.start()
        try:
            with compile_pool(self.workers) as pool, ctrl_c_at_checkpoints() as checkpoint:
                self._pool, self._checkpoint = pool, checkpoint
                while True:
                    while (
                        self.explored < opts.n_trials
                        and untried
                        and len(pending) < self.depth
                        and time.monotonic() < deadline
                        and not self._grid_exhausted()
                    ):
                        checkpoint()
                        trial, config, job = self._ask(pool)
                        if config not in untried:  # tried before, as far as this run knew: look again
                            untried = self._untried(but=trial.number)
                        new = config in untried and not isinstance(job, Owned)
                        untried.pop(config, None)
                        if new:
                            self.explored += 1
                        else:
                            self._fill(trial, untried)
                        pending.append((trial, config, job, new))
                    if not pending:
                        break
                    trial, config, job, new = pending[0]  # stays pending (failed on Ctrl-C) until told
                    try:
                        if isinstance(job, Owned):
                            self._follow(trial, config, worker)
                        else:
                            res = None if job is None else result_of(job, checkpoint)
                            self._evaluate(trial, config, res, worker)
                    except optuna.exceptions.UpdateFinishedTrialError:
                        print(
                            f"trial {trial.number} was failed by another worker (no heartbeat for "
                            f"{opts.grace_s} s); its config is queued again",
                            file=sys.stderr,
                        )
                    pending.popleft()
                    self._live.discard(trial._trial_id)
                    bar.update(int(new))
                    bar.set_postfix_str(self._best_text(), refresh=True)
            if self.explored < opts.n_trials and not untried:
                print(self._exhausted_text(), file=sys.stderr)
        finally:
            with ctrl_c_ignored():  # a Ctrl-C now would leave trials running
                stop.set()
                for trial_id in list(self._live):  # asked but never told: Ctrl-C or an error
                    frozen = self.study._storage.get_trial(trial_id)
                    if not frozen.state.is_finished():
                        interrupt(self.study, frozen, "the run stopped before this trial was measured")
                self._live.clear()
                self._pool, self._checkpoint = None, lambda: None
                bar.close()
                if worker is not None:
                    worker.close()
        return self.study

    def refresh_model(self) -> str | None:
        """After a run that measured trials on this GPU (one stopped by Ctrl-C or SIGTERM
        too): its GPU's latency model refit or rescaled from every measured trial of it in
        the storage, into the user's cache (``tuner.latency_cache.refresh``); the line
        saying what was written, None where this run measured nothing. A failure is that
        line too, naming its class: it never fails the run."""
        if not self.gpu or not self.gpu_evaluations:
            return None
        gpu = self.env["gpu"]
        try:
            return refresh(self.storage, self.storage_url, gpu=gpu, arch=self.arch, bandwidth=self.bandwidth)
        except Exception as exc:
            return f"latency model of {gpu} not refreshed: {type(exc).__name__}: {exc}".splitlines()[0]

    def _untried(self, but: int | None = None) -> dict[KernelConfig, bool]:
        """The space's configs no trial has tried in this environment or runs now (on any
        worker), trial ``but`` aside, in the grid's order; a config only ever interrupted,
        or only queued, counts as untried. Each maps to whether it is queued."""
        tried, queued = set(), set()
        for t in self.study.get_trials(deepcopy=False):
            params = trial_params(t)
            if not params or t.number == but or interrupted(t):
                continue
            here = t.user_attrs.get("env_key", self.env_key) == self.env_key
            if t.state == optuna.trial.TrialState.WAITING:
                queued.add(trial_config(t))
            elif t.state == optuna.trial.TrialState.RUNNING or here:
                tried.add(trial_config(t))
        return {c: c in queued for c in self.space.grid if c not in tried}

    def _fill(self, repeat: optuna.Trial, untried: dict[KernelConfig, bool]) -> None:
        """Queue a config not yet tried in place of ``repeat``'s (a config tried before),
        one the restrictions allow where one is left, else any, chosen at random by the
        seed; none where every untried config is queued already."""
        free = [c for c, queued in untried.items() if not queued]
        allowed = [c for c in free if not self.space.restriction(c)]
        if allowed or free:
            config = self._fills.choice(allowed or free)
            self.study.enqueue_trial(config.to_dict(), user_attrs={"instead_of_repeat": repeat.number})
            untried[config] = True

    def _exhausted_text(self) -> str:
        """Why a run explored fewer configs than ``n_trials``: the space holds no more."""
        n, total = self.options.n_trials, len(self.space.grid)
        if not self.explored:
            return f"no config explored, not {n}: each of the space's {total} was tried in this environment"
        return (
            f"explored {self.explored} configs, not {n}: the space holds no other config not yet tried "
            f"in this environment (of its {total})"
        )

    def _heartbeats(self, stop: threading.Event) -> None:
        """Keep this worker's trials alive, and fail the trials of dead workers (any host).
        A trial another worker failed meanwhile (it heard no heartbeat within the grace, as
        when the storage stalled) is left to the run loop, which says so when it tells it."""
        while not stop.wait(self.options.heartbeat_s):
            try:
                for trial_id in list(self._live):
                    try:
                        record_heartbeat(self.study._storage, trial_id)
                    except optuna.exceptions.UpdateFinishedTrialError:
                        self._live.discard(trial_id)
                fail_stale(self.study, self.options.grace_s)
            except Exception as exc:  # a storage hiccup: the next beat tries again
                print(f"heartbeat: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)

    def _ask(self, pool: ProcessPoolExecutor) -> tuple[optuna.Trial, KernelConfig, Future | Owned | None]:
        """Ask a trial and claim its config: compile it when the claim is this trial's."""
        trial = self._owned_trial()
        config = KernelConfig(**trial.params)
        if self.space.restriction(config):
            return trial, config, None  # nothing to compile or measure
        state = self.claims.claim(config, trial.number)
        if isinstance(state, Owned):
            return trial, config, state
        trial.set_user_attr("claim_attempt", state.attempt)
        return trial, config, pool.submit(probe, self.problem, config, arch=self.arch, call=self.call)

    def _owned_trial(self) -> optuna.Trial:
        """A new trial with this worker recorded on it. Should a worker's liveness check fail
        the trial while it is asked (the storage answered after the grace, as when a killed
        worker left the journal's lock to go stale), its config is queued again: ask anew."""
        while True:
            asked = None
            try:
                with warnings.catch_warnings():  # Optuna warns that its heartbeat suits Study.optimize:
                    warnings.filterwarnings("ignore", "Heartbeat of storage")  # this loop records its own
                    asked = self.study.ask(self.space.distributions)
                record_heartbeat(self.study._storage, asked._trial_id)
                self._live.add(asked._trial_id)
                asked.set_user_attr("host", socket.gethostname())
                asked.set_user_attr("pid", os.getpid())
                return asked
            except optuna.exceptions.UpdateFinishedTrialError:
                if asked is not None:
                    self._live.discard(asked._trial_id)
                print(
                    f"a trial was failed as this worker asked for it (the storage answered after the "
                    f"{self.options.grace_s} s grace); asking again",
                    file=sys.stderr,
                )

    def _follow(self, trial: optuna.Trial, config: KernelConfig, worker: GpuWorker | None) -> None:
        """A trial whose config another trial owns: wait for the owner and copy its outcome;
        should the owner be interrupted, claim the config and evaluate it here."""
        while True:
            state = self.claims.claim(config, trial.number)
            if isinstance(state, Claimed):
                trial.set_user_attr("claim_attempt", state.attempt)
                assert self._pool is not None
                job = self._pool.submit(probe, self.problem, config, arch=self.arch, call=self.call)
                res = result_of(job, self._checkpoint)
                self._evaluate(trial, config, res, worker)
                return
            if state.finished:
                outcomes.copy(self.study, trial, state.owner)
                return
            for _ in range(3):  # the owner's outcome is read again every 0.6 s
                time.sleep(CHECKPOINT_S)
                self._checkpoint()

    def _grid_exhausted(self) -> bool:
        sampler = self.study.sampler
        return isinstance(sampler, optuna.samplers.GridSampler) and sampler.is_exhausted(self.study)

    def _evaluate(self, trial: optuna.Trial, config: KernelConfig, res, worker: GpuWorker | None) -> None:
        start = time.perf_counter()
        trial.set_user_attr("env_key", self.env_key)
        trial.set_user_attr("environment", self.env)
        trial.set_user_attr("mode", "gpu" if self.gpu else "compile-only")
        if res is None:
            reason = self.space.restriction(config)
            outcomes.reject(
                self.study, trial, len(self.objectives), "restricted", "restriction", reason, start
            )
            return
        for key, value in res.to_dict().items():
            trial.set_user_attr(key, value)
        if isinstance(res, ProbeFailure):
            outcomes.reject(
                self.study,
                trial,
                len(self.objectives),
                "compile_failed",
                "compiles",
                f"{res.error_type}: {res.message}",
                start,
            )
            return
        over = outcomes.violations(res, self.options)
        for key, value in over.items():
            trial.set_constraint(key, value)
        if any(v > 0 for v in over.values()):
            trial.set_constraint("correctness", 0.0)
            trial.set_user_attr("reason", outcomes.over_budget_reason(res, self.options))
            outcomes.tell(self.study, trial, [math.inf] * len(self.objectives), "infeasible", start)
            return
        prediction = self.model.predict(
            self.problem, config, BlockResources.of(res), arch=self.arch, sweep=self.sweep, sms=self.sms
        )
        outcomes.predicted(trial, prediction)
        if not self.gpu:
            trial.set_constraint("correctness", 0.0)
            rank = prediction.ratio
            if not prediction.covered:  # an extrapolation: ranked after every config the model covers
                trial.set_user_attr("reason", EXTRAPOLATED)
                rank = math.inf
            outcomes.tell(
                self.study, trial, [rank, float(res.smem_bytes)][: len(self.objectives)], "ok", start
            )
            return
        self._measure(trial, config, worker, start)

    def _measure(self, trial: optuna.Trial, config: KernelConfig, worker: GpuWorker, start: float) -> None:
        cached = measured_before(self.study, trial.params, self.env_key)
        if cached is not None:
            result = {k: cached.user_attrs[k] for k in (*MEASURES, "finite") if k in cached.user_attrs}
            trial.set_user_attr("cached_from", cached.number)
            result["ok"] = True
        else:
            self.gpu_evaluations += 1
            result = worker.measure(
                {
                    "problem": self.problem.to_dict(),
                    "config": config.to_dict(),
                    "call": self.call.to_dict(),
                    "seed": self.options.seed + trial.number,
                    "tolerance": self.options.tolerance,
                },
                self._checkpoint,
            )
        outcomes.measured(self.study, trial, result, self.options.tolerance, len(self.objectives), start)

    def _best_text(self) -> str:
        best = best_trials(self.study, self.env_key)
        if not best:
            return "no feasible config yet"
        t = best[0]
        if self.gpu:
            return f"best {t.values[0]:.4g} ms @ {trial_config(t).label}"
        if not math.isfinite(t.values[0]):
            return "no config the latency model covers yet"
        uncalibrated = "" if self.model.arch == self.arch else " (uncalibrated)"
        return f"best predicted {t.values[0]:.3g}x floor{uncalibrated} @ {trial_config(t).label}"
