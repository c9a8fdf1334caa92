"""The latency model per GPU: a user's cache of models fitted to each GPU's own timings
(``refresh``, at the end of a GPU run), and which model a run ranks by (``model_for``).

A GPU run that measured trials refits its GPU's model from every measured trial of that
GPU in its storage, with the package's grids of that GPU (``tuner.fit_data.grids_of``),
where they hold ``REFIT_SHAPES`` shapes or more and scikit-learn is installed; else it
rescales the GPU's cached model (or the shipped one, where it is of the same architecture)
by the median of measured over predicted. The model is written atomically to
``cache_dir() / <gpu key>.json``; runs for that GPU use it afterwards, compile-only ones
where they name the GPU (``--for-gpu``). A GPU never seen ranks by the shipped model. The
file ``DECAY_TUNER_LATENCY_MODEL`` names wins over both.
"""

import math
import os
import re
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from tuner import fit_data, latency, latency_fit
from tuner.latency import LatencyModel

CACHE_VARIABLE = "DECAY_TUNER_MODEL_CACHE"  # the folder of the per-GPU models
# A refit needs shapes to learn from and to be judged on; below, a rescale keeps the ranks.
REFIT_SHAPES = 4
RESCALE_TRIALS = 5  # the least of measured trials a median ratio is taken over
FOLDS = 3  # the refit is judged by a fit per third of its shapes left out: seconds, not minutes


def cache_dir() -> Path:
    """``DECAY_TUNER_MODEL_CACHE``, else ``$XDG_CACHE_HOME/decay-tuner/latency`` (default
    ``~/.cache``)."""
    if folder := os.environ.get(CACHE_VARIABLE):
        return Path(folder)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "decay-tuner" / "latency"


def gpu_key(gpu: str, arch: str) -> str:
    """The file name of a GPU's model: its name as torch gives it (any case, any spacing)
    and the architecture, in lower case with dashes."""
    return re.sub(r"[^a-z0-9_]+", "-", f"{gpu} {arch}".lower()).strip("-")


def cached_path(gpu: str, arch: str) -> Path:
    return cache_dir() / f"{gpu_key(gpu, arch)}.json"


def cached_models() -> list[tuple[Path, LatencyModel | str]]:
    """Each model file of the cache, with its model or why it cannot be read."""
    found: list[tuple[Path, LatencyModel | str]] = []
    for path in sorted(cache_dir().glob("*.json")):
        try:
            found.append((path, LatencyModel.load(path)))
        except ValueError as exc:
            found.append((path, str(exc)))
    return found


def model_for(gpu: str | None, arch: str) -> tuple[LatencyModel, str]:
    """The model a run for ``gpu`` (None: unnamed) on ``arch`` ranks by, and one line saying
    which: the file ``DECAY_TUNER_LATENCY_MODEL`` names, else that GPU's cached one, else the
    shipped one."""
    if os.environ.get(latency.MODEL_VARIABLE):
        model = latency.latency_model()
        return model, f"latency model: {latency.model_path()} ({latency.MODEL_VARIABLE})"
    shipped = latency.latency_model()
    of = f"of {shipped.gpu}, {shipped.arch}" if shipped.trees else "unreadable: the analytic part alone"
    if gpu is None:
        return shipped, f"latency model: the shipped one ({of}; --for-gpu names a GPU's own)"
    path = cached_path(gpu, arch)
    if not path.is_file():
        return shipped, f"latency model: the shipped one ({of}): none cached for {gpu} on {arch} ({path})"
    try:
        model = LatencyModel.load(path)
    except ValueError as exc:
        return shipped, f"latency model: the shipped one ({of}): {exc}"
    return model, f"latency model: {model.gpu}'s own, {made_by(model)} ({path})"


def made_by(model: LatencyModel) -> str:
    """How a cached model was made, in a few words."""
    how = model.trained.get("made", "fitted")
    if "factor" in model.trained:
        how += f" by {model.trained['factor']:.3g}"
    return f"{how} from {model.trained.get('timings', '?')} timings"


