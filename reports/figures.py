"""The study's figures: plotly drawings of ``reports.data``'s frames and NamedTuples (the
decay's are in ``reports.decay_figures``, the compiler's in ``reports.compiler_figures``).

Nothing here computes a number the page reports; each function only draws what it is
given, and returns ``None`` when there is nothing to draw (the page then shows a note).
"""

import math

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from reports.data import Summary
from reports.peers import PeerInfo
from reports.search import Importance, ParetoInfo
from reports.style import (
    BASELINE,
    BEST,
    FEASIBLE,
    HOVER,
    INFEASIBLE,
    LABELS,
    UNTIMED,
    layout,
    points,
    short,
    value_axis,
)


def _marked(
    fig: go.Figure,
    rows: pd.DataFrame,
    s: Summary,
    x: str,
    y: str,
    *,
    row: int | None = None,
    col: int | None = None,
    legend: bool = True,
) -> None:
    """Over-draw the baseline and the best trial where they are among ``rows``."""
    outline = {"width": 1, "color": "black"}
    # The best first and larger, so that a baseline that is also the best still shows.
    for number, name, marker in (
        (
            s.best,
            f"best feasible (by {s.objectives[0]})",
            {"symbol": "diamond", "size": 18, "color": BEST, "line": outline},
        ),
        (
            s.baseline,
            "baseline (seed default)",
            {"symbol": "star", "size": 14, "color": BASELINE, "line": outline},
        ),
    ):
        hit = rows[rows.number == number]
        if number is not None and not hit.empty:
            fig.add_trace(points(hit, x, y, name, marker, legend=legend), row=row, col=col)


def _pareto_traces(
    fig: go.Figure,
    info: ParetoInfo,
    s: Summary,
    *,
    row: int | None = None,
    col: int | None = None,
    legend: bool = True,
    untimed_y: float | None = None,
) -> None:
    rc = {"row": row, "col": col}
    if not info.infeasible.empty:
        marker = {"symbol": "x", "size": 8, "color": INFEASIBLE}
        fig.add_trace(points(info.infeasible, info.x, info.y, "infeasible", marker, legend=legend), **rc)
    if untimed_y is not None and not info.untimed.empty:
        marker = {"symbol": "x-thin-open", "size": 9, "line": {"width": 1.5, "color": UNTIMED}}
        fig.add_trace(
            points(
                info.untimed,
                info.x,
                [untimed_y] * len(info.untimed),
                (
                    "outside the latency model's knobs (drawn at the top)"
                    if s.metric == "predicted_rank"
                    else "compiled but not timed (drawn at the top)"
                ),
                marker,
                legend=legend,
            ),
            **rc,
        )
    marker = {"size": 8, "color": FEASIBLE, "opacity": 0.75}
    fig.add_trace(points(info.feasible, info.x, info.y, "feasible", marker, legend=legend), **rc)
    fig.add_trace(
        go.Scatter(
            x=info.front[info.x],
            y=info.front[info.y],
            mode="lines",
            name="Pareto front",
            legendgroup="front",
            showlegend=legend,
            hoverinfo="skip",
            line={"shape": "hv", "color": FEASIBLE, "width": 2},
        ),
        **rc,
    )
    _marked(fig, pd.concat([info.feasible, info.infeasible]), s, info.x, info.y, legend=legend, **rc)


def pareto_figure(info: ParetoInfo, s: Summary) -> go.Figure | None:
    """One (x, y) Pareto plot, e.g. latency against error."""
    if info.feasible.empty and info.infeasible.empty:
        return None
    fig = go.Figure()
    _pareto_traces(fig, info, s)
    fig.update_xaxes(title=LABELS.get(info.x, info.x))
    values = pd.concat([info.feasible[info.y], info.infeasible[info.y]])
    fig.update_yaxes(title=LABELS.get(info.y, info.y), **value_axis(values))
    return layout(fig, title=f"{short(info.y)} against {short(info.x)}", height=480)


def resources_figure(infos: list[ParetoInfo], s: Summary) -> go.Figure | None:
    """Panels sharing the y axis (latency, or a resource when nothing was timed), one resource
    each. Trials with a resource but no y (never timed) are drawn in a band at the top."""
    if not infos or all(i.feasible.empty and i.infeasible.empty and i.untimed.empty for i in infos):
        return None
    ys = pd.concat([pd.concat([i.feasible[i.y], i.infeasible[i.y]]) for i in infos]).dropna()
    top = float(ys.max()) if len(ys) else 1.0
    untimed_y = top * 1.12 if top > 0 else 1.0
    fig = make_subplots(rows=1, cols=len(infos), shared_yaxes=True, horizontal_spacing=0.03)
    dashed = {"dash": "dash", "color": INFEASIBLE, "width": 1}
    for k, info in enumerate(infos, start=1):
        _pareto_traces(fig, info, s, row=1, col=k, legend=k == 1, untimed_y=untimed_y)
        limit = s.budgets.get(info.x)
        if limit is not None and math.isfinite(limit):
            fig.add_vline(
                x=limit,
                line=dashed,
                row=1,
                col=k,
                annotation={"text": f"budget {limit:,.0f}", "font": {"size": 11, "color": INFEASIBLE}},
            )
        fig.update_xaxes(title=LABELS.get(info.x, info.x), row=1, col=k)
    limit = s.budgets.get(infos[0].y)
    if limit is not None and math.isfinite(limit):
        fig.add_hline(y=limit, line=dashed, row=1, col="all")
    fig.update_yaxes(title=LABELS.get(infos[0].y, infos[0].y), row=1, col=1)
    return layout(fig, title=f"{short(infos[0].y)} against resources", height=500)


