"""The report's figures: plotly drawings of ``reports.data``'s frames and NamedTuples.

Nothing here computes a number the page reports; each function only draws what it is
given, and returns ``None`` when there is nothing to draw (the page then shows a note).
"""

import math
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from reports.data import Importance, ParetoInfo, PeerInfo, Summary, arch_rank
from reports.decays import GammaInfo, OverflowInfo

LABELS = {
    "median_ms": "median latency (ms)",
    "rel_l2": "relative L2 error vs reference C",
    "spill_bytes": "spill bytes / thread",
    "smem_bytes": "shared memory / block (B)",
    "registers": "registers / thread (ptxas)",
}
FEASIBLE, INFEASIBLE, UNTIMED = "#1f77b4", "#d62728", "#8c8c8c"
BASELINE, BEST = "#ff7f0e", "#2ca02c"
HOVER = "%{text}<extra></extra>"
FONT = {"family": "system-ui, -apple-system, Segoe UI, Roboto, sans-serif", "size": 13}


def _layout(fig: go.Figure, *, title: str, height: int, **extra: Any) -> go.Figure:
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


def _points(
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
            fig.add_trace(_points(hit, x, y, name, marker, legend=legend), row=row, col=col)


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
        fig.add_trace(_points(info.infeasible, info.x, info.y, "infeasible", marker, legend=legend), **rc)
    if untimed_y is not None and not info.untimed.empty:
        marker = {"symbol": "x-thin-open", "size": 9, "line": {"width": 1.5, "color": UNTIMED}}
        fig.add_trace(
            _points(
                info.untimed,
                info.x,
                [untimed_y] * len(info.untimed),
                "compiled but not timed (drawn at the top)",
                marker,
                legend=legend,
            ),
            **rc,
        )
    marker = {"size": 8, "color": FEASIBLE, "opacity": 0.75}
    fig.add_trace(_points(info.feasible, info.x, info.y, "feasible", marker, legend=legend), **rc)
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
    fig.update_yaxes(title=LABELS.get(info.y, info.y), **_value_axis(values))
    return _layout(fig, title=f"{_short(info.y)} against {_short(info.x)}", height=480)


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
    return _layout(fig, title=f"{_short(infos[0].y)} against resources", height=500)


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
    return _layout(fig, title=f"{_short(metric)} per knob (feasible trials)", height=430)


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
    return _layout(fig, title=f"knob importance for {_short(metric)}", height=60 + 45 * len(names) + 80)


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
    return _layout(fig, title="optimisation history", height=430)


def gamma_figure(info: GammaInfo) -> go.Figure:
    """The decay mask as the seed draws it: query position i down, key position j across."""
    c = info.chunk
    fig = go.Figure(
        go.Heatmap(
            z=info.gamma,
            x=np.arange(c),
            y=np.arange(c),
            colorscale="Viridis",
            zmin=float(np.nanmin(info.gamma)),
            zmax=1.0,
            colorbar={"title": "Γ"},
            hovertemplate="i=%{y}, j=%{x}: Γ=%{z:.4g}<extra></extra>",
            hoverongaps=False,
        )
    )
    fig.update_xaxes(title="key position j", constrain="domain")
    fig.update_yaxes(title="query position i", autorange="reversed", scaleanchor="x", constrain="domain")
    return _layout(
        fig,
        title=f"decay mask Γ (α = {info.alpha:g}, C = {c}, the best config's chunk)<br>"
        f"<sup>Γ[i, j] = α^(i−j) for j ≤ i, blank above the diagonal; smallest "
        f"α^(C−1) = {info.alpha ** (c - 1):.3g}</sup>",
        height=540,
        margin={"l": 70, "r": 30, "t": 80, "b": 60},
    )


def overflow_figure(
    info: OverflowInfo, *, alpha: float | None = None, chunks: tuple[int, ...] = ()
) -> go.Figure:
    """alpha x C cells: green where the factorised form's peak weight fits fp16, red where
    it overflows; ``alpha`` (the study's smallest decay) at the tuned chunks is outlined."""
    text = [[_peak_text(p) for p in row] for row in info.peak]
    fig = go.Figure(
        go.Heatmap(
            z=info.overflow.astype(float),
            x=[str(c) for c in info.chunks],
            y=[f"{a:g}" for a in info.alphas],
            text=text,
            texttemplate="%{text}",
            textfont={"size": 12},
            zmin=0,
            zmax=1,
            showscale=False,
            xgap=2,
            ygap=2,
            colorscale=[[0, "#c7e9c0"], [0.5, "#c7e9c0"], [0.5, "#fcbba1"], [1, "#fcbba1"]],
            hovertemplate="α=%{y}, C=%{x}: α^-(C-1) = %{text}<extra></extra>",
        )
    )
    for ai, a in enumerate(info.alphas):
        for ci, c in enumerate(info.chunks):
            if alpha is not None and math.isclose(a, alpha) and c in chunks:
                fig.add_shape(
                    type="rect",
                    x0=ci - 0.5,
                    x1=ci + 0.5,
                    y0=ai - 0.5,
                    y1=ai + 0.5,
                    line={"color": "black", "width": 3},
                )
    fig.update_xaxes(title="chunk C", type="category")
    fig.update_yaxes(title="α", type="category")
    return _layout(
        fig,
        title=f"overflow map of the factorised form: peak weight α^-(C−1)<br><sup>green: "
        f"fits fp16 (≤ {info.limit:,.0f}); red: overflows; outlined: this study's smallest α "
        "and its chunks</sup>",
        height=540,
        margin={"l": 70, "r": 30, "t": 80, "b": 60},
    )


def _peak_text(p: float) -> str:
    if math.isinf(p):
        return "inf"
    return f"{p:.3g}" if p < 1e4 else f"{p:.1e}"


def error_figure(err: pd.DataFrame, tolerance: float | None) -> go.Figure | None:
    """The kernel's measured error (the worse of the output's and the final state's) at
    the study's decays, one point per trial, a colour per chunk."""
    if err.empty:
        return None
    fig = go.Figure()
    ok = err[err.feasible]
    for chunk in sorted(ok.chunk.unique()):
        part = ok[ok.chunk == chunk]
        fig.add_trace(_strip(part, name=f"C = {chunk:g}", color=None))
    bad = err[~err.feasible]
    if len(bad):
        fig.add_trace(_strip(bad, name="incorrect (over tolerance)", color=INFEASIBLE))
    if tolerance is not None and err.rel_l2.max() >= tolerance / 10:  # else the line would squash the points
        fig.add_hline(
            y=tolerance,
            line={"dash": "dash", "color": INFEASIBLE},
            annotation={"text": f"tolerance {tolerance:g}", "font": {"color": INFEASIBLE}},
        )
    below = "" if tolerance is None else f"; tolerance {tolerance:g}"
    fig.update_xaxes(title="the study's decays", type="category")
    fig.update_yaxes(title=LABELS["rel_l2"], **_value_axis(err.rel_l2))
    return _layout(
        fig, title=f"kernel error against reference C (stored trials{below})", height=430, boxmode="group"
    )


def _strip(part: pd.DataFrame, *, name: str, color: str | None) -> go.Box:
    """A thin box with every trial as a jittered point."""
    return go.Box(
        x=part.decay,
        y=part.rel_l2,
        name=name,
        boxpoints="all",
        jitter=0.6,
        pointpos=0,
        text=part.hover,
        hovertemplate=HOVER,
        line={"width": 1},
        marker={"size": 6, **({"color": color} if color else {})},
        **({"line_color": color} if color else {}),
    )


def registers_figure(reg: pd.DataFrame, limit: float | None) -> go.Figure | None:
    """Per compiled config: the seed's fragment estimate next to ptxas' registers, and spills."""
    if reg.empty:
        return None
    reg = reg.sort_values(["seed_register_estimate", "registers", "config"])
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_trace(
        go.Bar(
            x=reg.config,
            y=reg.seed_register_estimate,
            name="seed's fragment estimate",
            marker={"color": "#aec7e8"},
            text=reg.hover,
            hovertemplate=HOVER,
        )
    )
    fig.add_trace(
        go.Bar(
            x=reg.config,
            y=reg.registers,
            name="ptxas registers",
            marker={"color": FEASIBLE},
            text=reg.hover,
            hovertemplate=HOVER,
        )
    )
    spilled = reg[reg.spill_bytes > 0]
    fig.add_trace(
        _points(
            spilled,
            "config",
            "spill_bytes",
            "spill bytes (right axis)",
            {"symbol": "diamond", "size": 8, "color": INFEASIBLE},
        ),
        secondary_y=True,
    )
    if limit is not None:
        fig.add_hline(
            y=limit,
            line={"dash": "dash", "color": "black", "width": 1},
            annotation={"text": f"register budget {limit:.0f}"},
        )
    fig.update_xaxes(
        title="config C/bDV/stages/threads/scores/segments (sorted by the seed's estimate)",
        type="category",
        tickangle=-90,
        tickfont={"size": 9},
    )
    fig.update_yaxes(title="registers / thread", secondary_y=False)
    fig.update_yaxes(title="spill bytes", secondary_y=True, showgrid=False, rangemode="tozero")
    return _layout(
        fig,
        title="register budget per config: the seed's fragment arithmetic against ptxas",
        height=600,
        barmode="group",
        bargap=0.15,
        margin={"l": 70, "r": 70, "t": 90, "b": 170},
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
    )


def archs_figure(side: pd.DataFrame) -> go.Figure | None:
    """``data.across_archs``: registers, spills and shared memory of each config, one bar per
    architecture; an architecture where the config did not compile has no bar."""
    compiled = side[side.registers.notna()]
    if compiled.empty:
        return None
    rows = ("registers", "spill_bytes", "smem_bytes")
    fig = make_subplots(rows=len(rows), cols=1, shared_xaxes=True, vertical_spacing=0.06)
    hover = [
        f"{r.config} on {r.arch} · {r.status}<br>registers {r.registers:.0f} · spills {r.spill_bytes:,.0f} B"
        f" · smem {r.smem_bytes:,.0f} B"
        for r in compiled.itertuples()
    ]
    compiled = compiled.assign(hover=hover)
    for i, arch in enumerate(sorted(set(side.arch), key=arch_rank)):
        part = compiled[compiled.arch == arch]
        color = qualitative.Plotly[i % len(qualitative.Plotly)]
        for row, column in enumerate(rows, start=1):
            fig.add_trace(
                go.Bar(
                    x=part.config,
                    y=part[column],
                    name=arch,
                    legendgroup=arch,
                    showlegend=row == 1,
                    marker={"color": color},
                    text=part.hover,
                    textposition="none",
                    hovertemplate=HOVER,
                ),
                row=row,
                col=1,
            )
            fig.update_yaxes(title=_short(column), row=row, col=1)
    fig.update_xaxes(type="category", categoryorder="category ascending", tickangle=-90, tickfont={"size": 9})
    return _layout(
        fig,
        title="the same configs across architectures",
        height=720,
        barmode="group",
        margin={"l": 70, "r": 30, "t": 90, "b": 150},
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
    )


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
    return _layout(fig, title="peers, timed in the same run", height=120 + 50 * len(bars))


def _value_axis(values: pd.Series) -> dict[str, Any]:
    """Log scale for values over a decade or more apart; else linear, in e-notation when small."""
    v = values[values > 0]
    if len(v) and v.max() / v.min() >= 10:
        return {"type": "log", "exponentformat": "e"}
    return {"type": "linear", "tickformat": ".2e" if len(v) and v.max() < 1e-2 else None}


def _short(column: str) -> str:
    return {
        "median_ms": "latency",
        "rel_l2": "error",
        "spill_bytes": "spills",
        "smem_bytes": "shared memory",
        "registers": "registers",
    }.get(column, column)
