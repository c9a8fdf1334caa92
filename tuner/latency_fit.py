"""Fitting the latency model (``tuner.latency``) to GPU timings, and judging it on shapes
it never saw.

Timings come from a grid log's JSON lines (``tuner.fit_data``, the package's: "probe"
rows with each kernel's resources, "time" rows with its median) or from the GPU trials of
every study in a storage. Fitting needs scikit-learn (``pip install scikit-learn``): its
``HistGradientBoostingRegressor``, whose trees are then written out as plain JSON.
"""

import json
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kernel.config import KernelConfig, Problem, whole_chunks
from kernel.trial_schema import measured_ms
from tuner.latency import LatencyModel, features
from tuner.occupancy import BlockResources, floor_bytes
from tuner.options import UsageError, parse_config

# Chosen among 7 settings by held-out accuracy. evidence: docs/evidence.md#latency-model
TREE_PARAMS = {
    "max_iter": 150,
    "learning_rate": 0.1,
    "min_samples_leaf": 10,
    "max_leaf_nodes": 8,
    "early_stopping": False,  # every tree, whatever the data's size
}


@dataclass(frozen=True)
class Sample:
    """One GPU timing of one kernel."""

    problem: Problem
    config: KernelConfig
    sweep: str
    resources: BlockResources
    median_ms: float
    arch: str

    @property
    def shape(self) -> tuple:
        """What one ranking is over: the head sizes, sweep and (B, H, S)."""
        p = self.problem
        return (p.dk, p.dv, self.sweep, p.batch, p.heads, p.seqlen)

    def features(self) -> list[float]:
        return features(self.problem, self.config, self.sweep, self.resources, self.arch)

    def log_ratio(self, bandwidth: float) -> float:
        return math.log(self.median_ms * 1e-3 * bandwidth / floor_bytes(self.problem, self.sweep))


def from_sweep(path: Path) -> tuple[list[Sample], str]:
    """The timed rows of a sweep's JSON lines, each with its kernel's resources; and its GPU."""
    resources, samples, gpu, arch = {}, [], "", ""
    try:
        lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: cannot read the sweep: {exc}") from None
    try:
        for r in lines:
            if r.get("kind") == "env":
                gpu, arch = r["env"]["gpu"], r["env"]["arch"]
            elif r.get("kind") == "probe" and "resources" in r:
                key = (r["dk"], r["dv"], r["heads"], r["sweep"], r["config"], r.get("ragged", False))
                resources[key] = BlockResources.of(r["resources"])
            elif r.get("kind") == "time" and "median_ms" in r:
                gate = "token" if r.get("gate") else "head"  # a row of per-token gates says so
                p = Problem(r["b"], r["h"], r["s"], r["dk"], r["dv"], r["dtype"], gate)
                config = parse_config(r["config"], "its config")
                key = (r["dk"], r["dv"], r["h"], r["sweep"], r["config"])
                # the resources of S's chunk class; a sweep that probed only whole chunks, of that class
                found = resources.get((*key, not whole_chunks(p, config.chunk))) or resources[(*key, False)]
                samples.append(Sample(p, config, r["sweep"], found, measured_ms(r["median_ms"]), arch))
    except (KeyError, TypeError, AttributeError, ValueError) as exc:  # UsageError too
        raise UsageError(f"{path}: not a sweep's JSON lines: {type(exc).__name__}: {exc}") from None
    if not samples:
        raise UsageError(f"{path}: no timed rows (a sweep's JSON lines have 'probe' and 'time' rows)")
    return samples, gpu


def from_storage(url: str) -> tuple[list[Sample], str]:
    """The feasible GPU trials of every study in a storage (a trial that lacks a measured
    time or the compiler's resources is skipped); and their GPU (the first named)."""
    from tuner.storage import get_storage

    samples, gpus = storage_samples(get_storage(url, create=False), url)
    if not samples:
        raise UsageError(f"{url}: no GPU trials to fit to")
    return samples, next((g for g in gpus if g), "")


