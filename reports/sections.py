"""The page's sections after the search's (``reports.page``): the decay's numerics, the
peers, the configs across architectures."""

import pandas as pd

from kernel.config import SEED_CONFIG
from reports import compiled, compiler_figures, decay_figures, decays, figures, markup
from reports.data import StudyInfo, Summary
from reports.peers import peers as peer_bars


def numerics(s: Summary, frame: pd.DataFrame) -> str:
    """The decay's numerics: the mask, where the factorised form overflows fp16, the error
    by decay, the registers per config."""
    alpha = min(decays.study_decays(s.problem, s.decays))  # the fastest decay: the smallest weights
    best = frame[frame.number == s.best]
    chunk = int(best.chunk.iloc[0]) if len(best) else SEED_CONFIG.chunk
    chunks = tuple(sorted({int(c) for c in frame.chunk.dropna()}))
    overflow_map = decays.overflow_map(sorted({*decays.OVERFLOW_ALPHAS, alpha}))
    overflow = decay_figures.overflow_figure(overflow_map, alpha=alpha, chunks=chunks)
    error = decay_figures.error_figure(decays.error_by_decay(frame), s.budgets.get("rel_l2"))
    registers = compiler_figures.registers_figure(compiled.register_budget(frame), s.budgets.get("registers"))
    return markup.section(
        [
            '<h2 id="numerics">Numerics (from the seed)</h2>',
            (
                '<p class="lede">The ratio form the kernel uses keeps every weight in (0, 1]; the factorised '
                "form (Q·α^i)(K·α^-j)ᵀ materialises α^-(C−1) and overflows fp16 where the map is red.</p>"
            ),
            '<div class="grid2"><div>',
            markup.figure(decay_figures.gamma_figure(decays.gamma_info(alpha, chunk)), "fig-gamma", ""),
            "</div><div>",
            markup.figure(overflow, "fig-overflow", ""),
            "</div></div>",
            markup.figure(error, "fig-error-decay", "no trial measured an error (compile-only study)"),
            markup.figure(registers, "fig-registers", "no config compiled, so ptxas reported no registers"),
        ]
    )


def gated_numerics(s: Summary, frame: pd.DataFrame) -> str:
    """A per-token gate's numerics, in place of the constant decay's (whose figures are of
    one alpha per head): how the kernel keeps its weights in [0, 1], the error of the trials
    against reference C's per-token form, the registers per config."""
    error = decay_figures.error_figure(decays.error_by_decay(frame), s.budgets.get("rel_l2"))
    registers = compiler_figures.registers_figure(compiled.register_budget(frame), s.budgets.get("registers"))
    return markup.section(
        [
            '<h2 id="numerics">Numerics of the per-token gate</h2>',
            (
                f'<p class="lede">Gates {markup.escape(decays.decay_label(s.problem))} per token. '
                "Within a chunk the mask exp(G<sub>i</sub> − G<sub>j</sub>) of the gates' running sums "
                "is evaluated only where j ≤ i, and the state is carried with exp(G<sub>last</sub>): "
                "every exponent is a sum of gates ≤ 0, so every weight lies in [0, 1] and a gate of −20 "
                "per token underflows to 0, never to inf (kernel/gated.py).</p>"
            ),
            markup.figure(error, "fig-error-decay", "no trial measured an error (compile-only study)"),
            markup.figure(registers, "fig-registers", "no config compiled, so ptxas reported no registers"),
        ]
    )


def decode(s: Summary, frame: pd.DataFrame) -> str:
    """A decode study's floor, in place of the forward's numerics: the bytes a step must move
    (each state of its N sequences read and written once), and for the best timed config
    the copy of those bytes timed in the same run, and its time over that."""
    p = s.problem
    elem = 2 if p.get("pool_dtype") == "bfloat16" else 4
    state = 2 * p.get("batch", 0) * p.get("heads", 0) * p.get("dk", 0) * p.get("dv", 0) * elem
    parts = [
        '<h2 id="floor">The decode step\'s floor</h2>',
        (
            f'<p class="lede">A step reads and writes each of its sequences\' states once: '
            f"2 x N x H x DK x DV x {elem} bytes = {state:,} bytes, at the rate of a device copy of them "
            "timed in the same run.</p>"
        ),
    ]
    best = frame[(frame.number == s.best) & frame.floor_ms.notna()]
    if len(best):
        row = best.iloc[0]
        parts.append(
            f"<p>Best config {markup.escape(str(row.config))}: {row.median_ms:.4f} ms, the copy "
            f"{row.floor_ms:.4f} ms ({row.copy_bytes_per_s / 1e9:,.0f} GB/s): "
            f"{row.x_floor:.2f}x the floor.</p>"
        )
    else:
        parts.append('<p class="note">No config was timed (compile-only study): no floor measured.</p>')
    return markup.section(parts)


def peers(info: StudyInfo, frame: pd.DataFrame) -> str:
    """The peers' timings beside our best (``reports.peers``)."""
    peers = peer_bars(frame, info)
    parts = ['<h2 id="peers">Peer comparison</h2>']
    if peers.note:
        parts.append(f'<p class="note">{markup.escape(peers.note)}</p>')
    if not peers.bars.empty:
        parts.append(markup.figure(figures.peers_figure(peers), "fig-peers", ""))
    return markup.section(parts)


def archs(side: pd.DataFrame) -> str:
    """The configs finished on several architectures (``compiled.across_archs``); nothing when
    there are none."""
    if side.empty:
        return ""
    first = ~side.config.duplicated()
    shown = pd.DataFrame(
        {
            "config": side.config.where(first, ""),
            "arch": side.arch,
            "status": side.status,
            "registers": side.registers.map(lambda v: markup.num(v, ".0f")),
            "spill B": side.spill_bytes.map(lambda v: markup.num(v, ",.0f")),
            "smem B": side.smem_bytes.map(lambda v: markup.num(v, ",.0f")),
            "median ms": side.median_ms.map(lambda v: markup.num(v, ".4f")),
            "reason (first line)": side.reason,
        }
    )
    if side.median_ms.isna().all():
        shown = shown.drop(columns="median ms")
    archs = ", ".join(sorted(set(side.arch), key=compiled.arch_rank))
    return markup.section(
        [
            '<h2 id="archs">Across architectures</h2>',
            (
                f'<p class="lede">The configs of this problem finished on more than one architecture '
                f"({markup.escape(archs)}), in any study of this storage: each architecture's latest "
                "trial of the config, its resources from ptxas, or why it could not exist there.</p>"
            ),
            markup.figure(
                compiler_figures.archs_figure(side), "fig-archs", "no config compiled on these architectures"
            ),
            markup.html_table(
                shown, text={"config", "arch", "status", "reason (first line)"}, wrap={"reason (first line)"}
            ),
        ]
    )
