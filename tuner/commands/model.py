"""``model``: fit the latency model (``tuner.latency``) to GPU timings and judge it on
held-out shapes, or show the model in use."""

import argparse
import json
import math
import sys
from pathlib import Path

from tuner.options import UsageError, parse_shapes

# The flags only a fit takes.
FIT_ONLY = ("data", "storage", "hold_out", "bandwidth", "out")
# The columns of the held-out table.
JUDGED = ("shape", "dk", "dv", "sweep", "configs", "spearman", "top1_over_best", "top5_best_over_best")


def cmd_model(args: argparse.Namespace) -> int:
    """Fit the latency model to GPU timings (sweeps' JSON lines, a storage's GPU trials) and
    print its accuracy on shapes held out of the fit (fit), or show the model in use and
    those cached per GPU (show).

    The model predicts a config's time from its knobs, its problem and the compiler's
    resource counts; compile-only runs rank by it. It needs scikit-learn to fit, not to predict."""
    from tuner import latency

    if args.action == "show":
        given = [f"--{k.replace('_', '-')}" for k in FIT_ONLY if getattr(args, k) is not None]
        if given:
            raise UsageError(f"model show takes no {', '.join(given)}: model fit's")
        from tuner import latency_cache

        model = latency.LatencyModel.load(latency.model_path())
        print(f"{latency.model_path()}: {model.gpu} ({model.arch}), {len(model.trees)} trees")
        print(json.dumps(model.trained, indent=1))
        cached = latency_cache.cached_models()
        print(f"per GPU, refit at the end of GPU runs ({latency_cache.cache_dir()}): {len(cached) or 'none'}")
        for path, found in cached:
            if isinstance(found, str):
                print(f"  {path.name}: {found}")
                continue
            held = found.trained.get("held_out") or {}
            rho = held.get("spearman_median")
            judged = "" if rho is None else f", Spearman median {rho:.2f} over {held.get('shapes')} shapes"
            made = latency_cache.made_by(found)
            print(f"  {path.name}: {found.gpu} ({found.arch}), {made}{judged} (--for-gpu {found.gpu!r})")
        return 0
    from tuner import latency_fit
    from tuner.commands.args import named, out_file

    out = out_file(args, Path(args.studies_dir) / "latency_model.json", (".json",))  # before the fit
    bandwidth = latency.MODEL_BANDWIDTH if args.bandwidth is None else args.bandwidth
    if not 0 < bandwidth < math.inf:
        raise UsageError(f"--bandwidth wants the GPU's copy rate in bytes/s (finite, > 0), got {bandwidth}")
    samples, gpus = [], []
    for path in args.data or []:
        found, gpu = latency_fit.from_sweep(Path(path))
        samples += found
        gpus.append(gpu)
    named(args, "storage")
    if args.storage is not None:
        found, gpu = latency_fit.from_storage(args.storage)
        samples += found
        gpus.append(gpu)
    if not samples:
        raise UsageError("model fit wants timings: --data SWEEP.jsonl and/or --storage URL")
    made = {
        "gpu": next((g for g in gpus if g), ""),
        "bandwidth": bandwidth,
        "sources": [*(args.data or []), *([args.storage] if args.storage else [])],
    }
    if args.hold_out is not None:
        held = set(parse_shapes(args.hold_out, "--hold-out"))
        model, rows = latency_fit.fit_and_judge(
            samples, lambda s: (s.problem.batch, s.problem.heads, s.problem.seqlen) in held, **made
        )
    else:
        groups = len({s.shape for s in samples})
        if groups > 1:  # else the fit refuses, in one line
            print(
                f"judging by leaving each of {groups} shapes out in turn (per sweep; one of under 3 "
                "configs is fitted to, not judged)",
                file=sys.stderr,
            )
        model, rows = latency_fit.fit_each_shape_out(samples, **made)
    print("  ".join(f"{c:>12}" for c in JUDGED))
    for row in rows:
        cells = ("-" if row[c] is None else row[c] for c in JUDGED)  # None: a rank no fit gives
        print("  ".join(f"{v:>12.3f}" if isinstance(v, float) else f"{v!s:>12}" for v in cells))
    print(json.dumps(model.trained["held_out"]))
    try:
        model.save(out)
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror or exc}") from None
    fitted, held_out = model.trained["timings"], model.trained["held_out_timings"]
    how = f"{held_out} held out" if args.hold_out is not None else "each shape judged by a fit to the others"
    print(f"wrote {out} ({fitted} timings fitted, {how})")
    print(f"use it: {latency.MODEL_VARIABLE}={out}", file=sys.stderr)
    return 0
