"""The decode step's study (``run --sweep decode``): its knobs (``kernel.decode``'s table),
measured as the forward's are, by the same loop (``tuner.tuner.Tuner``) and told the same
way (``tuner.outcomes``).

A trial compiles one config (``kernel.decode_build.probe_decode``); on a GPU, the worker
checks one step of N sequences against one step of reference A in fp64 on fresh random
inputs (relative L2 of the output, the updated states and the pool's unused rows, under
``--tolerance``), times it (``kernel.timing.time_gpu``: L2 flushed, median) and times a
device copy of the states it reads and writes, its floor: 2 x N x H x DK x DV x the pool
dtype's bytes at the copy rate of the same process (``kernel.validate.check_and_time_decode``).

Compile-only, no latency model is fitted to the decode step: trials rank by how full the
grid's waves keep the SMs (``decode_waves``: the launched waves' slots over the blocks,
from the probe's registers and threads), labelled as the analytic part alone. Configs whose
waves are full tie, and stay in the order they were tried.

Its trials' environment carries the decode step's code key (``kernel.environment.
decode_environment``): a changed decode kernel never reuses a decode trial, and the
forward's key is left as it was.
"""

import math
import time
from concurrent.futures import Future, ProcessPoolExecutor

import optuna

from kernel.arch import get_arch, resolve
from kernel.decode import DecodeCase, DecodeConfig, decode_config, decode_knobs
from kernel.decode_build import probe_decode
from kernel.environment import decode_environment, env_key
from kernel.probe import ProbeFailure
from kernel.processes import CHECKPOINT_S, result_of
from kernel.trial_schema import FLOOR, MEASURES, UNCALIBRATED
from tuner import outcomes
from tuner.claims import Claimed, Owned
from tuner.occupancy import BlockResources, blocks_per_sm
from tuner.options import Options, UsageError
from tuner.space import Space
from tuner.trials import best_trials, measured_before, trial_config
from tuner.tuner import Tuner
from tuner.worker import GpuWorker

# What a compile-only decode study is ranked by (``tuner.studies.hold``'s ``ranked_by``).
RANKED_BY = "decode-waves"
PREDICTED_BY = f"{UNCALIBRATED}: the decode step's waves on the SMs, no fitted model"


def decode_waves(
    case: DecodeCase, config: DecodeConfig, resources: BlockResources, arch: str, sms: int | None
) -> float:
    """The slots of the launched waves over the blocks that fill them (1: every wave full;
    a grid smaller than the GPU counts its idle slots), on ``sms`` SMs (default: the arch's
    reference GPU's)."""
    blocks = config.blocks(case.rows, case.problem.dv)
    slots = (sms or get_arch(arch).sms) * blocks_per_sm(resources, arch)
    return math.ceil(blocks / slots) * slots / blocks


def decode_space(case: DecodeCase) -> Space:
    """The decode step's search space: its knob table (``kernel.decode.decode_knobs``), every
    config of it, and each one's restriction (``DecodeConfig.fits_error``)."""
    knobs = decode_knobs(case.problem)
    grid = [DecodeConfig(b, t) for b in knobs["block_dv"] for t in knobs["threads"]]
    return Space(knobs, grid, {c: c.fits_error(case.problem) or "" for c in grid}, sweep="decode")


