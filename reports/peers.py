"""Peer timings beside our best: what a study stored as its ``"peers"`` user attr (fla or
torch, measured in the same run as the study), as bars relative to our best feasible
median latency."""

import math
from typing import NamedTuple

import pandas as pd

from reports.data import StudyInfo, finite


class PeerInfo(NamedTuple):
    bars: pd.DataFrame  # name, median_ms, ours (bool), vs_ours (median_ms / our best)
    note: str | None


def peers(frame: pd.DataFrame, info: StudyInfo) -> PeerInfo:
    """Peer timings from ``info.peers`` = ``{name: median_ms}`` (the study user attr
    ``"peers"``, measured in the same run as the study), plus our best feasible median latency."""
    raw = info.peers
    if not raw:
        return PeerInfo(
            _bars([]),
            "no peer timings in this study: store them as the study user attr "
            '"peers" = {name: median_ms}, measured in the same run',
        )
    valid = isinstance(raw, dict) and all(isinstance(k, str) and finite(v) and v > 0 for k, v in raw.items())
    if not valid:
        raise ValueError(f'study user attr "peers" must map a name to a positive median in ms, got {raw!r}')
    rows = [(name, float(ms), False) for name, ms in raw.items()]
    ok = frame[frame.feasible & frame.median_ms.notna()]
    note = None
    if len(ok):
        best = ok.loc[ok.median_ms.idxmin()]
        rows.append((f"decay-tuner best ({best.config})", float(best.median_ms), True))
    else:
        note = "this study timed no feasible config: only the peers are shown"
    return PeerInfo(_bars(rows), note)


def _bars(rows: list[tuple[str, float, bool]]) -> pd.DataFrame:
    bars = pd.DataFrame(rows, columns=["name", "median_ms", "ours"]).sort_values("median_ms", kind="stable")
    ours = bars.median_ms[bars.ours]
    bars["vs_ours"] = bars.median_ms / float(ours.iloc[0]) if len(ours) else math.nan
    return bars.reset_index(drop=True)
