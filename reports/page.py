"""Trial log + study info -> one self-contained HTML page: ``reports.data`` computes,
``reports.figures`` draws, this module lays the figures and tables out and writes the file.

The page embeds plotly.js once in its head, so it opens offline; each figure is a div and
a call to ``Plotly.newPlot`` with a fixed id (``fig-...``), so the output is reproducible.
"""

import html
import math
from pathlib import Path

import pandas as pd
from plotly.offline import get_plotlyjs

from kernel.files import replacing
from kernel.trial_schema import PARAMS, predicted_text
from reports import compiled, data, decays, figures, markup, search, sections, style
from reports.data import StudyInfo, Summary, plain_text


def render_report(frame: pd.DataFrame, info: StudyInfo, *, across: pd.DataFrame | None = None) -> str:
    """The whole page for a study (GPU or compile-only), as one HTML string. ``frame`` is its
    trial log (``tuner.trials.trials_frame``; ``reports.data.FRAME_COLUMNS``), ``info`` its
    study-level attrs. ``across``: the trial logs of the problem on every architecture
    (``tuner.trials.problem_trials``); configs finished on two or more are shown side by
    side. A malformed ``info.peers`` or a frame without trials is a ``ValueError``."""
    if frame.empty:
        raise ValueError(f"study {info.name!r} has no trials: nothing to report")
    frame = data.report_frame(frame, info)
    s = data.summary(frame, info)
    metric = s.metric
    side = (
        compiled.across_archs(across) if across is not None else pd.DataFrame(columns=compiled.ARCH_COLUMNS)
    )
    body = "\n".join(
        [
            _header(s, frame, archs=not side.empty),
            _fronts(s, frame, metric),
            _insight(info, s, frame, metric),
            _top_and_failures(s, frame),
            _numerics(info, s, frame),
            sections.peers(info, frame),
            sections.archs(side),
        ]
    )
    title = html.escape(f"decay-tuner report: {s.study}")
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{title}</title>'
        f"<style>{markup.CSS}</style>\n<script>{get_plotlyjs()}</script>\n</head>\n"
        f"<body><main>\n{body}\n</main></body></html>\n"
    )


def write_report(
    frame: pd.DataFrame, info: StudyInfo, out: Path, *, across: pd.DataFrame | None = None
) -> Path:
    """``render_report(frame, info, across=across)`` written to ``out`` atomically; return ``out``."""
    text = render_report(frame, info, across=across)
    with replacing(out) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return out


# Sections -----------------------------------------------------------------------------------


def _numerics(info: StudyInfo, s: Summary, frame: pd.DataFrame) -> str:
    """The section of the kernel's numerics: the decode step's floor, the per-token gate's,
    or the constant decay's."""
    if info.sweep == "decode":
        return sections.decode(s, frame)
    if s.problem.get("gate") == "token":
        return sections.gated_numerics(s, frame)
    return sections.numerics(s, frame)


