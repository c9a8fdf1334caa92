"""What the compiler reported, from the trial log (``reports.data.report_frame``'s frame):
registers and spills per compiled config, and one config's figures on each architecture.
Pure functions, as ``reports.data``'s; ``reports.compiler_figures`` draws them."""

import pandas as pd

from kernel.arch import ARCHS
from kernel.trial_schema import PARAMS
from reports.data import FINISHED, config_label

# What ``across_archs`` shows of one config on one architecture.
ARCH_COLUMNS = ("config", "arch", "status", "registers", "spill_bytes", "smem_bytes", "median_ms", "reason")


def register_budget(frame: pd.DataFrame) -> pd.DataFrame:
    """Each compiled config once: the seed's fragment arithmetic next to ptxas' registers and
    spills (``seed_register_estimate``, ``registers``, ``spill_bytes``), plus ``feasible``."""
    has = frame[frame.registers.notna()].sort_values("number").drop_duplicates("config")
    cols = [
        "number",
        "config",
        "seed_register_estimate",
        "registers",
        "spill_bytes",
        "feasible",
        "status",
        "hover",
    ]
    return has[cols].reset_index(drop=True)


def across_archs(trials: pd.DataFrame) -> pd.DataFrame:
    """The configs finished on more than one architecture, side by side. ``trials``: trial
    logs of one problem, of any studies and environments (concatenated ``trials_frame``s),
    the architecture in ``env_arch``. One row per (config, architecture), from the latest
    finished trial (by start) of that config there: ``ARCH_COLUMNS``, the reason's first
    line only. Sorted by config label, then architecture in ``kernel.arch.ARCHS`` order;
    empty when no config was finished on two architectures."""
    done = trials[trials.state.isin(FINISHED) & trials.env_arch.notna() & (trials.status != "interrupted")]
    done = done.assign(
        config=[config_label(row) for row in done[list(PARAMS)].to_dict("records")],
        arch=done.env_arch,
        **{
            c: pd.to_numeric(done[c], errors="coerce").astype(float)
            for c in ("registers", "spill_bytes", "smem_bytes", "median_ms")
        },
        reason=done.reason.map(
            lambda r: r.strip().splitlines()[0][:160] if isinstance(r, str) and r.strip() else ""
        ),
    )
    latest = done.sort_values(["started", "number"]).drop_duplicates(["config", "arch"], keep="last")
    shared = latest[latest.groupby("config").arch.transform("nunique") > 1]
    shared = shared.assign(rank=shared.arch.map(arch_rank))
    return shared.sort_values(["config", "rank"])[list(ARCH_COLUMNS)].reset_index(drop=True)


def arch_rank(name: str) -> tuple[int, str]:
    """Sorts architectures as ``kernel.arch.ARCHS`` lists them, any other after them by name."""
    order = list(ARCHS)
    return (order.index(name) if name in order else len(order), name)