def refresh(storage, url: str, *, gpu: str, arch: str, bandwidth: float | None) -> str:
    """Refit or rescale ``gpu``'s model on ``arch`` from the measured trials of that GPU in
    ``storage`` (an Optuna storage, read from ``url``) and the package's grids of it, and
    write it to the cache; the one line saying what was written, or why nothing was."""
    trials, _ = latency_fit.storage_samples(storage, url, gpu=gpu, arch=arch)
    if not trials:
        return f"latency model of {gpu} unchanged: no measured trial of it in the storage"
    grids = fit_data.grids_of(gpu, arch)
    samples = trials + [s for grid in grids for s in latency_fit.from_sweep(grid)[0]]
    sources = [url, *(f"tuner/data/{g.name}" for g in grids)]
    path = cached_path(gpu, arch)
    shapes = sum(n >= 3 for n in _configs_per_shape(samples).values())
    model = None
    if shapes >= REFIT_SHAPES and _can_fit():
        bandwidth = bandwidth if bandwidth and math.isfinite(bandwidth) else latency.MODEL_BANDWIDTH
        model, _ = latency_fit.fit_each_shape_out(
            samples, gpu=gpu, bandwidth=bandwidth, sources=sources, folds=FOLDS
        )
        model = replace(model, trained={"made": "refit", **model.trained})
    else:
        base = _base(path, arch)
        if base is None:
            why = f"{shapes} shapes of 3 configs or more" if _can_fit() else "scikit-learn missing"
            return (
                f"latency model of {gpu} unchanged: {why}, under the {REFIT_SHAPES} a refit needs, "
                f"and no model of {arch} to rescale"
            )
        if len(trials) < RESCALE_TRIALS:
            return (
                f"latency model of {gpu} unchanged: {len(trials)} measured trials, under the "
                f"{RESCALE_TRIALS} a rescale needs"
            )
        model = rescaled(base, trials, gpu=gpu, sources=[url])
    model.save(path)
    held = model.trained["held_out"]
    rho = held["spearman_median"]
    judged = (
        f"Spearman median {rho:.2f} over {held['shapes']} shapes" if rho is not None else "no shape ranked"
    )
    return f"latency model of {gpu} {made_by(model)} ({judged}): wrote {path}"


def rescaled(
    base: LatencyModel, samples: list[latency_fit.Sample], *, gpu: str, sources: list[str]
) -> LatencyModel:
    """``base`` times the median of measured over predicted over ``samples``: the same ranks,
    the times of ``gpu``; its interval from the rescaled residuals."""
    residuals = [s.log_ratio(base.bandwidth) - base.log_ratio(s.features()) for s in samples]
    shift = statistics.median(residuals)
    trained: dict[str, Any] = {
        "made": "rescaled",
        "data": sources,
        "timings": len(samples),
        "rescaled_from": f"{base.gpu} ({base.key})",
        "factor": math.exp(shift),
        "judged_on": "the timings it was rescaled by (a rescale changes no rank)",
        "held_out": latency_fit.summary(latency_fit.judge(base, samples)),
    }
    interval = latency_fit.quantile_interval([r - shift for r in residuals])
    return replace(base, gpu=gpu, baseline=base.baseline + shift, interval=interval, trained=trained)


def _base(path: Path, arch: str) -> LatencyModel | None:
    """What a rescale starts from: the GPU's cached model, else the shipped one, where of ``arch``."""
    for candidate in (path, latency.MODEL_FILE):
        try:
            model = LatencyModel.load(candidate)
        except ValueError:
            continue
        if model.arch == arch:
            return model
    return None


def _configs_per_shape(samples: list[latency_fit.Sample]) -> dict[tuple, int]:
    configs: dict[tuple, set] = {}
    for s in samples:
        configs.setdefault(s.shape, set()).add(s.config)
    return {shape: len(found) for shape, found in configs.items()}


def _can_fit() -> bool:
    try:
        import sklearn  # noqa: F401
    except ImportError:
        return False
    return True