class DecodeTuner(Tuner):
    """One ``run --sweep decode`` process: the forward's loop over the decode step's knobs."""

    def __init__(self, case: DecodeCase, options: Options, *, name: str, storage: str) -> None:
        if options.enqueue:
            raise UsageError(
                "--enqueue takes forward configs; a decode study measures the rule's config first"
            )
        self.problem, self.options, self.sweep, self.call = case, options, "decode", None
        self.arch, self.gpu = resolve(options.arch)
        self.env = decode_environment(self.arch)
        self.env_key = env_key(self.env)
        self.objectives = outcomes.objective_names(self.gpu, options.multi_objective)
        self.space = decode_space(case)
        self._open(case, name=name, storage=storage, ranked_by=RANKED_BY)  # its to_dict: the problem
        self.rule = decode_config(case.problem, case.rows, self.sms or get_arch(self.arch).sms)
        self._enqueue_rule()

    def _enqueue_rule(self) -> None:
        """Queue the rule's config (``kernel.decode.decode_config`` at N), the baseline, unless
        a trial of this environment or a queued one has it."""
        rule = self.rule.to_dict()
        for t in self.study.get_trials(deepcopy=False):
            params = t.params or t.system_attrs.get("fixed_params", {})
            waiting = t.state == optuna.trial.TrialState.WAITING
            if params == rule and (waiting or t.user_attrs.get("env_key") == self.env_key):
                return
        self.study.enqueue_trial(rule, user_attrs={"baseline": True})

    def _ask(self, pool: ProcessPoolExecutor) -> tuple[optuna.Trial, DecodeConfig, Future | Owned | None]:
        trial = self._owned_trial()
        config = DecodeConfig(**trial.params)
        if self.space.restriction(config):
            return trial, config, None
        state = self.claims.claim(config, trial.number)
        if isinstance(state, Owned):
            return trial, config, state
        trial.set_user_attr("claim_attempt", state.attempt)
        return trial, config, pool.submit(probe_decode, self.problem.problem, config, arch=self.arch)

    def _follow(self, trial: optuna.Trial, config: DecodeConfig, worker: GpuWorker | None) -> None:
        while True:
            state = self.claims.claim(config, trial.number)
            if isinstance(state, Claimed):
                trial.set_user_attr("claim_attempt", state.attempt)
                assert self._pool is not None
                job = self._pool.submit(probe_decode, self.problem.problem, config, arch=self.arch)
                self._evaluate(trial, config, result_of(job, self._checkpoint), worker)
                return
            if state.finished:
                outcomes.copy(self.study, trial, state.owner)
                return
            for _ in range(3):
                time.sleep(CHECKPOINT_S)
                self._checkpoint()

    def _evaluate(self, trial: optuna.Trial, config: DecodeConfig, res, worker: GpuWorker | None) -> None:
        start = time.perf_counter()
        trial.set_user_attr("env_key", self.env_key)
        trial.set_user_attr("environment", self.env)
        trial.set_user_attr("mode", "gpu" if self.gpu else "compile-only")
        n = len(self.objectives)
        if res is None:
            outcomes.reject(
                self.study, trial, n, "restricted", "restriction", self.space.restriction(config), start
            )
            return
        for key, value in res.to_dict().items():
            trial.set_user_attr(key, value)
        if isinstance(res, ProbeFailure):
            reason = f"{res.error_type}: {res.message}"
            outcomes.reject(self.study, trial, n, "compile_failed", "compiles", reason, start)
            return
        over = outcomes.violations(res, self.options)
        for key, value in over.items():
            trial.set_constraint(key, value)
        if any(v > 0 for v in over.values()):
            trial.set_constraint("correctness", 0.0)
            trial.set_user_attr("reason", outcomes.over_budget_reason(res, self.options))
            outcomes.tell(self.study, trial, [math.inf] * n, "infeasible", start)
            return
        ratio = decode_waves(self.problem, config, BlockResources.of(res), self.arch, self.sms)
        trial.set_user_attr("predicted_x_floor", ratio)
        trial.set_user_attr("predicted_by", PREDICTED_BY)
        if not self.gpu:
            trial.set_constraint("correctness", 0.0)
            outcomes.tell(self.study, trial, [ratio, float(res.smem_bytes)][:n], "ok", start)
            return
        self._measure(trial, config, worker, start)

    def _job(self, trial: optuna.Trial, config: DecodeConfig) -> dict:
        return {
            "sweep": "decode",
            "problem": self.problem.to_dict(),
            "config": config.to_dict(),
            "seed": self.options.seed + trial.number,
            "tolerance": self.options.tolerance,
        }

    def _measure(self, trial: optuna.Trial, config: DecodeConfig, worker: GpuWorker, start: float) -> None:
        cached = measured_before(self.study, trial.params, self.env_key)
        if cached is not None:
            keep = (*MEASURES, "finite", *FLOOR)
            result = {k: cached.user_attrs[k] for k in keep if k in cached.user_attrs}
            trial.set_user_attr("cached_from", cached.number)
            result["ok"] = True
        else:
            self.gpu_evaluations += 1
            result = worker.measure(self._job(trial, config), self._checkpoint)
        outcomes.measured(self.study, trial, result, self.options.tolerance, len(self.objectives), start)

    def _best_text(self) -> str:
        best = best_trials(self.study, self.env_key)
        if not best:
            return "no feasible config yet"
        t = best[0]
        if self.gpu:
            floor = t.user_attrs.get("x_floor")
            return f"best {t.values[0]:.4g} ms @ {trial_config(t).label}" + (
                f", {floor:.2f}x floor" if floor else ""
            )
        return f"best {t.values[0]:.3g} waves' slots per block (analytic) @ {trial_config(t).label}"