def storage_samples(
    storage, url: str, *, gpu: str | None = None, arch: str | None = None
) -> tuple[list[Sample], list[str]]:
    """The feasible GPU trials of the forward and dkdv studies in ``storage`` (an Optuna
    storage, read from ``url``), of ``gpu`` on ``arch`` where given, and each one's GPU. A
    trial counts as a GPU one by its own mode, else its study's."""
    import optuna

    from tuner.trials import is_feasible, trial_config

    samples, gpus = [], []
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        mode = study.user_attrs.get("mode")
        if study.user_attrs.get("sweep") == "decode" or "problem" not in study.user_attrs:
            continue  # the decode step's problem and configs are another kernel's
        try:
            problem = Problem.from_dict(study.user_attrs["problem"])
        except (TypeError, ValueError, AttributeError) as exc:
            raise UsageError(
                f"{url}: study {summary.study_name!r} records a malformed problem: {exc}"
            ) from None
        sweep = study.user_attrs.get("sweep", "forward")
        for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
            if t.user_attrs.get("mode", mode) != "gpu" or "cached_from" in t.user_attrs or not is_feasible(t):
                continue
            try:
                ms = measured_ms(t.user_attrs.get("median_ms"))
            except ValueError:  # no measured time
                continue
            try:
                fig = BlockResources.of(t.user_attrs)
            except (TypeError, ValueError):  # a trial of an older tool, without the resources
                continue
            env = t.user_attrs.get("environment") or {}
            found = t.user_attrs.get("arch", study.user_attrs.get("arch", ""))
            if (gpu is not None and env.get("gpu") != gpu) or (arch is not None and found != arch):
                continue
            gpus.append(env.get("gpu", ""))
            samples.append(Sample(problem, trial_config(t), sweep, fig, ms, found))
    return samples, gpus


def fit(samples: list[Sample], *, gpu: str, bandwidth: float, trained: dict[str, Any]) -> LatencyModel:
    """A model fitted to ``samples`` (all of one architecture), with no interval yet."""
    try:
        import numpy as np
        from sklearn.ensemble import HistGradientBoostingRegressor
    except ImportError:
        raise UsageError("fitting the latency model needs scikit-learn: pip install scikit-learn") from None
    archs = {s.arch for s in samples}
    if len(archs) != 1:
        raise UsageError(f"the timings are of several architectures ({sorted(archs)}): fit one at a time")
    x = np.array([s.features() for s in samples])
    y = np.array([s.log_ratio(bandwidth) for s in samples])
    hgb = HistGradientBoostingRegressor(**TREE_PARAMS, random_state=0).fit(x, y)
    trees = tuple(_tree(predictor[0].nodes) for predictor in hgb._predictors)
    baseline = float(np.ravel(hgb._baseline_prediction)[0])
    return LatencyModel(archs.pop(), gpu, bandwidth, baseline, trees, (0.0, 0.0), trained, domain(samples))


def domain(samples: list[Sample]) -> dict[str, list]:
    """Each knob's values among ``samples``, and their [DK, DV] pairs, sorted."""
    knobs = {k: sorted({getattr(s.config, k) for s in samples}) for k in KernelConfig().to_dict()}
    pairs = [list(p) for p in sorted({(s.problem.dk, s.problem.dv) for s in samples})]
    return knobs | {"dk_dv": pairs, "gate": sorted({float(s.problem.gate == "token") for s in samples})}


def _tree(nodes) -> tuple[tuple[float, ...], ...]:
    """scikit-learn's node records as ``[feature, threshold, left, right, value]``, a leaf's
    value to 7 significant digits (thresholds whole: a feature may sit within a rounding of
    one). A numeric split sends x <= threshold left; the features are never missing."""
    return tuple(
        (-1.0, 0.0, 0.0, 0.0, float(f"{n['value']:.7g}"))
        if n["is_leaf"]
        else (float(n["feature_idx"]), float(n["num_threshold"]), float(n["left"]), float(n["right"]), 0.0)
        for n in nodes
    )


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (tied values share their average rank), NaN under 3
    values or where either side is constant."""
    if len(a) < 3:
        return math.nan
    ra, rb = _ranks(a), _ranks(b)
    mean = (len(a) - 1) / 2
    cov = sum((x - mean) * (y - mean) for x, y in zip(ra, rb))
    spread = math.sqrt(sum((x - mean) ** 2 for x in ra) * sum((y - mean) ** 2 for y in rb))
    return cov / spread if spread else math.nan


def _ranks(values: list[float]) -> list[float]:
    """Each value's rank from 0, ties at the mean of the ranks they span."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for i in order[start : end + 1]:
            ranks[i] = (start + end) / 2
        start = end + 1
    return ranks


def judge(model: LatencyModel, samples: Iterable[Sample]) -> list[dict[str, Any]]:
    """Per shape with 3 configs or more: how the model ranks them against their times
    (Spearman's rho None where it predicts them all alike, and ranks none)."""
    groups: dict[tuple, list[Sample]] = defaultdict(list)
    for s in samples:
        groups[s.shape].append(s)
    rows = []
    for shape, found in sorted(groups.items()):
        if len(found) < 3:
            continue
        measured = [s.median_ms for s in found]
        predicted = [model.log_ratio(s.features()) for s in found]
        order = sorted(range(len(found)), key=predicted.__getitem__)
        best = min(measured)
        rho = spearman(predicted, measured)
        dk, dv, sweep, b, h, s = shape
        rows.append(
            {
                "shape": f"{b}x{h}x{s}",
                "dk": dk,
                "dv": dv,
                "sweep": sweep,
                "configs": len(found),
                "spearman": None if math.isnan(rho) else rho,
                "top1_over_best": measured[order[0]] / best,
                "top5_best_over_best": min(measured[i] for i in order[:5]) / best,
            }
        )
    return rows


