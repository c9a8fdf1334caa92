"""The report's HTML pieces: its style sheet, sections, figures, tables and numbers, each
escaped. ``reports.page`` lays them out."""

import html
import math
from collections.abc import Collection
from typing import Any

import pandas as pd
import plotly.graph_objects as go

PLOT_CONFIG = {"displaylogo": False, "responsive": True}
CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0;
       background: #f4f5f7; color: #1d2430; }
main { max-width: 1500px; margin: 0 auto; padding: 24px 32px 48px; }
h1 { font-size: 26px; margin: 0 0 6px; }
h2 { font-size: 21px; margin: 0 0 4px; }
h3 { font-size: 16px; margin: 18px 0 4px; }
section { background: white; border-radius: 8px; padding: 18px 22px; margin: 18px 0;
          box-shadow: 0 1px 3px rgba(0,0,0,.08); }
.lede { color: #4a5568; margin: 2px 0 10px; max-width: 110ch; }
.note { color: #6b4f00; background: #fff8e1; border-left: 4px solid #f5b700; padding: 8px 12px;
        margin: 10px 0; }
.banner { font-size: 17px; font-weight: 600; color: #7a1f1f; background: #fdecea;
          border-left: 6px solid #d62728; padding: 10px 14px; margin: 12px 0; }
.facts { display: flex; flex-wrap: wrap; gap: 8px 28px; margin: 10px 0; }
.facts div { min-width: 160px; }
.facts b { display: block; font-size: 12px; color: #6b7280; font-weight: 600; text-transform: uppercase;
           letter-spacing: .04em; }
.facts span { font-size: 16px; }
.headline { font-size: 19px; margin: 12px 0 2px; } .headline strong { color: #1a7f37; }
nav a { margin-right: 14px; color: #1f5fbf; text-decoration: none; }
.grid2 { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 14px; }
@media (max-width: 1100px) { .grid2 { grid-template-columns: minmax(0, 1fr); } }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; font-size: 13.5px; margin: 6px 0 4px; }
th, td { padding: 5px 8px; text-align: right; border-bottom: 1px solid #e5e7eb; white-space: nowrap; }
th { background: #eef1f5; }
td.text, th.text { text-align: left; }
td.wrap { white-space: normal; max-width: 80ch; }
tr.baseline td { background: #fff3e0; } tr:hover td { background: #eef6ff; }
code { font-size: 13px; }
"""


def section(parts: list[str]) -> str:
    return "<section>" + "\n".join(parts) + "</section>"


def figure(fig: go.Figure | None, div_id: str, missing: str) -> str:
    if fig is None:
        return f'<p class="note">{escape(missing)}</p>'
    return fig.to_html(
        full_html=False,
        include_plotlyjs=False,
        div_id=div_id,
        config=PLOT_CONFIG,
        default_width="100%",
        default_height=f"{fig.layout.height}px",
    )


def html_table(
    frame: pd.DataFrame,
    *,
    text: Collection[str],
    wrap: Collection[str] = (),
    highlight: list[bool] | None = None,
) -> str:
    """Text columns align left, ``wrap`` ones also wrap; ``highlight`` marks rows (the baseline)."""
    head = "".join(f'<th class="{"text" if c in text else ""}">{escape(c)}</th>' for c in frame.columns)
    rows = []
    for i, row in enumerate(frame.itertuples(index=False)):
        cls = ' class="baseline"' if highlight and highlight[i] else ""
        cells = "".join(
            f'<td class="{"text" if c in text else ""}{" wrap" if c in wrap else ""}">{escape(v)}</td>'
            for c, v in zip(frame.columns, row)
        )
        rows.append(f"<tr{cls}>{cells}</tr>")
    body = "".join(rows)
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def num(value: Any, fmt: str, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:{fmt}}{unit}"


def escape(value: Any) -> str:
    return html.escape(str(value))
