"""The names of what one (problem, config) trial records, in the trial log's column order:
the config's knobs, the check's and the timing's measures, the probe's resources. The
trial log (``tuner.trials``) writes these columns and the report (``reports.data``) reads
them."""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from kernel.config import KernelConfig
from kernel.environment import ENVIRONMENT_KEYS

PARAMS = tuple(f.name for f in dataclasses.fields(KernelConfig))
TIMES = ("median_ms", "p20_ms", "p80_ms")


def measured_ms(value: Any) -> float:
    """A recorded time in ms (a table's entry, a sweep's row): a positive finite number,
    no bool; else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"median_ms {value!r}, expected a time in ms")
    return float(value)


# What a GPU measurement records (a cached trial copies them, with "finite").
MEASURES = (*TIMES, "reps", "rel_l2", "nan_count")
RESOURCES = (
    "registers",
    "spill_bytes",
    "spill_stores",
    "spill_loads",
    "stack_frame",
    "static_smem",
    "dynamic_smem",
    "smem_bytes",
    "threads_launched",
    "seed_register_estimate",
    "compile_seconds",
)
# What the latency model (``tuner.latency``) predicts for a compiled config: the time as a
# ratio to the HBM floor, its interval, the time in ms where calibrated, and by what.
PREDICTED = ("predicted_x_floor", "predicted_low", "predicted_high", "predicted_ms", "predicted_by")
# Ends ``predicted_by`` where the config's knobs or head sizes are outside those the model
# was fitted to: an extrapolation, which a compile-only study ranks after the configs it covers.
OUTSIDE = ", outside the knobs it was fitted to"
# The reason of such a compile-only trial: its objective is infinite, and only the predicted
# time orders it among its like (``tuner.trials.best_trials``).
EXTRAPOLATED = (
    "outside the knobs the latency model was fitted to: ranked after those it covers, by its extrapolation"
)
# Starts ``predicted_by`` where the model was not fitted to the architecture: the analytic part alone.
UNCALIBRATED = "analytic part alone"
NO_MODEL = "no latency model could be read"  # ends it where the model file could not be read
# What a decode trial records of its floor (``kernel.validate.check_and_time_decode``): the
# time of a device copy of the states it reads and writes, its time over that, the copy's rate.
FLOOR = ("floor_ms", "x_floor", "copy_bytes_per_s")
TRIAL_COLUMNS = (
    "number",
    "state",
    "status",
    "reason",
    *PARAMS,
    *MEASURES,
    *RESOURCES,
    *PREDICTED,
    *FLOOR,
    "feasible",
    "baseline",
    "gpu_evaluated",
    "cached_from",
    "mode",
    "wall_s",
    "started",
    *(f"env_{k}" for k in ENVIRONMENT_KEYS),
    "constraints",  # JSON text of {name: value - limit}; a dict column would not survive Parquet
)


def predicted_text(record: Mapping[str, Any]) -> str:
    """A trial's or export's recorded prediction (``PREDICTED``) in words, labelled as
    predicted; a missing field may be None or NaN (a trial log's empty cell)."""
    get = lambda key: None if record.get(key) is None or record[key] != record[key] else record[key]  # noqa: E731
    ratio, ms = get("predicted_x_floor"), get("predicted_ms")
    if ratio is None:
        return "no prediction"
    if ms is None:
        return f"predicted {ratio:.2f}x floor ({get('predicted_by')})"
    low, high = (get(key) * ms / ratio for key in ("predicted_low", "predicted_high"))
    outside = OUTSIDE if (get("predicted_by") or "").endswith(OUTSIDE) else ""
    return f"predicted {ms:.3g} ms ({low:.3g} to {high:.3g}), {ratio:.2f}x floor{outside}"
