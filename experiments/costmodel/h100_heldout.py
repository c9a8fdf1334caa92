"""The latency model refit from H100 timings alone, judged on H100 shapes the fit never saw
(issue 53, item 6): compile-only ranking per (shape, sweep) group, Spearman of predicted
against measured, the predicted-best's time over the best (top-1) and the best of the
predicted top 5 over the best (top-5), against the cost-model issue's goals (Spearman >=
0.85 in 8 of 12 groups; top-1 within 1.10x; top-5 within 1.03x). No GPU: the committed
H100 grids.

    PYTHONPATH=. python3 experiments/costmodel/h100_heldout.py > experiments/costmodel/h100_heldout.txt

writes ``h100_heldout.jsonl`` beside this file: a row per judged group and model, then a
summary row per model.

The held-out shapes are every other point of the H100 grid's (B, S) lattice at 16 heads
whose two sweeps both have 3 timed configs or more (a chessboard, fixed before any fit):
B=1 at S 2048 and 32768, B=4 at 512, 8192 and 65536, B=16 at 2048, so 12 groups, as the
H200's held-out set has. Their rows in every file are left out of each fit.

The models:
- ``h100-shipped-grids``: fitted to the three H100 grids the package ships
  (``tuner/data/*-h100.jsonl``), what a per-GPU refit on an H100 starts from;
- ``h100-shipped+few``: the same plus the few-sequence sweep (``few-128x128-bfloat16-h100.jsonl``,
  15 shapes of 12 heads);
- ``h200-shipped``: the shipped H200 model, unchanged (a rescale changes no rank);
- ``h100-each-shape-out``: every group of the four files, each judged by a fit to the
  other shapes (``latency_fit.fit_each_shape_out``, what ``model fit`` does without
  ``--hold-out``).
"""

import json
from pathlib import Path

from tuner import fit_data, latency, latency_fit

HERE = Path(__file__).parent
GRIDS = [fit_data.path(n) for n in ("sweep-128x128-bfloat16-h100.jsonl", *fit_data.SLOW_MEMORY_CHAIN)]
FEW = HERE / "few-128x128-bfloat16-h100.jsonl"
HELD_OUT = {(1, 16, 2048), (1, 16, 32768), (4, 16, 512), (4, 16, 8192), (4, 16, 65536), (16, 16, 2048)}
BANDWIDTH = 3.0e12  # the H100's copy rate (README, last section); a constant shift: no rank depends on it


def held(s: latency_fit.Sample) -> bool:
    return (s.problem.batch, s.problem.heads, s.problem.seqlen) in HELD_OUT


def samples(paths: list[Path]) -> list[latency_fit.Sample]:
    return [s for p in paths for s in latency_fit.from_sweep(p)[0]]


def main() -> None:
    grids, few = samples(GRIDS), samples([FEW])
    made = {"gpu": "NVIDIA H100 80GB HBM3", "bandwidth": BANDWIDTH}
    results = {}
    for name, data in (("h100-shipped-grids", grids), ("h100-shipped+few", grids + few)):
        sources = [str(p) for p in (GRIDS if data is grids else [*GRIDS, FEW])]
        _, rows = latency_fit.fit_and_judge(data, held, sources=sources, **made)
        results[name] = rows
    results["h200-shipped"] = latency_fit.judge(
        latency.LatencyModel.load(latency.MODEL_FILE), [s for s in grids if held(s)]
    )
    _, results["h100-each-shape-out"] = latency_fit.fit_each_shape_out(grids + few, sources=[], **made)
    lines = []
    print(f"{'model':<20} {'shape':>10} {'sweep':>8} {'configs':>7} {'spearman':>8} {'top1':>6} {'top5':>6}")
    for name, rows in results.items():
        for r in rows:
            lines.append({"model": name, **r})
            if name != "h100-each-shape-out":
                rho = "-" if r["spearman"] is None else f"{r['spearman']:.3f}"
                print(
                    f"{name:<20} {r['shape']:>10} {r['sweep']:>8} {r['configs']:>7} {rho:>8} "
                    f"{r['top1_over_best']:>6.3f} {r['top5_best_over_best']:>6.3f}"
                )
    for name, rows in results.items():
        summary = latency_fit.summary(rows)
        lines.append({"model": name, "summary": summary})
        print(name, json.dumps(summary))
    (HERE / "h100_heldout.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
