"""The search space: the kernels' knobs for the problem (``kernel.constraints.knobs``), plus
named restrictions (``kernel.constraints.violated``), built once per study as a ``Space``
(``search_space``) that the tuner, its sampler and its first configs read.

Restrictions are cheap predicates on a config, checked before any compile: the compiler
failures known ahead (layouts that never lower, the least shared memory) among them.
Everything else the compiler decides (other failures, spills, shared memory) is left to the
probe, which records it as a value.

Two kernels are tuned (``sweep``): the forward (``"forward"``, every knob of
``kernel.config``), and the backward's fused dk and dv pass (``"dkdv"``, ``kernel.dkdv``),
whose design fixes all its knobs but its stages and its segments. A per-token gate's
problem (``Problem.gate``, ``run --gate token``) tunes its forward, ``kernel.gated``:
one pass, scores in shared memory, its chunk, block_dv, stages and threads free
(``kernel.constraints.knobs``).
"""

import dataclasses
from typing import Any

from optuna.distributions import CategoricalDistribution

from kernel.arch import DEFAULT_ARCH, get_arch
from kernel.config import SEED_CONFIG, Call, KernelConfig, Problem, config_grid, dkdv_call, model_call
from kernel.constraints import dkdv_serves, head_size_error, knobs, violated
from kernel.rule import default_config, dkdv_config
from tuner.latency import LatencyModel
from tuner.occupancy import estimated_resources
from tuner.options import Options, UsageError


@dataclasses.dataclass(frozen=True, eq=False)
class Space:
    """One study's search space, built once (``search_space``; the decode step's:
    ``tuner.decode_tuner.decode_space``): the knob table (name -> choices), its Optuna
    distributions, every config of the table in a fixed order (``grid``) and why each of
    them the restrictions refuse on the study's architecture, or "" (``restrictions``)."""

    knobs: dict[str, tuple]
    grid: list[Any]  # KernelConfig, or the decode step's DecodeConfig
    restrictions: dict[Any, str]  # each config of the grid -> why it is refused ("; "-joined), or ""
    problem: Any = None  # the forward's and the fused pass's: their Problem
    sweep: str = "forward"
    arch: str = DEFAULT_ARCH
    call: Call | None = None  # what the probe compiles and the worker measures
    unusable: str = ""  # why the kernel cannot run the problem on the architecture at all

    @property
    def distributions(self) -> dict[str, CategoricalDistribution]:
        return {name: CategoricalDistribution(values) for name, values in self.knobs.items()}

    def restriction(self, config: Any) -> str:
        """Why ``config`` may not run, "" where it may."""
        reason = self.restrictions.get(config)
        return "; ".join(violated(self.problem, config, self.arch, self.sweep)) if reason is None else reason

    def outside(self, config: Any) -> dict[str, object]:
        """``config``'s knobs that are none of the table's choices, by name."""
        return {k: v for k, v in config.to_dict().items() if v not in self.knobs[k]}

    def check(self, configs: list[Any]) -> None:
        """A ``UsageError`` naming the first of ``configs`` (a user's ``--enqueue``) with a
        knob outside the space."""
        for config in configs:
            if outside := self.outside(config):
                raise UsageError(
                    f"enqueued config {config} is outside the search space: {outside} (choices: {self.knobs})"
                )


def search_space(problem: Problem, sweep: str = "forward", arch: str = DEFAULT_ARCH) -> Space:
    """The space of ``sweep``'s kernel for ``problem`` on ``arch``."""
    table = knobs(problem, sweep)
    grid = [c for c in config_grid(problem.dv) if all(v in table[k] for k, v in c.to_dict().items())]
    call = dkdv_call(problem) if sweep == "dkdv" else model_call(problem)
    unusable = head_size_error(arch, problem.dk, problem.dv) or ""
    if not unusable and sweep == "dkdv" and problem.gate == "token":
        unusable = (
            "the per-token gate's backward has no fused dk and dv kernel: its passes are the gated "
            "forward's (kernel.gated_build.pass_jobs)"
        )
    if not unusable and sweep == "dkdv" and not dkdv_serves(problem, arch):
        unusable = (
            f"the fused dk and dv pass does not serve DK x DV = {problem.dk} x {problem.dv} on "
            f"{arch} (Hopper, DK x DV <= 128 x 128)"
        )
    restrictions = {c: "; ".join(violated(problem, c, arch, sweep)) for c in grid}
    return Space(table, grid, restrictions, problem, sweep, arch, call, unusable)