def knobs_figure(long: pd.DataFrame, metric: str) -> go.Figure | None:
    """Box plots with every feasible trial as a point, one panel per knob."""
    if long.empty:
        return None
    knobs = list(dict.fromkeys(long.knob))
    fig = make_subplots(
        rows=1, cols=len(knobs), shared_yaxes=True, horizontal_spacing=0.02, subplot_titles=knobs
    )
    for k, knob in enumerate(knobs, start=1):
        part = long[long.knob == knob]
        fig.add_trace(
            go.Box(
                x=part.choice,
                y=part.value,
                boxpoints="all",
                jitter=0.5,
                pointpos=0,
                name=knob,
                text=part.hover,
                hovertemplate=HOVER,
                marker={"size": 5, "color": FEASIBLE},
                line={"width": 1.5},
                fillcolor="rgba(31,119,180,0.12)",
                showlegend=False,
            ),
            row=1,
            col=k,
        )
        order = list(dict.fromkeys(part.choice))  # knob_frame sorts the choices by value
        fig.update_xaxes(type="category", categoryorder="array", categoryarray=order, row=1, col=k)
    fig.update_yaxes(title=LABELS.get(metric, metric), row=1, col=1)
    return layout(fig, title=f"{short(metric)} per knob (feasible trials)", height=430)


def importance_figure(imp: Importance, metric: str) -> go.Figure | None:
    if not imp.values:
        return None
    names = list(imp.values)[::-1]  # the most important at the top
    vals = [imp.values[n] for n in names]
    fig = go.Figure(
        go.Bar(
            x=vals,
            y=names,
            orientation="h",
            marker={"color": FEASIBLE},
            text=[f"{v:.2f}" for v in vals],
            textposition="outside",
            cliponaxis=False,
            hovertemplate="%{y}: %{x:.3f}<extra></extra>",
        )
    )
    fig.update_xaxes(title="importance (Optuna's PED-ANOVA, sums to 1)", range=[0, 1.05])
    return layout(fig, title=f"knob importance for {short(metric)}", height=60 + 45 * len(names) + 80)


def history_figure(hist: pd.DataFrame, metric: str, s: Summary) -> go.Figure | None:
    ok = hist[hist.feasible & hist.value.notna()]
    if ok.empty:
        return None
    fig = go.Figure(
        [
            go.Scatter(
                x=ok.number,
                y=ok.value,
                mode="markers",
                name="feasible trial",
                text=ok.hover,
                hovertemplate=HOVER,
                marker={"size": 7, "color": FEASIBLE, "opacity": 0.7},
            ),
            go.Scatter(
                x=hist.number,
                y=hist.best,
                mode="lines",
                name="best so far",
                hoverinfo="skip",
                line={"shape": "hv", "color": BEST, "width": 2.5},
            ),
        ]
    )
    _marked(fig, ok.rename(columns={"value": metric}), s, "number", metric)
    n_bad = int((~hist.feasible).sum())
    fig.update_xaxes(title=f"trial number ({n_bad} infeasible or failed trials not drawn)")
    fig.update_yaxes(title=LABELS.get(metric, metric))
    return layout(fig, title="optimisation history", height=430)


def peers_figure(info: PeerInfo) -> go.Figure | None:
    if info.bars.empty:
        return None
    bars = info.bars.iloc[::-1]  # the fastest at the top
    labels = [
        f"{ms:.3f} ms" + ("" if math.isnan(r) else f" ({r:.2f}× ours)")
        for ms, r in zip(bars.median_ms, bars.vs_ours)
    ]
    fig = go.Figure(
        go.Bar(
            x=bars.median_ms,
            y=bars.name,
            orientation="h",
            text=labels,
            textposition="auto",
            marker={"color": [BEST if o else UNTIMED for o in bars.ours]},
            hovertemplate="%{y}: %{x:.4f} ms<extra></extra>",
        )
    )
    fig.update_xaxes(title=LABELS["median_ms"])
    return layout(fig, title="peers, timed in the same run", height=120 + 50 * len(bars))


def prediction_figure(rows: pd.DataFrame) -> go.Figure | None:
    """Measured against predicted time, log-log, with the line where they agree."""
    if rows.empty:
        return None
    low = min(rows.predicted_ms.min(), rows.median_ms.min())
    high = max(rows.predicted_ms.max(), rows.median_ms.max())
    fig = go.Figure(
        [
            go.Scatter(
                x=[low, high], y=[low, high], mode="lines", name="measured = predicted",
                hoverinfo="skip", line={"color": UNTIMED, "dash": "dash"},
            ),
            go.Scatter(
                x=rows.predicted_ms, y=rows.median_ms, mode="markers", name="feasible trial",
                text=rows.hover, hovertemplate=HOVER, marker={"size": 8, "color": FEASIBLE, "opacity": 0.8},
            ),
        ]
    )  # fmt: skip
    fig.update_xaxes(title="predicted time (ms, tuner.latency)", type="log")
    fig.update_yaxes(title=LABELS["median_ms"], type="log")
    return layout(fig, title="measured against predicted", height=430)
