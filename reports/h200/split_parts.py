"""Same-run comparison on the GPU of the sequence-split variant's parts and changes to
them, at the small-B*H shapes. Two experiments, each a list of variants
``(STATES_ORDER, CARRY, STATES_STAGES)`` of ``kernel.seq_split``:

    source .gpu/setup.sh && python3 reports/h200/split_parts.py > $OUT/split_parts.jsonl
    source .gpu/setup.sh && python3 reports/h200/split_parts.py states_stages > $OUT/states_stages.jsonl

* ``walk_carry`` (the default): the states walk and the carry, each old and new;
* ``states_stages``: the states kernel's pipeline depth (the config's, 4 or 6).

Rows, as JSON lines:
* ``check``: every variant against reference C on fresh inputs, NaN-prefilled output;
  the timed configs and cases that stress the changes (bf16 with alpha = 0.5, ragged S,
  DK != DV, 64 segments).
* ``parts``: each kernel of the split timed alone (L2 flushed before each repetition, so
  the outputs kernel starts cold here), with its own byte floor at the copy rate measured
  in this run: where the time goes.
* ``whole``: the three kernels as one call, the variants taking turns over three rounds
  (``kernel.timing.alternating``); ``x_floor`` against the whole problem's floor.
"""

import itertools
import sys
from functools import partial

import torch
from modes import B1H8, B2H16, B4H16, check_modes, emit, inputs_for, probe_modes, time_modes

import kernel.seq_split as ss
from kernel import KernelConfig, Problem
from kernel.build import states_buffer
from kernel.timing import bench
from tuner.bench import copy_bandwidth, traffic_bytes

EXPERIMENTS = {
    "walk_carry": [(*v, None) for v in itertools.product(("forward", "reverse"), ("rows", "scan"))],
    "states_stages": [("reverse", "scan", stages) for stages in (None, 4, 6)],
}
TIMED = [
    (B2H16, KernelConfig(64, 128, 2, 256, segments=4)),
    (B2H16, KernelConfig(64, 128, 2, 256, segments=8)),
    (B1H8, KernelConfig(64, 128, 3, 256, segments=16)),
    (B1H8, KernelConfig(64, 128, 2, 256, segments=32)),
    (B1H8, KernelConfig(64, 64, 2, 256, segments=16)),
    (B4H16, KernelConfig(64, 128, 3, 256, segments=2)),
]
CHECKED = [
    (Problem(1, 2, 1000, 128, 128, 0.5, "bfloat16"), KernelConfig(64, 64, 1, 256, segments=4)),
    (Problem(2, 2, 777, 64, 128, 0.8, "bfloat16"), KernelConfig(32, 64, 2, 128, segments=8)),
    (Problem(1, 3, 4096, 128, 128, 0.999), KernelConfig(64, 128, 2, 256, segments=64)),
    (Problem(2, 1, 65, 128, 128, 0.9), KernelConfig(64, 128, 2, 256, segments=2)),
]


def _set(variant: tuple[str, str, int | None]) -> None:
    ss.STATES_ORDER, ss.CARRY, ss.STATES_STAGES = variant


def main(experiment: str = "walk_carry") -> int:
    cases = TIMED + CHECKED
    probes = probe_modes(EXPERIMENTS[experiment], _set, cases)
    copy_rate = copy_bandwidth()
    emit({"kind": "copy", "bytes_per_s": copy_rate})
    kernels = check_modes(probes, _set, TIMED, seed=21, mode_key="variant")
    inputs = inputs_for(kernels, seed=22)
    out = {p: torch.empty_like(v) for p, (_, _, v) in inputs.items()}
    for (variant, problem, config), kern in kernels.items():
        p, (q, k, v) = problem, inputs[problem]
        states = states_buffer(p, config)
        states_kernel, carry_kernel, outputs_kernel = kern.compiled
        state_bytes = states.numel() * 4
        kv_bytes = traffic_bytes(p) // 2  # K and V
        parts = {
            # K and V of all segments but the last, and the end states written
            "states": (
                partial(states_kernel, k, v, states),
                kv_bytes * (1 - 1 / states.shape[1]) + state_bytes,
            ),
            "carry": (partial(carry_kernel, states), 2 * state_bytes),
            "outputs": (partial(outputs_kernel, q, k, v, states, out[p]), traffic_bytes(p) + state_bytes),
        }
        for name, (fn, nbytes) in parts.items():
            ms = bench(fn).median_ms
            emit(
                {"kind": "parts", "variant": variant, "shape": f"{p.batch}x{p.heads}x{p.seqlen}"}
                | {"config": config.label, "part": name, "median_ms": ms}
                | {"bytes": int(nbytes), "x_own_floor": ms * 1e-3 * copy_rate / nbytes}
            )
    time_modes(kernels, inputs, kind="whole", mode_key="variant", copy_rate=copy_rate)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
