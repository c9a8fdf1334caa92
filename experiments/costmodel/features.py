"""The refit (``docs/tuning.md``'s command) with a wave-work feature added, judged on the
same held-out shapes: whether the latency model's misses at few sequences (3x12x6000,
3x24x6000) are a missing feature or missing data. ``serial``: ``log2(waves * segment
length)``, the tokens one SM walks; ``serial+fixed``: with ``wave_rule.py``'s split and
fixed costs; ``both``: the two.

    python experiments/costmodel/features.py > experiments/costmodel/features.txt
"""

import contextlib
import io
import math

import tuner.latency
import tuner.latency_fit
from tuner.cli import main

H200 = "experiments"
DATA = [
    f"{H200}/shipped/sweep-128x128_128x256_64x64_256x256-bfloat16.jsonl",
    f"{H200}/shipped/sweep-128x128_128x256-bfloat16-heldout.jsonl",
    f"{H200}/costmodel/gap-128x128-bfloat16.jsonl",
    f"{H200}/costmodel/heldout-128x128-bfloat16.jsonl",
    f"{H200}/costmodel/heldout-64x64-bfloat16-64x8x512.jsonl",
    f"{H200}/costmodel/heldout-64x64-bfloat16-8x24x1000.jsonl",
    f"{H200}/costmodel/heldout-128x128-bfloat16-3x12x6000_1x4x65536_2x32x3000.jsonl",
]
HELD_OUT = "3x24x6000,1x4x65536,64x8x512,8x24x1000,2x32x3000,3x12x6000"


def serial(p, c, figures, arch, sms, split=1.0, fixed=0.0) -> float:
    waves = tuner.latency.grid(p, c, figures, arch, sms)[2]
    split = split if c.segment_count(p.seqlen) > 1 else 1
    return math.log2(waves * (c.segment_length(p.seqlen) * split + fixed))


VARIANTS = {
    "none": {},
    "serial": {"serial": lambda *a: serial(*a)},
    "serial+fixed": {"serial": lambda *a: serial(*a, split=1.6, fixed=384)},
    "both": {"serial": lambda *a: serial(*a), "serial2": lambda *a: serial(*a, split=1.6, fixed=384)},
}


def main_() -> None:
    base, names = tuner.latency.features, tuner.latency.FEATURES
    for name, extra in VARIANTS.items():

        def features(p, c, sweep, f, arch, sms=None, extra=extra) -> list[float]:
            return base(p, c, sweep, f, arch, sms) + [fn(p, c, f, arch, sms) for fn in extra.values()]

        # the model checks its features' names; the samples compute them through latency_fit
        tuner.latency.FEATURES = names + tuple(extra)
        tuner.latency.features = tuner.latency_fit.features = features
        argv = ["model", "fit", *(a for d in DATA for a in ("--data", d)), "--hold-out", HELD_OUT]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
            main([*argv, "--out", f"/tmp/features-{name}.json"])
        lines = printed.getvalue().splitlines()
        print(f"## {name}")
        print("\n".join(lines[: len(lines) - 1]))


if __name__ == "__main__":
    main_()
