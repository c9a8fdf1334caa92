"""Shared by the H200 experiment scripts here: the shapes and cases they time, their
compile, check and timing loops, and their JSON-line rows."""

import json
import multiprocessing
import os
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ProcessPoolExecutor
from functools import partial

import torch

from kernel import KernelConfig, Problem, build, probe
from kernel.build import ScalarDecayKernel, cuda_arch, states_buffer
from kernel.resources import ProbeResult
from kernel.seq_split import launches_carry
from kernel.timing import alternating
from kernel.validate import check, random_qkv
from tuner.bench import traffic_bytes

Case = tuple[Problem, KernelConfig]

# Issue 5's two small-B*H shapes, and the one between them and the headline.
B2H16 = Problem(2, 16, 16384, 128, 128, 0.99)
B1H8 = Problem(1, 8, 32768, 128, 128, 0.99)
B4H16 = Problem(4, 16, 8192, 128, 128, 0.99)

# The split's configs that the states-pass experiments time (the tool's picks and one
# neighbour), and the cases that stress a split change: bf16 with alpha^L underflowing
# fp32, ragged S with DK != DV, and S shorter than two chunks.
SPLIT_TIMED = [
    (B2H16, KernelConfig(64, 128, 3, 256, segments=4)),
    (B2H16, KernelConfig(64, 128, 2, 256, segments=4)),
    (B1H8, KernelConfig(64, 128, 3, 256, segments=16)),
    (B4H16, KernelConfig(64, 128, 3, 256, segments=2)),
]
SPLIT_CHECKED = [
    (Problem(1, 2, 1000, 128, 128, 0.5, "bfloat16"), KernelConfig(64, 64, 1, 128, segments=4)),
    (Problem(2, 2, 777, 64, 128, 0.8, "bfloat16"), KernelConfig(64, 64, 2, 128, segments=8)),
    (Problem(2, 1, 65, 128, 128, 0.9), KernelConfig(64, 128, 2, 256, segments=2)),
]


class SplitCall:
    """The tool's split call (states, carry, outputs kernels of ``tool``) with any of its
    kernels swapped for an experiment's, or the carry skipped (``carry=False``: wrong
    outputs past the first segment, time only); for ``check_kept`` and ``time_modes``."""

    def __init__(self, tool: ScalarDecayKernel, *, states=None, outputs=None, carry: bool = True):
        self.problem, self.config = tool.problem, tool.config
        tool_states, tool_carry, tool_outputs = tool.compiled
        self.states, self.outputs = states or tool_states, outputs or tool_outputs
        self.carry = tool_carry if carry and launches_carry(self.problem, self.config) else None

    def __call__(self, q, k, v, *, out=None):
        out = torch.empty_like(v) if out is None else out
        states = states_buffer(self.problem, self.config, q.device)
        self.states(k, v, states)
        if self.carry is not None:
            self.carry(states)
        self.outputs(q, k, v, states, out)
        return out


def _probe(case: Case, arch: str) -> ProbeResult:
    return probe(*case, arch=arch)


def probe_modes(
    modes: Sequence[Hashable],
    set_mode: Callable[[Hashable], None],
    cases: Sequence[Case],
    arch: str | None = None,
) -> dict[tuple, ProbeResult]:
    """Compile every case under every mode, in spawned processes that each call
    ``set_mode(mode)`` first, for ``arch`` (default: the current GPU's);
    ``{(mode, problem, config): probe result}``."""
    arch = arch or cuda_arch()
    ctx = multiprocessing.get_context("spawn")
    probes = {}
    for mode in modes:
        with ProcessPoolExecutor(
            os.cpu_count(), mp_context=ctx, initializer=set_mode, initargs=(mode,)
        ) as pool:
            probes |= {
                (mode, *case): res for case, res in zip(cases, pool.map(partial(_probe, arch=arch), cases))
            }
    return probes


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def check_kept(
    kernels: dict[tuple, ScalarDecayKernel],
    mode: Hashable,
    kern: ScalarDecayKernel,
    timed: Sequence[Case],
    *,
    seed: int,
    mode_key: str = "mode",
    extra: dict | None = None,
) -> None:
    """Check ``kern`` (anything with ``problem``, ``config`` and the kernel's call) against
    reference C on fresh inputs, NaN-prefilled output; print the ``check`` row (the mode
    under ``mode_key``, problem, config, the check's fields, then ``extra``); keep ``kern``
    in ``kernels`` under ``(mode, problem, config)`` when its case is timed and it is correct."""
    p, c = kern.problem, kern.config
    row = {"kind": "check", mode_key: mode, "problem": p.to_dict(), "config": c.label}
    row |= check(kern, seed=seed) | (extra or {})
    emit(row)
    if (p, c) in timed and row["finite"] and row["rel_l2"] < 2e-2:
        kernels[mode, p, c] = kern


def check_modes(
    probes: dict[tuple, ProbeResult],
    set_mode: Callable[[Hashable], None],
    timed: Sequence[Case],
    *,
    seed: int,
    mode_key: str = "mode",
) -> dict[tuple, ScalarDecayKernel]:
    """Build each probed kernel that fits under its mode, check it against reference C on
    fresh inputs (NaN-prefilled output) and print a ``check`` row: the mode (under
    ``mode_key``), problem and config with the check's fields and the kernel's shared
    memory and spills, or ``skipped``. Returns the correct kernels of the ``timed`` cases,
    by ``(mode, problem, config)``."""
    kernels = {}
    for (mode, problem, config), res in probes.items():
        if not getattr(res, "fits_smem", False):
            row = {"kind": "check", mode_key: mode, "problem": problem.to_dict(), "config": config.label}
            emit(row | {"skipped": str(res.to_dict())[:200]})
            continue
        set_mode(mode)
        extra = {"smem_bytes": res.smem_bytes, "spill_bytes": res.spill_bytes}
        check_kept(kernels, mode, build(problem, config), timed, seed=seed, mode_key=mode_key, extra=extra)
    return kernels


def inputs_for(kernels: dict[tuple, ScalarDecayKernel], *, seed: int) -> dict[Problem, tuple]:
    """Fresh ``(q, k, v)`` for each problem among the keys ``(mode, problem, config)``."""
    return {key[1]: random_qkv(key[1], seed=seed) for key in kernels}


def time_modes(
    kernels: dict[tuple, ScalarDecayKernel],
    inputs: dict[Problem, tuple],
    *,
    kind: str = "time",
    mode_key: str = "mode",
    copy_rate: float | None = None,
) -> None:
    """Time every kernel's whole call, all taking turns over three rounds
    (``kernel.timing.alternating``), and print a ``kind`` row per kernel: its three medians,
    their median and, given the run's ``copy_rate``, that median over the problem's floor."""
    outs = {p: torch.empty_like(v) for p, (_, _, v) in inputs.items()}
    times = alternating({key: partial(k, *inputs[key[1]], out=outs[key[1]]) for key, k in kernels.items()})
    for (mode, p, config), ms in times.items():
        row = {
            "kind": kind,
            mode_key: mode,
            "shape": f"{p.batch}x{p.heads}x{p.seqlen}",
            "config": config.label,
        }
        row |= {"median_ms": sorted(ms)[1], "all_ms": ms}
        if copy_rate:
            row["x_floor"] = row["median_ms"] * 1e-3 * copy_rate / traffic_bytes(p)
        emit(row)
