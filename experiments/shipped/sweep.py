"""Every candidate config timed at every shape of a grid, in one process on one GPU: the
studies behind the shipped tables and the rule (``kernel.rule``), and the cost
model's training data.

    python experiments/shipped/sweep.py 128x128,128x256 bfloat16 [BxHxS,...] > sweep.jsonl

Per head size (DK x DV): the candidate forward configs (``bases``) with each segment count
whose grid launches between a quarter and 8 blocks per SM at some shape, and, where the
fused dk and dv sweep serves the head size, its configs (stages 1 or 2, every such
segment count). Each kernel (one per config and chunk class: the kernels are shape-generic,
with one class for S a multiple of the chunk and one for any other S) is compiled across
the cores ahead, and checked once against reference C (``kernel.validate.check`` at
1 x H x 4096, or 4095 for the ragged class); each timing at a shape is checked again
against the rule's config on the same inputs (relative L2 < 2e-2, no NaN). Timing:
``kernel.timing.time_gpu`` with the host queued ahead, L2 flushed, median of the
repetitions; the model call (scale DK^-1/2, final state returned) and the fused sweep of
its backward. Each line is a JSON object: ``env``,
``probe`` (the compiler's figures per kernel), ``check``, ``time``, ``skip``; each with ``t``,
the seconds since the sweep started (where a sweep's time goes).
"""

import dataclasses
import json
import math
import os
import sys
import time

import torch
from rule import legacy_config

from kernel.builder import build, precompile, sm_count
from kernel.config import Call, KernelConfig, Problem, dkdv_call, model_call, whole_chunks
from kernel.constraints import runs
from kernel.environment import environment
from kernel.probe import ProbeFailure
from kernel.rule import default_config, dkdv_config
from kernel.timing import time_gpu
from kernel.validate import check, random_qkv

# (B, H, S): B*H from 16 to 512 and S from 512 to 65536, B*H*S at most 2^22 token-heads;
# 16 heads, so that one compile per config serves every shape of a head size. A third
# argument names other shapes (kernels compile per head count).
SHAPES = [(b, 16, s) for b in (1, 4, 16, 32) for s in (512, 2048, 8192, 32768, 65536) if b * s <= 2**18]
MIN_WAVES, MAX_WAVES = 0.4, 5.0  # blocks per SM a segment count may give at a shape
# SWEEP_SEGMENTS=1: only the rule's configs at each segment count (the knob the rule's
# segment count chooses; a short device call)
SEGMENTS_ONLY = os.environ.get("SWEEP_SEGMENTS") == "1"
# SWEEP_THREADS=128: instead of the bases below, one consumer warpgroup (128 threads) at 2 and
# 3 stages, at the widths whose state it holds without spilling (DK x block_dv <= 128 x 64:
# ptxas spills 1,372 B at 128 x 128, `python -m tuner probe --config 64/128/3/128/smem/2`),
# beside the rule's config; and no fused sweep (its threads are fixed)
THREADS_128 = os.environ.get("SWEEP_THREADS") == "128"


START = time.time()


def emit(**row) -> None:
    print(json.dumps(row | {"t": round(time.time() - START, 2)}), flush=True)  # t: seconds since start


def bases(dk: int, dv: int) -> list[KernelConfig]:
    """The forward's candidates: the family that won the earlier studies (64/./2/256/smem)
    and one knob off it at a time, at each block_dv that divides DV from 32 (64 where
    DV > 64) up to a block state of 2 x 128 x 128."""
    widths = [d for d in (32, 64, 128, 256) if dv % d == 0 and d <= dv and dk * d <= 2 * 128 * 128]
    widths = [d for d in widths if d >= 64] if dv > 64 else widths
    knobs = [(64, 2, 256, "smem"), (64, 3, 256, "smem"), (64, 1, 256, "smem"), (128, 2, 256, "smem")]
    if THREADS_128:
        widths, knobs = (
            [d for d in widths if dk * d <= 128 * 64],
            [(64, 2, 128, "smem"), (64, 3, 128, "smem")],
        )
    return [KernelConfig(c, d, st, th, sc, 1) for d in widths for c, st, th, sc in knobs]


def dkdv_bases(problem: Problem) -> list[KernelConfig]:
    if dkdv_config(problem, "sm_90a") is None:
        return []
    return [KernelConfig(64, problem.dv, stages, 256, "smem", 1) for stages in (1, 2)]


def splits(base: KernelConfig, problem: Problem, sms: int) -> list[KernelConfig]:
    """``base`` at each segment count that runs ``problem`` with a grid in the waves' range."""
    out = []
    for n in (1, 2, 4, 8, 16, 32, 64):
        c = KernelConfig(**{**base.to_dict(), "segments": n})
        if runs(c, problem) and MIN_WAVES <= c.blocks(problem) / sms <= MAX_WAVES:
            out.append(c)
    return out or ([base] if runs(base, problem) else [])


