"""How big and how slow is a report of a large study? A synthetic trial log answers.

``python -m reports.stress --trials 1000`` builds the trial log of a study of that many
trials directly (no compiler, no GPU, no Optuna study: the frame ``tuner.trials.trials_frame``
would return, with the same columns), writes its report, and opens it in headless Chromium
a few times: the HTML size, the time to render it, and the browser's load time (navigation
until every plot has rendered).
"""

import argparse
import datetime
import itertools
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pandas as pd

from kernel.arch import ARCHS
from kernel.config import HEADLINE, SEED_CONFIG, KernelConfig, knob_choices
from kernel.environment import ENVIRONMENT_KEYS
from kernel.trial_schema import TRIAL_COLUMNS
from refs import TOLERANCE
from reports.data import StudyInfo

SMEM_LIMIT = ARCHS["sm_90a"].smem_per_block  # the synthetic study is of sm_90a
MAX_REGISTERS = 255  # the register budget (registers / thread) the tuner checks by default
ENVIRONMENT = {
    "gpu": "synthetic",
    "capability": "9.0",
    "tilelang": "0.1.15",
    "torch": "2.13.0",
    "cuda": "13.0",
}
PEERS = {"fla chunk_simple_gla": 0.39, "torch chunked": 6.18}
GPU_OUTCOMES = ("ok", "incorrect", "runtime_failed")  # outcomes that cost a GPU launch
START = datetime.datetime(2025, 1, 1)


def synthetic_trials(
    n_trials: int = 1000, *, mode: str = "gpu", seed: int = 0, peers: bool = True
) -> tuple[pd.DataFrame, StudyInfo]:
    """The trial log and info of a study shaped like a real one: configs drawn from the
    headline problem's space (trial 0 is the seed's default, the baseline), resources and
    latency from a toy model with noise, and every outcome: ok, infeasible (over a budget),
    incorrect, compile_failed and runtime_failed. ``mode`` is "gpu" or "compile-only"."""
    if mode not in ("gpu", "compile-only"):
        raise ValueError(f"mode must be 'gpu' or 'compile-only', got {mode!r}")
    rng = np.random.default_rng(seed)
    gpu = mode == "gpu"
    info = StudyInfo(
        name="synthetic",
        problem=HEADLINE.to_dict(),
        mode=mode,
        objectives=("median_ms",) if gpu else ("spill_bytes",),
        peers=PEERS if peers and gpu else None,
    )
    table = knob_choices(HEADLINE.dv)
    configs = [KernelConfig(**dict(zip(table, values))) for values in itertools.product(*table.values())]
    rows, started = [], START
    for number in range(n_trials):
        config = SEED_CONFIG if number == 0 else configs[rng.integers(len(configs))]
        row = _trial(number, config, gpu, rng, started)
        rows.append(row)
        started += datetime.timedelta(seconds=row["wall_s"])
    return pd.DataFrame(rows, columns=list(TRIAL_COLUMNS)), info


