"""What the compiler reports, drawn: registers and spills per config, and one config's
figures on each architecture side by side."""

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from reports.compiled import arch_rank
from reports.style import FEASIBLE, HOVER, INFEASIBLE, layout, points, short


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
        points(
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
    return layout(
        fig,
        title="register budget per config: the seed's fragment arithmetic against ptxas",
        height=600,
        barmode="group",
        bargap=0.15,
        margin={"l": 70, "r": 70, "t": 90, "b": 170},
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
    )


def archs_figure(side: pd.DataFrame) -> go.Figure | None:
    """``compiled.across_archs``: registers, spills and shared memory of each config, one bar per
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
            fig.update_yaxes(title=short(column), row=row, col=1)
    fig.update_xaxes(type="category", categoryorder="category ascending", tickangle=-90, tickfont={"size": 9})
    return layout(
        fig,
        title="the same configs across architectures",
        height=720,
        barmode="group",
        margin={"l": 70, "r": 30, "t": 90, "b": 150},
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
    )