def residual_interval(model: LatencyModel, samples: list[Sample], bandwidth: float) -> tuple[float, float]:
    """The 10th and 90th percentile of log(measured / predicted) over ``samples``."""
    return quantile_interval(_residuals(model, samples, bandwidth))


def _residuals(model: LatencyModel, samples: list[Sample], bandwidth: float) -> list[float]:
    return [s.log_ratio(bandwidth) - model.log_ratio(s.features()) for s in samples]


def quantile_interval(residuals: list[float]) -> tuple[float, float]:
    ordered = sorted(residuals)
    return tuple(ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.1, 0.9))  # type: ignore[return-value]


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The goals over ``judge``'s rows: Spearman >= 0.85, top-1 within 1.10x, top 5 within
    1.03x (the median and the least rho None where no row has one)."""
    rhos = sorted(r["spearman"] for r in rows if r["spearman"] is not None)
    return {
        "shapes": len(rows),
        "spearman_median": rhos[len(rhos) // 2] if rhos else None,
        "spearman_min": rhos[0] if rhos else None,
        "spearman_at_least_0.85": sum(r >= 0.85 for r in rhos),
        "top1_within_1.10": sum(r["top1_over_best"] <= 1.10 for r in rows),
        "top5_within_1.03": sum(r["top5_best_over_best"] <= 1.03 for r in rows),
    }


def fit_and_judge(
    samples: list[Sample],
    held_out: Callable[[Sample], bool],
    *,
    gpu: str,
    bandwidth: float,
    sources: list[str],
) -> tuple[LatencyModel, list[dict[str, Any]]]:
    """Fit to the samples ``held_out`` rejects; judge on the others, whose residuals give
    the interval. The model records its data, held-out shapes and their accuracy."""
    train = [s for s in samples if not held_out(s)]
    test = [s for s in samples if held_out(s)]
    if not train or not test:
        raise UsageError(f"{len(train)} timings to fit to and {len(test)} held out: both must be some")
    model = fit(train, gpu=gpu, bandwidth=bandwidth, trained={})
    rows = judge(model, test)
    named = sorted({(s.problem.batch, s.problem.heads, s.problem.seqlen) for s in test})
    how = "held out: " + ",".join("x".join(map(str, shape)) for shape in named)
    trained = _trained(sources, train, test, rows, how)
    return replace(model, interval=residual_interval(model, test, bandwidth), trained=trained), rows


def fit_each_shape_out(
    samples: list[Sample], *, gpu: str, bandwidth: float, sources: list[str], folds: int | None = None
) -> tuple[LatencyModel, list[dict[str, Any]]]:
    """Judge by leaving each shape out in turn (a fit to the others ranks its configs, and
    their residuals give the interval), then fit to every sample: a calibration to a
    user's GPU from a storage of a few studies, none held back from the model it ships.
    ``folds``: leave the sorted shapes out in that many interleaved sets instead, one fit
    each (a bounded time: the refit at the end of a GPU run)."""
    shapes = sorted({s.shape for s in samples})
    if len(shapes) < 2:
        raise UsageError(
            f"all {len(samples)} timings are of one shape: judging a model on shapes it never saw "
            "needs two or more (tune another shape into the storage)"
        )
    sets = (
        [shapes[i::folds] for i in range(folds)] if folds and folds < len(shapes) else [[s] for s in shapes]
    )
    rows, residuals = [], []
    for left in map(set, sets):
        out = [s for s in samples if s.shape in left]
        model = fit([s for s in samples if s.shape not in left], gpu=gpu, bandwidth=bandwidth, trained={})
        rows += judge(model, out)
        residuals += _residuals(model, out, bandwidth)
    model = fit(samples, gpu=gpu, bandwidth=bandwidth, trained={})
    how = (
        "each shape left out in turn" if len(sets) == len(shapes) else f"shapes left out in {len(sets)} sets"
    )
    trained = _trained(sources, samples, samples, rows, how)
    return replace(model, interval=quantile_interval(residuals), trained=trained), rows


def _trained(sources: list[str], train: list, test: list, rows: list, how: str) -> dict[str, Any]:
    """What a model records of its making: its data, how it was judged, and how well."""
    return {
        "data": sources,
        "timings": len(train),
        "held_out_timings": len(test),
        "judged_on": how,
        "held_out": summary(rows),
        "params": TREE_PARAMS,
    }
