"""The commands that compile or time kernels with no study: ``probe`` (compile-only, any
architecture), ``warmup`` (every kernel a head size serves, into TileLang's disk cache) and
``bench`` (out of the box and tuned, against the seed's config, fla and torch)."""

import argparse
import sys
import time
from pathlib import Path

from kernel.arch import resolve
from kernel.config import KernelConfig, model_call
from kernel.constraints import violated
from kernel.rule import default_config
from tuner.commands.args import problem_of
from tuner.lines import Progress, fit
from tuner.options import BENCH_PACKED, UsageError, parse_archs, parse_config, parse_shapes

# The resource columns of ``probe``'s table, and what the indented line under each row holds.
PROBE_HEADS = ("registers", "spill B", "smem B", "limit B", "threads")
PROBE_LAST = "predicted time (tuner.latency), or why not"
PROBE_INDENT = "    "


def cmd_probe(args: argparse.Namespace) -> int:
    """Compile a config for one or more GPU architectures (no GPU needed) and print its
    resources side by side, or why it cannot exist there; without --config, each
    architecture's default config (kernel.rule.default_config)."""
    from kernel.probe import ProbeFailure, probe  # a slow import; probe alone needs it
    from kernel.trial_schema import predicted_text
    from tuner.latency import latency_model
    from tuner.occupancy import BlockResources

    problem = problem_of(args)
    given = None if args.config is None else parse_config(args.config, "--config")
    archs = [resolve(None)[0]] if args.arch is None else parse_archs(args.arch)
    if given is not None:
        given.check_fits(problem)
    configs: dict[str, KernelConfig | str] = {}  # an architecture's config, or why it has none
    for arch in archs:
        try:
            configs[arch] = given or default_config(problem, arch)
        except ValueError as exc:  # the rule's refusal: one line where one architecture was asked
            if len(archs) == 1:
                raise
            configs[arch] = str(exc)
    if given is not None:
        print(fit(f"{given.label} for {problem} in the model form, compile-only"), flush=True)
        print(_probe_row("arch", "status", PROBE_HEADS, PROBE_LAST), flush=True)
    else:  # the rule's config may differ by architecture: a column of its own
        print(
            fit(
                f"the default config (kernel.rule.default_config) of each architecture for {problem} "
                "in the model form, compile-only"
            ),
            flush=True,
        )
        print(_probe_row("arch", "status", PROBE_HEADS, PROBE_LAST, config="config"), flush=True)
    for i, (arch, config) in enumerate(configs.items(), 1):
        if isinstance(config, str):
            print(_probe_row(arch, "restricted", [""] * 5, config[:160], config="-"), flush=True)
            continue
        print(f"compiling {config.label} for {arch} ({i} of {len(archs)})", file=sys.stderr, flush=True)
        label = None if given is not None else config.label
        reasons = violated(problem, config, arch)
        res = None if reasons else probe(problem, config, arch=arch, call=model_call(problem))
        if res is None or isinstance(res, ProbeFailure):
            why = "; ".join(reasons) if res is None else f"{res.stage}: {res.error_type}: {res.message}"
            status = "restricted" if res is None else "compile_failed"
            row = _probe_row(arch, status, [""] * 5, why.splitlines()[0][:160], config=label)
        else:
            status = "ok" if res.fits_smem else "over_smem"
            numbers = (res.registers, res.spill_bytes, res.smem_bytes, res.smem_limit, res.threads_launched)
            why = "cannot launch: more shared memory than a block may have"
            if res.fits_smem:
                why = predicted_text(
                    latency_model().predict(problem, config, BlockResources.of(res), arch=arch).record()
                )
            row = _probe_row(arch, status, numbers, why, config=label)
        print(row, flush=True)
    return 0