def _header(s: Summary, frame: pd.DataFrame, *, archs: bool) -> str:
    p, env = s.problem, s.environment
    problem = (
        (
            f"decode N={p.get('batch')} H={p.get('heads')} DK={p.get('dk')} DV={p.get('dv')} "
            f"{p.get('dtype')}, {p.get('pool_dtype')} pool"
        )
        if "pool_dtype" in p
        else (
            f"B={p.get('batch')} H={p.get('heads')} S={p.get('seqlen')} DK={p.get('dk')} "
            f"DV={p.get('dv')} {decays.decay_label(p, s.decays)} {p.get('dtype')}"
        )
        if p
        else "unknown"
    )
    where = (
        (
            f"{env.get('gpu') or 'no GPU'} · TileLang {env.get('tilelang')} · torch {env.get('torch')}"
            + (f" · CUDA {env['cuda']}" if env.get("cuda") else "")
        )
        if env
        else "unknown"
    )
    counts = " · ".join(f"{n} {k}" for k, n in sorted(s.counts.items(), key=lambda kv: -kv[1]))
    facts = {
        "problem": problem,
        "mode": s.mode,
        "objectives": ", ".join(s.objectives),
        "trials": f"{s.n_trials}: {counts}",
        "environment": where,
    }
    cells = "".join(
        f"<div><b>{markup.escape(k)}</b><span>{markup.escape(v)}</span></div>" for k, v in facts.items()
    )
    parts = [f"<h1>decay-tuner report · {markup.escape(s.study)}</h1>", f'<div class="facts">{cells}</div>']
    if not s.timed:
        over = (
            "the latency model's predicted time (tuner.latency), not a measurement"
            if s.metric == "predicted_rank"
            else f"resources ({markup.escape(style.LABELS[s.metric])}), not latency"
        )
        what = (
            "GPU study: no trial was timed yet"
            if s.mode == "gpu"
            else "Compile-only study: nothing was timed (no GPU)"
        )
        parts.append(f'<div class="banner">{what}. The fronts and knob plots are over {over}.</div>')
    parts.append(f'<p class="headline">{_headline(s, frame)}</p>')
    links = {
        "fronts": "Pareto fronts",
        "insight": "parameters",
        "tables": "tables",
        "numerics": "numerics",
        "peers": "peers",
        **({"archs": "architectures"} if archs else {}),
    }
    parts.append("<nav>" + "".join(f'<a href="#{k}">{v}</a>' for k, v in links.items()) + "</nav>")
    return markup.section(parts)


def _headline(s: Summary, frame: pd.DataFrame) -> str:
    rows = frame.set_index("number")
    if s.best is None:
        return "No feasible config in this study."
    best = rows.loc[s.best]
    text = f"Best feasible: <code>{markup.escape(best.config)}</code> (trial {s.best})"
    if not (s.timed and not math.isnan(best.median_ms)):
        return text + (
            f", {markup.escape(predicted_text(best.to_dict()))}, {best.spill_bytes:,.0f} B spilled, "
            f"{best.smem_bytes:,.0f} B shared memory, no latency measured"
        )
    text += f", <strong>{best.median_ms:.4f} ms</strong>"
    if s.baseline is not None and not math.isnan(rows.loc[s.baseline].median_ms):
        base = rows.loc[s.baseline]
        text += (
            f": <strong>{base.median_ms / best.median_ms:.2f}×</strong> the seed default "
            f"<code>{markup.escape(base.config)}</code> ({base.median_ms:.4f} ms)"
        )
    return text


def _fronts(s: Summary, frame: pd.DataFrame, metric: str) -> str:
    parts = [
        '<h2 id="fronts">Pareto fronts</h2>',
        (
            '<p class="lede">Blue: feasible (correct and within every budget); red ×: infeasible; the line '
            "joins the configs no other config beats on both axes. Star: the seed's default config; "
            "diamond: the best feasible config. Hover a point for its full config and measurements.</p>"
        ),
    ]
    if s.timed:
        info = search.pareto_info(frame, x="median_ms", y="rel_l2")
        parts.append(
            markup.figure(
                figures.pareto_figure(info, s), "fig-front-error", "no trial has both a latency and an error"
            )
        )
    else:
        parts.append(
            '<p class="note">No latency or error was measured, so there is no '
            "latency-against-error front.</p>"
        )
    infos = [search.pareto_info(frame, x=r, y=metric) for r in data.RESOURCES if r != metric]
    parts.append(
        markup.figure(
            figures.resources_figure(infos, s), "fig-front-resources", "no trial reported resources"
        )
    )
    untimed = len(infos[0].untimed)
    if s.timed and untimed:
        parts.append(
            f'<p class="lede">{untimed} trials compiled but were never timed (over a budget, the '
            "dashed lines, or failed on the GPU): they are drawn in the grey band at the top, at "
            "their resource value.</p>"
        )
    return markup.section(parts)