def _trial(
    number: int, c: KernelConfig, gpu: bool, rng: np.random.Generator, started: datetime.datetime
) -> dict[str, Any]:
    """One row of the trial log, as ``tuner.tuner`` would have recorded the trial."""
    row: dict[str, Any] = dict.fromkeys(TRIAL_COLUMNS)
    row |= {
        "number": number,
        **c.to_dict(),
        "baseline": number == 0,
        "mode": "gpu" if gpu else "compile-only",
        "wall_s": float(rng.uniform(0.2, 8.0)),
        "started": started,
        **{f"env_{k}": ENVIRONMENT.get(k) for k in ENVIRONMENT_KEYS},
    }

    def done(
        status: str,
        state: str = "COMPLETE",
        reason: str | None = None,
        constraints: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        constraints = constraints or {}
        row.update(
            state=state,
            status=status,
            reason=reason,
            constraints=json.dumps(constraints),
            feasible=state == "COMPLETE" and status == "ok" and all(v <= 0 for v in constraints.values()),
            gpu_evaluated=gpu and status in GPU_OUTCOMES,
        )
        return row

    if c.chunk == 32 and c.scores == "regs":  # as tuner.tuner tells a config the compiler refuses
        return done(
            "compile_failed",
            reason="InternalError: Layout infer conflict between A and A_cast in "
            "T.Parallel loop:\n    loop Fragment((32, 32) -> ...)",
            constraints={"compiles": 1.0},
        )
    if c.block_dv == 16 and c.threads == 256:
        return done(
            "compile_failed",
            reason="InternalError: No valid warp partition for T.gemm: M=32, N=16 "
            "cannot be evenly covered by 8 warps",
            constraints={"compiles": 1.0},
        )
    estimate = c.seed_register_estimate(HEADLINE)
    registers = 168 if c.threads == 256 else 240
    spills = max(0, estimate - registers) * 8
    smem = (
        (2 * c.chunk * HEADLINE.dk * 2 + c.chunk * c.block_dv * 2) * c.num_stages
        + (c.chunk * c.chunk * 2 if c.scores == "smem" else 0)
        + 1024
    )
    row |= {
        "registers": registers,
        "seed_register_estimate": estimate,
        "spill_bytes": spills,
        "spill_stores": spills // 2,
        "spill_loads": spills - spills // 2,
        "smem_bytes": smem,
        "static_smem": 1024,
        "dynamic_smem": smem - 1024,
        "compile_seconds": float(rng.uniform(4, 12)),
    }
    constraints = {
        "spills": float(spills),
        "smem": float(smem - SMEM_LIMIT),
        "registers": float(registers - MAX_REGISTERS),
    }
    if spills > 0 or smem > SMEM_LIMIT:
        return done("infeasible", constraints=constraints | {"correctness": 0.0})
    if not gpu:
        return done("ok", constraints=constraints | {"correctness": 0.0})
    if rng.random() < 0.01:  # a FAIL trial has no constraints
        return done("runtime_failed", "FAIL", "Timeout: the GPU worker did not answer within 180 s")
    ms = (
        0.17
        * (128 / c.block_dv) ** 0.8
        * (1.6 if c.threads == 128 else 1.0)
        * (1.0 if c.chunk == 64 else 1.4)
        * (1 + 0.03 * c.num_stages)
        * (1.1 if c.scores == "regs" else 1.0)
        * (1 + 0.3 * math.log2(c.segments))  # at B*H = 128 splitting the sequence only adds traffic
        * float(rng.normal(1.0, 0.02))
    )
    err = {32: 3.84e-4, 64: 3.64e-4, 128: 3.40e-4}[c.chunk] * float(rng.normal(1.0, 0.01))
    if rng.random() < 0.02:
        err = 0.3  # a wrong result: timed, but over the tolerance
    row |= {
        "median_ms": ms,
        "p20_ms": ms * 0.995,
        "p80_ms": ms * 1.005,
        "reps": 150,
        "rel_l2": err,
        "nan_count": 0,
    }
    correct = err < TOLERANCE
    return done("ok" if correct else "incorrect", constraints=constraints | {"correctness": err - TOLERANCE})


def measure(n_trials: int, out: Path, *, loads: int = 3) -> dict[str, float]:
    """Write the report of a synthetic ``n_trials`` study to ``out``; open it ``loads`` times."""
    from reports import browser, write_report

    frame, info = synthetic_trials(n_trials)
    start = time.perf_counter()
    write_report(frame, info, out)
    render_s = time.perf_counter() - start
    runs = [browser.load(out) for _ in range(loads)]
    bad = [r for r in runs if r.rendered != r.graphs or r.console_errors or r.blocked]
    if bad:
        raise RuntimeError(f"the page did not load cleanly: {bad[0]}")
    return {
        "trials": n_trials,
        "html_mb": out.stat().st_size / 1e6,
        "render_s": render_s,
        "load_ms_median": statistics.median(r.load_ms for r in runs),
        "graphs": runs[0].graphs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m reports.stress",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--loads", type=int, default=3, help="browser loads to take the median of")
    parser.add_argument("--out", help="where to write the HTML (default: a temporary file)")
    args = parser.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the importance's scratch study
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out) if args.out else Path(tmp) / "synthetic.html"
        r = measure(args.trials, out, loads=args.loads)
    print(
        f"{r['trials']} trials: {r['html_mb']:.2f} MB of HTML, rendered in {r['render_s']:.1f} s; "
        f"{r['graphs']} plots loaded in headless Chromium in {r['load_ms_median']:.0f} ms "
        f"(median of {args.loads})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