def _probe_row(arch: str, status: str, cells, reason: str = "", config: str | None = None) -> str:
    """A row of ``probe``'s table, then ``reason`` on lines of its own, indented;
    ``config``: a first column of the config's label."""
    first = "" if config is None else f"{config:<22} "
    line = f"{first}{arch:<8} {status:<14} " + " ".join(f"{c:>9}" for c in cells)
    return line.rstrip() + ("\n" + fit(reason, PROBE_INDENT) if reason else "")


def cmd_warmup(args: argparse.Namespace) -> int:
    """Compile every kernel that calls of a head size are served by (kernel.ops.serve.warmup:
    the forward, and with --backward its sweeps, for every batch size and sequence length;
    kernel.ops.decode.warmup_jobs: the decode step, fp32 and bf16 pools, for every N; with
    --gate token, the per-token gate's forward of --groups instead, dense and packed)
    into TileLang's disk cache, across the CPU cores; no GPU needed with --arch. A later
    process loads them instead of compiling. Its progress goes to stderr (a bar on a
    terminal, else a line every 10 s); its last line names the cache's folder they went to."""
    from kernel.builder import memory_bandwidth, precompile, sm_count
    from kernel.decode_build import precompile_decode
    from kernel.environment import environment
    from kernel.loader import cache_dir
    from kernel.ops.decode import warmup_jobs as decode_jobs
    from kernel.ops.serve import use_table, warmup_jobs
    from kernel.ops.tables import user_table
    from kernel.probe import ProbeFailure

    problem = problem_of(args, batch=1, seqlen=1)  # validates the flags up front
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers must be positive, got {args.workers}")
    arch, gpu = resolve(args.arch)
    if args.arch is None and not gpu:
        print(f"no CUDA device: compiling ahead for {arch} (pass --arch for another)", file=sys.stderr)
    if args.dispatch:  # as a process on that architecture would serve it
        use_table(user_table(args.dispatch, environment(arch)))
    here = {"sms": sm_count(), "bandwidth": memory_bandwidth()} if gpu else {}  # else the arch's GPUs
    p, gate = problem, {"gate": problem.gate, "groups": problem.groups}
    jobs = warmup_jobs(p.heads, p.dk, p.dv, p.dtype, backward=args.backward, arch=arch, **here, **gate)
    decode = (  # the decode step of a constant decay; a gated model's compiles on first use
        decode_jobs(p.heads, p.dk, p.dv, p.dtype, arch=arch, sms=here.get("sms")) if p.gate == "head" else []
    )
    start = time.perf_counter()
    total, what = len(jobs) + len(decode), f"compiling for {arch}"
    with Progress(total, verb="compiled", unit="kernels", desc=what) as done:
        results = precompile(jobs, arch=arch, workers=args.workers, done=done)
        results += precompile_decode(decode, arch=arch, workers=args.workers, done=done)
    failed = [r for r in results if isinstance(r, ProbeFailure)]
    for failure in failed:
        print(fit(f"failed: {failure.stage}: {failure.error_type}: {failure.message.splitlines()[0][:160]}"))
    warmed = f"warmed {len(results) - len(failed)} kernels for {arch} in {time.perf_counter() - start:.0f} s"
    print(fit(f"{warmed} into TileLang's cache, where a later process loads them: {cache_dir()}"), flush=True)
    return 1 if failed else 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Time what a model gets out of the box (the shipped table, else the rule) and tuned,
    beside the seed's config, fla and plain torch, over shapes, then a packed batch, in the
    model form (RetNet's decays, scale, final state), then the backward and forward plus
    backward against fla's, each against its HBM floor. With --gate token, the per-token
    gate's forward of --groups against fla's chunk_simple_gla(g=...), over shapes alone."""
    import torch

    from kernel.ops.dispatch import load_dispatch  # loads torch
    from tuner.bench import bench_and_write  # loads torch and Optuna

    shapes = parse_shapes(args.shapes)
    for b, h, s in shapes:  # validates the flags up front (--groups against each shape's heads)
        problem_of(args, batch=b, heads=h, seqlen=s)
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
        gate=args.gate,
        groups=args.groups,
    )
    return 0
