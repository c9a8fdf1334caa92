"""The report's look, shared by its figures: axis labels, colours, the layout and the
hovering markers every figure draws with."""

from typing import Any

import pandas as pd
import plotly.graph_objects as go

LABELS = {
    "median_ms": "median latency (ms)",
    "predicted_rank": "predicted time / HBM floor (latency model)",
    "rel_l2": "relative L2 error vs reference C",
    "spill_bytes": "spill bytes / thread",
    "smem_bytes": "shared memory / block (B)",
    "registers": "registers / thread (ptxas)",
}
FEASIBLE, INFEASIBLE, UNTIMED = "#1f77b4", "#d62728", "#8c8c8c"
BASELINE, BEST = "#ff7f0e", "#2ca02c"
HOVER = "%{text}<extra></extra>"
FONT = {"family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif", "size": 13}


def layout(fig: go.Figure, *, title: str, height: int, **extra: Any) -> go.Figure:
    layout = {
        "template": "plotly_white",
        "title": {"text": title, "x": 0.01},
        "height": height,
        "font": FONT,
        "margin": {"l": 70, "r": 30, "t": 60, "b": 60},
        "hoverlabel": {"align": "left"},
        "legend": {"orientation": "h", "y": -0.18},
    }
    fig.update_layout(**(layout | extra))
    return fig


def points(
    rows: pd.DataFrame,
    x: str,
    y: str | list[float],
    name: str,
    marker: dict[str, Any],
    *,
    legend: bool = True,
) -> go.Scatter:
    """Trials as markers that hover with their full config (``hover``)."""
    return go.Scatter(
        x=rows[x],
        y=rows[y] if isinstance(y, str) else y,
        mode="markers",
        name=name,
        legendgroup=name,
        showlegend=legend,
        text=rows.hover,
        hovertemplate=HOVER,
        marker=marker,
    )


def value_axis(values: pd.Series) -> dict[str, Any]:
    """Log scale for values over a decade or more apart; else linear, in e-notation when small."""
    v = values[values > 0]
    if len(v) and v.max() / v.min() >= 10:
        return {"type": "log", "exponentformat": "e"}
    return {"type": "linear", "tickformat": ".2e" if len(v) and v.max() < 1e-2 else None}


def short(column: str) -> str:
    return {
        "median_ms": "latency",
        "predicted_rank": "predicted time",
        "rel_l2": "error",
        "spill_bytes": "spills",
        "smem_bytes": "shared memory",
        "registers": "registers",
    }.get(column, column)
