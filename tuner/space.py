"""The search space: the kernels' knobs for the problem (``kernel.constraints.knobs``), plus
named restrictions (``kernel.constraints.violated``).

Restrictions are cheap predicates on a config, checked before any compile: the compiler
failures known ahead (layouts that never lower, the least shared memory) among them.
Everything else the compiler decides (other failures, spills, shared memory) is left to the
probe, which records it as a value.

Two kernels are tuned (``sweep``): the forward (``"forward"``, every knob of
``kernel.config``), and the backward's fused dk and dv pass (``"dkdv"``, ``kernel.dkdv``),
whose design fixes all its knobs but its stages and its segments.
"""

import dataclasses

from optuna.distributions import CategoricalDistribution

from kernel.arch import DEFAULT_ARCH, get_arch
from kernel.config import SEED_CONFIG, KernelConfig, Problem, config_grid
from kernel.constraints import knobs, violated
from kernel.rule import default_config, dkdv_config
from tuner.latency import LatencyModel
from tuner.occupancy import estimated_resources
from tuner.options import Options, UsageError


def distributions(problem: Problem, sweep: str = "forward") -> dict[str, CategoricalDistribution]:
    return {name: CategoricalDistribution(values) for name, values in knobs(problem, sweep).items()}


def grid(problem: Problem, sweep: str = "forward") -> list[KernelConfig]:
    """Every config of the table, restricted or not, in a fixed order."""
    table = knobs(problem, sweep)
    return [c for c in config_grid(problem.dv) if all(v in table[k] for k, v in c.to_dict().items())]


def wave_seeds(
    problem: Problem,
    *,
    arch: str = DEFAULT_ARCH,
    sms: int | None = None,
    sweep: str = "forward",
    bandwidth: float | None = None,
) -> list[KernelConfig]:
    """Configs worth measuring first: the rule's config (``kernel.rule``: the forward's
    ``default_config``, the fused pass's ``dkdv_config``), whose segment count gives the
    grid nearest one wave of blocks (one per SM) without passing it, then the segment
    counts on either side of it; for the forward each also at the other depth of 2 and 3
    stages (2 where the rule runs 1). ``sms``: the GPU's SM count; by default that of
    ``arch``'s reference GPU (``kernel.arch.Arch.sms``), as a compile-only run assumes.
    ``bandwidth``: the GPU's peak bytes/s, where known; where the rule's config for it is
    not fast memory's, fast memory's follows the rest (``default_config``). Configs restricted
    on ``arch`` are left out; the sampler explores everything else as before."""
    sms = sms or get_arch(arch).sms
    rule = (
        dkdv_config(problem, arch, sms) if sweep == "dkdv" else default_config(problem, arch, sms, bandwidth)
    )
    if rule is None:
        return []
    counts = knobs(problem, sweep)["segments"]
    i = counts.index(rule.segments)
    stages = (rule.num_stages,) if sweep == "dkdv" else (rule.num_stages, 2 if rule.num_stages != 2 else 3)
    configs = [
        dataclasses.replace(rule, segments=n, num_stages=s)
        for n in (counts[i], *counts[max(0, i - 1) : i], *counts[i + 1 : i + 2])
        for s in stages
    ]
    if sweep == "forward":
        configs.append(default_config(problem, arch, sms))
    return [c for c in dict.fromkeys(configs) if not violated(problem, c, arch, sweep)]


def predicted_first(
    problem: Problem,
    model: LatencyModel,
    *,
    arch: str,
    sweep: str = "forward",
    n: int = 4,
    sms: int | None = None,
) -> list[KernelConfig]:
    """The ``n`` configs of the space the latency model predicts fastest on ``arch``, from
    resources estimated before any compile (``tuner.occupancy.estimated_resources``), among those
    whose knobs it was fitted to (``LatencyModel.covers``) and whose estimated shared memory
    fits a block; none where it is not calibrated for ``arch``. ``sms``: the GPU's SMs,
    where known."""
    if model.arch != arch:
        return []
    limit, ranked = get_arch(arch).smem_per_block, []
    for config in grid(problem, sweep):
        resources = estimated_resources(problem, config, sweep, arch)
        if (
            model.covers(problem, config)
            and resources.smem_bytes <= limit
            and not violated(problem, config, arch, sweep)
        ):
            prediction = model.predict(problem, config, resources, arch=arch, sweep=sweep, sms=sms)
            ranked.append((prediction.ratio, config))
    return [config for _, config in sorted(ranked, key=lambda r: r[0])[:n]]


def outside_space(problem: Problem, config: KernelConfig, sweep: str = "forward") -> dict[str, object]:
    """``config``'s knobs that are none of the search space's choices, by name."""
    table = knobs(problem, sweep)
    return {k: v for k, v in config.to_dict().items() if v not in table[k]}


def check_in_space(problem: Problem, configs: list[KernelConfig], sweep: str = "forward") -> None:
    """A ``UsageError`` naming the first of ``configs`` (a user's ``--enqueue``) with a knob
    outside the search space."""
    table = knobs(problem, sweep)
    for config in configs:
        outside = outside_space(problem, config, sweep)
        if outside:
            raise UsageError(
                f"enqueued config {config} is outside the search space: {outside} (choices: {table})"
            )


def first_configs(
    problem: Problem,
    model: LatencyModel,
    options: Options,
    *,
    arch: str,
    sms: int | None,
    bandwidth: float | None = None,
) -> list[KernelConfig]:
    """What a study measures before its sampler proposes, in order: the seed's config (a
    forward's, where DV admits its block_dv), the user's ``--enqueue`` configs, then,
    unless turned off or for the grid (which keeps its own order), the wave seeds and the
    configs ``model`` predicts fastest (``predicted_first``)."""
    sweep = options.sweep
    seed = [SEED_CONFIG] if sweep == "forward" and not outside_space(problem, SEED_CONFIG) else []
    first = [*seed, *options.enqueue]
    if not options.wave_seeds or options.sampler == "grid":
        return first
    seeds = wave_seeds(problem, arch=arch, sms=sms, sweep=sweep, bandwidth=bandwidth)
    return [*first, *seeds, *predicted_first(problem, model, arch=arch, sweep=sweep, sms=sms)]
