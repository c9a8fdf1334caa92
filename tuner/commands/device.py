"""The commands that compile or time kernels with no study: ``probe`` (compile-only, any
architecture) and ``bench`` (the tuned kernel against the seed's config, fla and torch)."""

import argparse
from pathlib import Path

from kernel.arch import resolve
from kernel.config import Problem, model_call
from tuner.commands.args import parse_config, problem_of
from tuner.options import BENCH_PACKED, UsageError, parse_archs, parse_shapes


def cmd_probe(args: argparse.Namespace) -> int:
    """Compile one config for one or more GPU architectures (no GPU needed) and print its
    resources side by side, or why it cannot exist there."""
    from kernel.resources import ProbeFailure, probe  # a slow import; probe alone needs it
    from tuner import space  # loads Optuna

    problem, config = problem_of(args), parse_config(args.config, "--config")
    config.check_fits(problem)
    archs = parse_archs(args.arch) if args.arch else [resolve(None)[0]]
    print(f"{config.label} for {problem} in the model form, compile-only")
    heads = ("registers", "spill B", "smem B", "limit B", "threads")
    print(f"{'arch':<8} {'status':<14} " + " ".join(f"{h:>9}" for h in heads) + "  reason")
    for arch in archs:
        reasons = space.violated(problem, config, arch)
        res = None if reasons else probe(problem, config, arch=arch, call=model_call(problem))
        if res is None or isinstance(res, ProbeFailure):
            why = "; ".join(reasons) if res is None else f"{res.stage}: {res.error_type}: {res.message}"
            status = "restricted" if res is None else "compile_failed"
            print(f"{arch:<8} {status:<14} " + " ".join([" " * 9] * 5) + f"  {why.splitlines()[0][:160]}")
            continue
        status = "ok" if res.fits_smem else "over_smem"
        figures = (res.registers, res.spill_bytes, res.smem_bytes, res.smem_limit, res.threads_launched)
        print(f"{arch:<8} {status:<14} " + " ".join(f"{n:>9}" for n in figures))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Time the tuned kernel, the seed's config, fla and plain torch over shapes, then a
    packed batch, in the model form (RetNet's decays, scale, final state), then the
    backward and forward plus backward against fla's, each against its HBM floor."""
    import torch

    from kernel.ops.dispatch import load_dispatch  # loads torch
    from tuner.bench import bench_and_write  # loads torch and Optuna

    shapes = parse_shapes(args.shapes)
    Problem(1, 1, 1, args.dk, args.dv, args.dtype)  # validates the flags up front
    if args.packed < 0:
        raise UsageError(f"--packed wants a number of sequences >= 0, got {args.packed}")
    packed = BENCH_PACKED._replace(sequences=args.packed) if args.packed else None
    dispatch = load_dispatch(args.dispatch, allow_mismatch=args.allow_mismatch) if args.dispatch else None
    if not torch.cuda.is_available():
        raise UsageError("bench times kernels and needs a CUDA device; none is visible")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out wants a directory, got the file {str(out)!r}")
    bench_and_write(
        shapes,
        out,
        dk=args.dk,
        dv=args.dv,
        dtype=args.dtype,
        dispatch=dispatch,
        packed=packed,
        backward=not args.no_backward,
    )
    return 0
