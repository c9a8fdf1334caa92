"""The bench's figure (``python -m tuner bench`` writes it as bench.html): time over the
HBM floor per shape and implementation, from the bench's rows (``tuner.bench.run``).

Each row is a dict with ``batch``, ``heads``, ``seqlen``, ``impl`` and, where it was timed,
``median_ms`` and ``x_floor`` (and ``config``, the hover text, for kernel rows). A packed
batch's rows name it in ``packed``; there ``batch`` counts its sequences and ``seqlen``
their tokens. Backward rows name their ``pass`` and are over the backward's floor.
"""

from typing import Any

import plotly.graph_objects as go


def figure(rows: list[dict[str, Any]]) -> go.Figure:
    """Grouped bars: time over the HBM floor, per shape and implementation."""
    fig = go.Figure()

    def shape(r: dict[str, Any]) -> str:
        if r.get("packed"):  # batch: the sequences; seqlen: their tokens in all
            return f"packed: {r['packed']}, T={r['seqlen']} H={r['heads']}"
        return f"B={r['batch']} H={r['heads']} S={r['seqlen']}"

    peer = lambda impl: 2 if impl.startswith("torch") else 1 if impl.startswith("fla") else 0  # noqa: E731
    names = dict.fromkeys(r["impl"] for r in rows if r["impl"] not in ("floor", "candidate"))
    for impl in sorted(names, key=peer):  # ours, fla, torch; each in the rows' order
        sel = [r for r in rows if r["impl"] == impl and "x_floor" in r]
        fig.add_bar(
            name=impl,
            x=[shape(r) for r in sel],
            y=[r["x_floor"] for r in sel],
            text=[f"{r['median_ms']:.3f} ms" for r in sel],
            hovertext=[r.get("config", "") for r in sel],
        )
    fig.add_hline(y=1.0, line_dash="dash", annotation_text="HBM floor")
    fig.update_layout(
        barmode="group",
        yaxis_type="log",
        yaxis_title="time / HBM floor",
        title="Scalar-decay linear attention in the model form (RetNet's decay per head, "
        "scale, final state): forward, backward, forward plus backward; one GPU",
    )
    return fig
