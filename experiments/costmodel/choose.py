"""The tree ensemble's settings tried before one was shipped, each fitted to the first
H200 sweep and judged on the held-out one (the same split as `python -m tuner model fit`):

    PYTHONPATH=. python3 experiments/costmodel/choose.py > experiments/costmodel/choose.jsonl
"""

import json
from pathlib import Path

from tuner import latency_fit
from tuner.latency import MODEL_BANDWIDTH

SWEEPS = Path(__file__).resolve().parent.parent / "shipped"
SETTINGS = [(200, 0.1, 15, 20), (100, 0.15, 15, 20), (100, 0.1, 15, 20), (60, 0.2, 15, 20),
            (100, 0.15, 8, 20), (150, 0.1, 8, 10), (100, 0.15, 15, 10)]  # fmt: skip

train, gpu = latency_fit.from_sweep(SWEEPS / "sweep-128x128_128x256_64x64_256x256-bfloat16.jsonl")
held, _ = latency_fit.from_sweep(SWEEPS / "sweep-128x128_128x256-bfloat16-heldout.jsonl")
shapes = {s.shape for s in held}
for max_iter, learning_rate, max_leaf_nodes, min_samples_leaf in SETTINGS:
    params = dict(max_iter=max_iter, learning_rate=learning_rate, max_leaf_nodes=max_leaf_nodes,
                  min_samples_leaf=min_samples_leaf)  # fmt: skip
    latency_fit.TREE_PARAMS.update(params)
    model, _ = latency_fit.fit_and_judge(
        train + held, lambda s: s.shape in shapes, gpu=gpu, bandwidth=MODEL_BANDWIDTH, sources=[]
    )
    print(json.dumps({**params, **model.trained["held_out"], "interval": model.interval}))