def wave_seeds(space: Space, *, sms: int | None = None, bandwidth: float | None = None) -> list[KernelConfig]:
    """Configs worth measuring first: the rule's config (``kernel.rule``: the forward's
    ``default_config``, the fused pass's ``dkdv_config``), whose segment count gives the
    grid nearest one wave of blocks (one per SM) without passing it, then the segment
    counts on either side of it; for the forward each also at the other depth of 2 and 3
    stages (2 where the rule runs 1). ``sms``: the GPU's SM count; by default that of the
    space's architecture's reference GPU (``kernel.arch.Arch.sms``), as a compile-only run
    assumes. ``bandwidth``: the GPU's peak bytes/s, where known; where the rule's config for
    it is not fast memory's, fast memory's follows the rest (``default_config``). Restricted
    configs are left out; the sampler explores everything else as before."""
    problem, sweep, arch = space.problem, space.sweep, space.arch
    sms = sms or get_arch(arch).sms
    rule = (
        dkdv_config(problem, arch, sms) if sweep == "dkdv" else default_config(problem, arch, sms, bandwidth)
    )
    if rule is None:
        return []
    counts = space.knobs["segments"]
    i = counts.index(rule.segments)
    stages = (rule.num_stages,) if sweep == "dkdv" else (rule.num_stages, 2 if rule.num_stages != 2 else 3)
    configs = [
        dataclasses.replace(rule, segments=n, num_stages=s)
        for n in (counts[i], *counts[max(0, i - 1) : i], *counts[i + 1 : i + 2])
        for s in stages
    ]
    if sweep == "forward":
        configs.append(default_config(problem, arch, sms))
    return [c for c in dict.fromkeys(configs) if not space.restriction(c)]


def predicted_first(
    space: Space, model: LatencyModel, *, n: int = 4, sms: int | None = None
) -> list[KernelConfig]:
    """The ``n`` configs of the space the latency model predicts fastest on its architecture,
    from resources estimated before any compile (``tuner.occupancy.estimated_resources``),
    among those whose knobs it was fitted to (``LatencyModel.covers``), unrestricted, and
    whose estimated shared memory fits a block; none where it is not calibrated for the
    architecture. ``sms``: the GPU's SMs, where known."""
    problem, sweep, arch = space.problem, space.sweep, space.arch
    if model.arch != arch:
        return []
    limit, ranked = get_arch(arch).smem_per_block, []
    for config in space.grid:
        if space.restrictions[config]:
            continue
        resources = estimated_resources(problem, config, sweep, arch)
        prediction = model.predict(problem, config, resources, arch=arch, sweep=sweep, sms=sms)
        if prediction.covered and resources.smem_bytes <= limit:
            ranked.append((prediction.ratio, config))
    return [config for _, config in sorted(ranked, key=lambda r: r[0])[:n]]


def first_configs(
    space: Space, model: LatencyModel, options: Options, *, sms: int | None, bandwidth: float | None = None
) -> list[KernelConfig]:
    """What a study measures before its sampler proposes, in order: the seed's config (a
    forward's, where DV admits its block_dv), the user's ``--enqueue`` configs, then,
    unless turned off or for the grid (which keeps its own order), the wave seeds and the
    configs ``model`` predicts fastest (``predicted_first``)."""
    seed = [SEED_CONFIG] if space.sweep == "forward" and not space.outside(SEED_CONFIG) else []
    first = [*seed, *options.enqueue]
    if not options.wave_seeds or options.sampler == "grid":
        return first
    seeds = wave_seeds(space, sms=sms, bandwidth=bandwidth)
    return [*first, *seeds, *predicted_first(space, model, sms=sms)]
