"""The Optuna sampler a run asks for, by name."""

import optuna

from tuner.options import SAMPLERS, UsageError


def make_sampler(name: str, knobs: dict[str, tuple], seed: int) -> optuna.samplers.BaseSampler:
    """The sampler ``name`` seeded with ``seed``; the grid's over ``knobs`` (a search space's
    table, ``tuner.space.Space.knobs``), which the others leave to the study's asks."""
    if name == "tpe":
        return optuna.samplers.TPESampler(
            seed=seed, multivariate=True, n_startup_trials=8, constant_liar=True
        )
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=16)
    if name == "gp":
        try:
            import scipy  # noqa: F401  (GPSampler needs it)
        except ImportError:
            raise UsageError("the gp sampler needs scipy: pip install scipy") from None
        return optuna.samplers.GPSampler(seed=seed)
    if name == "grid":
        return optuna.samplers.GridSampler({k: list(v) for k, v in knobs.items()}, seed=seed)
    raise UsageError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")