def _insight(info: StudyInfo, s: Summary, frame: pd.DataFrame, metric: str) -> str:
    imp = search.importance(frame, info, metric)
    knobs = figures.knobs_figure(search.knob_frame(frame, metric), metric)
    history = figures.history_figure(search.history(frame, metric), metric, s)
    return markup.section(
        [
            '<h2 id="insight">Parameter insight</h2>',
            markup.figure(knobs, "fig-knobs", "no feasible trial"),
            '<div class="grid2"><div>',
            markup.figure(
                figures.importance_figure(imp, metric), "fig-importance", f"parameter importance: {imp.note}"
            ),
            "</div><div>",
            markup.figure(history, "fig-history", "no feasible trial"),
            "</div></div>",
            *_predictions(frame),
        ]
    )


def _predictions(frame: pd.DataFrame) -> list[str]:
    """The latency model's predictions against the GPU's measurements, where the study has
    both; nothing otherwise."""
    rows = search.predicted_against_measured(frame)
    if rows.empty:
        return []
    return [
        *(f'<p class="lede">{markup.escape(line)}.</p>' for line in search.prediction_check(frame, least=1)),
        "<p>Measured over predicted, its spread over the knobs: "
        + ", ".join(
            f"{knob} {markup.escape(plain_text(choice))} {group.ratio.median():.2f}"
            for knob in PARAMS
            for choice, group in rows.groupby(knob)
            if rows[knob].nunique() > 1
        )
        + ".</p>",
        markup.figure(figures.prediction_figure(rows), "fig-predicted", "no trial with both"),
    ]


def _top_and_failures(s: Summary, frame: pd.DataFrame) -> str:
    top = data.top_configs(frame, s.objectives if s.timed else [s.metric, *s.objectives])
    fails = data.failures(frame)
    config = "config (C/bDV/stages/threads/scores/segments)"
    top_shown = pd.DataFrame(
        {
            "trial": top.number.astype(str) + top.baseline.map({True: " (seed default)", False: ""}),
            config: top.config,
            "median ms": top.median_ms.map(lambda v: markup.num(v, ".4f")),
            "p20–p80 ms": [
                f"{markup.num(a, '.4f')}–{markup.num(b, '.4f')}" for a, b in zip(top.p20_ms, top.p80_ms)
            ],
            "speed-up over seed default": top.speedup.map(lambda v: markup.num(v, ".2f", "×")),
            "rel L2": top.rel_l2.map(lambda v: markup.num(v, ".2e")),
            "registers": top.registers.map(lambda v: markup.num(v, ".0f")),
            "seed estimate": top.seed_register_estimate.map(lambda v: markup.num(v, ".0f")),
            "spill B": top.spill_bytes.map(lambda v: markup.num(v, ",.0f")),
            "smem B": top.smem_bytes.map(lambda v: markup.num(v, ",.0f")),
            "predicted": [predicted_text(row) for row in top.to_dict("records")],
        }
    )
    if not s.timed:
        timed = ["median ms", "p20–p80 ms", "speed-up over seed default", "rel L2"]
        top_shown = top_shown.drop(columns=timed)
    reason = "reason (first line)"
    fails_shown = pd.DataFrame(
        {
            "status": fails.status,
            reason: fails.reason,
            "trials": fails["count"],
            "trial numbers": fails.trials.map(lambda n: ", ".join(map(str, n[:15])) + (" …" * (len(n) > 15))),
        }
    )
    return markup.section(
        [
            '<h2 id="tables">Tables</h2>',
            (
                f"<h3>Top configs (feasible, each config once, by {markup.escape(', '.join(s.objectives))}), "
                "and the seed default</h3>"
            ),
            markup.html_table(top_shown, text={"trial", config}, highlight=top.baseline.tolist())
            if len(top)
            else '<p class="note">No feasible config.</p>',
            "<h3>Failed and infeasible trials, by reason</h3>",
            markup.html_table(fails_shown, text={"status", reason, "trial numbers"}, wrap={reason})
            if len(fails)
            else '<p class="lede">Every finished trial was feasible.</p>',
        ]
    )