def main(heads: list[tuple[int, int]], dtype: str, shapes: list[tuple[int, int, int]]) -> None:
    sms = sm_count()
    emit(kind="env", env=environment(), sms=sms, shapes=shapes)
    plan = []  # (problem, config, call, sweep)
    for dk, dv in heads:
        for b, h, s in shapes:
            p = Problem(b, h, s, dk, dv, dtype)
            rule = default_config(p, "sm_90a", sms)
            candidates = [dataclasses.replace(rule, segments=1)] if SEGMENTS_ONLY else bases(dk, dv)
            forward = {c for base in candidates for c in splits(base, p, sms)} | {rule, legacy_config(p, sms)}
            plan += [(p, c, model_call(p), "forward") for c in sorted(forward, key=lambda c: c.label)]
            fused_rule = None if THREADS_128 else dkdv_config(p, "sm_90a", sms)
            fused_bases = [] if THREADS_128 else dkdv_bases(p)
            if SEGMENTS_ONLY and fused_rule:
                fused_bases = [dataclasses.replace(fused_rule, segments=1)]
            fused = {c for base in fused_bases for c in splits(base, p, sms)} | {fused_rule}
            plan += [(p, c, dkdv_call(p), "dkdv") for c in sorted(fused - {None}, key=lambda c: c.label)]
    kernels = {}  # (dk, dv, heads, config, sweep, ragged) -> a job to compile
    for p, c, call, sweep in plan:
        key = kernel_key(p, c, sweep)  # its last field: ragged, a kernel of its own (kernel.variants)
        kernels.setdefault(key, (Problem(1, p.heads, 4095 if key[-1] else 4096, p.dk, p.dv, dtype), c, call))
    t = time.time()
    results = precompile(list(kernels.values()), arch="sm_90a", workers=16)
    failed = set()
    for key, result in zip(kernels, results):
        dk, dv, h, c, sweep, ragged = key
        row = dict(
            kind="probe", dk=dk, dv=dv, heads=h, dtype=dtype, sweep=sweep, config=c.label, ragged=ragged
        )
        if isinstance(result, ProbeFailure):
            failed.add(key)
            emit(**row, failure=result.to_dict())
        else:
            emit(**row, resources=result.to_dict(), fits=result.fits_smem and result.spill_bytes == 0)
            if not (result.fits_smem and result.spill_bytes == 0):
                failed.add(key)
    emit(kind="compiled", kernels=len(kernels), failed=len(failed), seconds=time.time() - t)
    bad = set(failed)
    for key, (p, c, call) in kernels.items():
        if key in failed:
            continue
        try:
            r = check(build(p, c, call), seed=len(bad))
        except Exception as e:  # a launch the GPU refuses: the config is left out, the sweep goes on
            r = {"rel_l2": math.inf, "nan_count": -1, "error": str(e).splitlines()[-1]}
        ok = r["rel_l2"] < 2e-2 and r["nan_count"] == 0
        emit(kind="check", dk=p.dk, dv=p.dv, heads=p.heads, dtype=dtype, sweep=key[4], config=c.label,
             ragged=key[5], ok=ok, rel_l2=r["rel_l2"], nan=r["nan_count"], error=r.get("error"))  # fmt: skip
        if not ok:
            bad.add(key)
    by_shape: dict[tuple[Problem, str], list[tuple[KernelConfig, Call]]] = {}
    for p, c, call, sweep in plan:
        if kernel_key(p, c, sweep) not in bad:
            by_shape.setdefault((p, sweep), []).append((c, call))
    for (p, sweep), configs in by_shape.items():
        time_shape(p, sweep, configs, sms)


def kernel_key(p: Problem, c: KernelConfig, sweep: str) -> tuple:
    """What one compiled kernel serves: a head size and count, a config, a sweep and a chunk
    class (whole chunks or ragged)."""
    return p.dk, p.dv, p.heads, c, sweep, not whole_chunks(p, c.chunk)


def time_shape(p: Problem, sweep: str, configs: list[tuple[KernelConfig, Call]], sms: int) -> None:
    q, k, v = random_qkv(p, seed=p.batch * 131 + p.seqlen)
    decay = torch.tensor([1 - 2 ** (-5 - i % 8) for i in range(p.heads)], device="cuda")
    do = torch.randn_like(v) if sweep == "dkdv" else None
    rule = dkdv_config(p, "sm_90a", sms) if sweep == "dkdv" else default_config(p, "sm_90a", sms)
    legacy = None if sweep == "dkdv" else legacy_config(p, sms)
    configs = sorted(configs, key=lambda cc: cc[0] != rule)  # the rule's first: the others' yardstick
    want = None
    for config, call in configs:
        kern = build(p, config, call)
        final = torch.full((p.batch, p.heads, p.dk, p.dv), math.nan, device="cuda")
        out = torch.full_like(v, math.nan)
        if sweep == "dkdv":
            fn = lambda: kern.run_dkdv(q, k, v, do, decay)  # noqa: E731
            got = fn()
        else:
            fn = lambda: kern.run(q, k, v, decay, None, final, out)  # noqa: E731
            fn()
            got = (out, final)
        torch.cuda.synchronize()
        nan = sum(int(t.isnan().sum()) for t in got)
        want = want or tuple(t.clone() for t in got)
        err = max(float((a.double() - b.double()).norm() / b.double().norm()) for a, b in zip(got, want))
        shape = dict(b=p.batch, h=p.heads, s=p.seqlen, dk=p.dk, dv=p.dv, dtype=p.dtype, sweep=sweep)
        row = dict(kind="time", **shape, config=config.label, rule=config == rule, blocks=config.blocks(p))
        row |= dict(legacy=config == legacy)
        row |= dict(agree_rel_l2=err, nan=nan)
        if nan or not err < 2e-2:
            emit(**row, skipped="disagrees with the rule's config")
            continue
        emit(**row, **time_gpu(fn, warmup_ms=10, rep_ms=30, host_ahead=True).to_dict())


if __name__ == "__main__":
    shapes = [tuple(map(int, x.split("x"))) for x in sys.argv[3].split(",")] if sys.argv[3:] else SHAPES
    main([tuple(map(int, h.split("x"))) for h in sys.argv[1].split(",")], sys.argv[2], shapes)
