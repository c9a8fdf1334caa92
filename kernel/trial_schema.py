"""The names of what one (problem, config) trial records, in the trial log's column order:
the config's knobs, the check's and the timing's measures, the probe's resources. The
trial log (``tuner.trials``) writes these columns and the report (``reports.data``) reads
them."""

import dataclasses

from kernel.config import KernelConfig
from kernel.environment import ENVIRONMENT_KEYS

PARAMS = tuple(f.name for f in dataclasses.fields(KernelConfig))
TIMES = ("median_ms", "p20_ms", "p80_ms")
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
TRIAL_COLUMNS = (
    "number",
    "state",
    "status",
    "reason",
    *PARAMS,
    *MEASURES,
    *RESOURCES,
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
