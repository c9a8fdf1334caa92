"""The decay's figures: the mask, the fp16 overflow map and the kernel's error by decay
(``reports.decays``' values, drawn)."""

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from reports.decays import GammaInfo, OverflowInfo
from reports.style import HOVER, INFEASIBLE, LABELS, layout, value_axis


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
    return layout(
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
    return layout(
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
    fig.update_yaxes(title=LABELS["rel_l2"], **value_axis(err.rel_l2))
    return layout(
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
