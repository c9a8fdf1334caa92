"""Experiment (issue 5; not part of the tool): L2 eviction hints on the split's outputs kernel.
Results (no hint helps): reports/h200/README.md, "The carry measured, and L2 eviction hints".

The states kernel walks each segment last chunk to first (``kernel.seq_split.STATES_ORDER``),
so when the outputs kernel starts, L2 holds the first chunks of K and V of every segment
but the last, which the outputs kernel reads first. Its own traffic (Q, and O's stores, and
K and V once read) then evicts those lines in L2's replacement order while it walks up to
them. Marking the outputs kernel's TMA copies ``evict_first`` (``T.copy(...,
eviction_policy=...)``, the PTX ``.L2::cache_hint``) makes L2 evict its streamed lines
before the states kernel's, so more of the second read of K and V may hit L2. Modes:

* ``tool``: the tool's split;
* ``first_qo``: the outputs kernel's Q loads and O stores ``evict_first``;
* ``first_all``: also its K and V loads;
* ``first_q``, ``first_o``: only its Q loads, only its O stores.

Nothing is marked ``evict_last``, so no line can outlive the timing's L2 flush. The hinted
outputs kernel is the tool's, built with ``T.copy`` wrapped to add the hint by the global
tensor's name (``hinted``); the CPU mode checks its CUDA differs only in those hints.

    python3 reports/h200/l2_hints.py cpu
    source .gpu/setup.sh && cd reports/h200 && python3 l2_hints.py [MODE ...] > $OUT/l2_hints.jsonl

Rows: ``copy``; ``check`` (each mode against reference C, NaN-prefilled); ``whole`` (the
modes taking turns over three rounds, ``modes.time_modes``).
"""

import contextlib
import logging
import re
import sys

import tilelang
import tilelang.language as T
from modes import SPLIT_CHECKED, SPLIT_TIMED

from kernel import KernelConfig, Problem
from kernel.seq_split import prim_funcs

MODES = {
    "first_qo": {"Q", "O"},
    "first_all": {"Q", "K", "V", "O"},
    "first_q": {"Q"},
    "first_o": {"O"},
}
RUN = [m for m in sys.argv[1:] if m in MODES] or list(MODES)


def _name(region) -> str:
    buffer = getattr(region, "buffer", region)
    return str(getattr(buffer, "name", ""))


@contextlib.contextmanager
def hinted(tensors: set[str]):
    """``T.copy`` adds ``eviction_policy="evict_first"`` to copies from or to a global
    tensor named in ``tensors`` while the context is open."""
    plain = T.copy

    def copy(src, dst, **kw):
        if _name(src) in tensors or _name(dst) in tensors:
            kw.setdefault("eviction_policy", "evict_first")
        return plain(src, dst, **kw)

    T.copy = copy
    try:
        yield
    finally:
        T.copy = plain


def hinted_outputs(problem: Problem, config: KernelConfig, mode: str):
    """The tool's outputs prim_func with ``mode``'s copies hinted."""
    with hinted(MODES[mode]):
        return prim_funcs(problem, config)[2]


def compile_outputs(problem: Problem, config: KernelConfig, mode: str, arch: str):
    return tilelang.compile(hinted_outputs(problem, config, mode), target={"kind": "cuda", "arch": arch})


def cpu() -> int:
    """Compile every mode for sm_90a; show that the CUDA differs from the tool's outputs
    kernel only in cache hints (each hinted copy's name)."""
    hint = re.compile(r"<tl::CacheHintSm90::EVICT_\w+>")
    for problem, config in SPLIT_TIMED[:1] + SPLIT_CHECKED:
        tool = tilelang.compile(prim_funcs(problem, config)[2], target={"kind": "cuda", "arch": "sm_90a"})
        base = tool.get_kernel_source()
        for mode in MODES:
            src = compile_outputs(problem, config, mode, "sm_90a").get_kernel_source()
            same = hint.sub("", src) == hint.sub("", base)
            lines = [line.strip() for line in src.splitlines() if "EVICT_FIRST" in line]
            print(f"{problem.seqlen} {config.label} {mode}: same apart from hints: {same}; hinted:")
            print("   ", "\n    ".join(lines))
    return 0


def gpu() -> int:
    from modes import SplitCall, check_kept, emit, inputs_for, time_modes

    from kernel import build
    from kernel.build import cuda_arch, precompile
    from tuner.bench import copy_bandwidth

    arch = cuda_arch()
    cases = SPLIT_TIMED + SPLIT_CHECKED
    precompile(cases, arch=arch)
    copy_rate = copy_bandwidth()
    emit({"kind": "copy", "bytes_per_s": copy_rate})
    kernels = {}
    for problem, config in cases:
        tool = build(problem, config)
        check_kept(kernels, "tool", tool, SPLIT_TIMED, seed=91)
        for mode in RUN:
            outputs = compile_outputs(problem, config, mode, arch)
            check_kept(kernels, mode, SplitCall(tool, outputs=outputs), SPLIT_TIMED, seed=91)
    time_modes(kernels, inputs_for(kernels, seed=92), kind="whole", copy_rate=copy_rate)
    return 0


logging.getLogger("tilelang").setLevel(logging.WARNING)  # its INFO lines go to stdout

if __name__ == "__main__":
    sys.exit(cpu() if sys.argv[1:2] == ["cpu"] else gpu())
