"""A first latency model from the committed sweeps, judged on shapes it never saw.

    python experiments/costmodel/fit.py

Trains on ``experiments/shipped/sweep-128x128_128x256_64x64_256x256-bfloat16.jsonl``
(16 heads, 16 shapes) and tests on ``sweep-128x128_128x256-bfloat16-heldout.jsonl`` (8
heads, 10 other shapes): per (head size, sweep, shape), over the configs timed there, the
Spearman correlation of predicted and measured time, the top-1 pick's time over the best,
and whether the top 5 hold a config within 1.03x of the best. Models (numpy least squares
on log time, no new dependency):

- ``waves``: an analytic roofline: the blocks' waves on the SMs (blocks per SM from the
  probe's shared memory) times the tokens one block walks, times the bytes one token costs
  the block (Q and K at DK, V and O at block_dv), with one fitted scale per sweep;
- ``waves+knobs``: the same terms as features, with the knobs (stages, chunk, split or not,
  block state) beside them, each a fitted coefficient.

The rule (``kernel.rule``) is scored on the same shapes as the yardstick.
"""

import json
import math
from pathlib import Path

import numpy as np

from kernel.config import Problem
from kernel.rule import default_config, dkdv_config
from tuner.options import parse_config

HERE = Path(__file__).resolve().parent.parent / "shipped"
TRAIN = HERE / "sweep-128x128_128x256_64x64_256x256-bfloat16.jsonl"
TEST = HERE / "sweep-128x128_128x256-bfloat16-heldout.jsonl"
SMS, SMEM_PER_SM, MAX_BLOCKS_PER_SM = 132, 233_472, 8  # H200: 228 KB per SM


def load(path: Path) -> list[dict]:
    """The timed rows of a sweep, each with its kernel's shared memory and registers."""
    probes, rows = {}, []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "probe" and "resources" in r:
            probes[r["dk"], r["dv"], r["heads"], r["sweep"], r["config"]] = r["resources"]
        if r["kind"] == "time" and "median_ms" in r:
            r["resources"] = probes[r["dk"], r["dv"], r["h"], r["sweep"], r["config"]]
            rows.append(r)
    return rows


def terms(r: dict) -> dict[str, float]:
    """The analytic terms of one timing."""
    c = parse_config(r["config"])
    p = Problem(r["b"], r["h"], r["s"], r["dk"], r["dv"], r["dtype"])
    per_sm = max(1, min(MAX_BLOCKS_PER_SM, SMEM_PER_SM // r["resources"]["smem_bytes"]))
    blocks = c.blocks(p)
    waves = math.ceil(blocks / (SMS * per_sm))
    tokens = c.segment_length(p.seqlen)
    dv_cols = p.dv if r["sweep"] == "dkdv" else c.block_dv
    token_bytes = 2 * (2 * p.dk + 2 * dv_cols) * (2 if r["sweep"] == "dkdv" else 1)
    return {
        "waves": waves,
        "tokens": tokens,
        "token_bytes": token_bytes,
        "stages": c.num_stages,
        "chunk": c.chunk,
        "split": float(c.segments > 1),
        "segments": c.segment_count(p.seqlen),
        "state": p.dk * dv_cols,
        "fill": blocks / (SMS * per_sm * waves),
        "dkdv": float(r["sweep"] == "dkdv"),
        "blocks": blocks,
        "per_sm": per_sm,
    }


def features(r: dict, model: str) -> list[float]:
    t = terms(r)
    roof = math.log(t["waves"] * t["tokens"] * t["token_bytes"])
    if model == "waves":
        return [roof, 1.0, t["dkdv"]]
    return [
        roof,
        1.0,
        t["dkdv"],
        math.log(t["waves"]),
        math.log(t["tokens"]),
        math.log(t["state"]),
        math.log(t["fill"]),
        t["split"],
        t["split"] * math.log(t["segments"]),
        float(t["stages"] == 1),
        float(t["stages"] == 3),
        float(t["chunk"] == 128),
    ]


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1]) if len(a) > 2 else math.nan


def evaluate(rows: list[dict], predict) -> dict:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dk"], r["dv"], r["sweep"], r["b"], r["h"], r["s"]), []).append(r)
    rhos, top1, top5, rule = [], [], [], []
    for key, found in groups.items():
        if len(found) < 3:
            continue
        measured = [r["median_ms"] for r in found]
        predicted = [predict(r) for r in found]
        best = min(measured)
        order = np.argsort(predicted)
        rhos.append(spearman(predicted, measured))
        top1.append(measured[order[0]] / best)
        top5.append(min(measured[i] for i in order[:5]) / best <= 1.03)
        dk, dv, sweep, b, h, s = key
        p = Problem(b, h, s, dk, dv, found[0]["dtype"])
        label = (dkdv_config(p, "sm_90a", SMS) if sweep == "dkdv" else default_config(p, "sm_90a", SMS)).label
        rule.append(next((r["median_ms"] for r in found if r["config"] == label), math.nan) / best)
    return {
        "shapes": len(rhos),
        "spearman_median": float(np.median(rhos)),
        "spearman_min": float(np.min(rhos)),
        "spearman_at_least_0.85": sum(x >= 0.85 for x in rhos),
        "top1_median": float(np.median(top1)),
        "top1_worst": float(np.max(top1)),
        "top1_within_1.10": sum(x <= 1.10 for x in top1),
        "top5_within_1.03": sum(top5),
        "rule_median": float(np.nanmedian(rule)),
        "rule_worst": float(np.nanmax(rule)),
        "rule_within_1.10": sum(x <= 1.10 for x in rule),
    }


def main() -> None:
    train, test = load(TRAIN), load(TEST)
    shape = lambda r: (r["dk"], r["dv"], r["sweep"], r["b"], r["h"], r["s"])  # noqa: E731
    for model in ("waves", "waves+knobs"):
        x = np.array([features(r, model) for r in train])
        y = np.log([r["median_ms"] for r in train])
        # fitted to each timing's log ratio to its shape's mean: the model ranks configs
        # within a shape, which is what a study asks of it
        keys = [shape(r) for r in train]
        for key in set(keys):
            at = np.array([k == key for k in keys])
            x[at] -= x[at].mean(axis=0)
            y[at] -= y[at].mean()
        w, *_ = np.linalg.lstsq(x, y, rcond=None)
        predict = lambda r, w=w, model=model: float(np.dot(features(r, model), w))  # noqa: E731
        residual = float(np.sqrt(np.mean((x @ w - y) ** 2)))
        for name, rows in (("train", train), ("held out", test)):
            print(json.dumps({"model": model, "on": name, "rms_log_residual_train": residual,
                              **evaluate(rows, predict)}))  # fmt: skip


if __name__ == "__main__":
    main()
