"""What a process pays before its first kernel runs: ``import kernel.ops`` loads no
compiler, and a kernel compiled before opens from the disk cache without TileLang."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Loaded where a compile or a kernel load first happens, never by the import.
HEAVY = ("tilelang", "tvm", "tvm_ffi", "ml_dtypes", "scipy", "pandas", "optuna", "sklearn", "triton")


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_import_kernel_ops_loads_no_compiler_and_nothing_heavy():
    out = _run(
        "import json, sys, torch\n"
        "before = set(sys.modules)\n"
        "import kernel.ops\n"
        "new = sorted(set(sys.modules) - before)\n"
        "print(json.dumps({'new': new, 'all': sorted(sys.modules)}))\n"
    )
    found = json.loads(out)
    heavy = [m for m in found["all"] if m.split(".")[0] in HEAVY]
    assert heavy == []
    # what the import adds to torch's: our modules and a few of the standard library's
    assert all(
        m.split(".")[0] in {"kernel", "concurrent", "multiprocessing", "fcntl"} for m in found["new"]
    ), found["new"]


@pytest.mark.parametrize("gate", ["head", "token"])
def test_a_kernel_compiled_before_opens_without_tilelang(gate):
    """``kernel.loader`` indexes a compiled kernel, of either family (a per-token gate's is
    launched so by ``kernel.gated_build.compile_gated``); a fresh process opens it from
    TileLang's disk cache with TileLang's Python package never imported, and its source is
    the compiled one."""
    from kernel.builder import compile_class
    from kernel.config import Call, KernelConfig, Problem
    from kernel.loader import index_path, remember
    from kernel.probe import ProbeFailure
    from kernel.variants import shape_generic

    problem = Problem(1, 2, 64, 64, 64, "float16", gate)
    config = KernelConfig(chunk=64, block_dv=64, num_stages=1, threads=128, scores="smem", segments=1)
    call = Call(0.125, False, True)
    kernels = compile_class(problem, config, call, "sm_90a", run_on="sm_90a")
    index = index_path(shape_generic(problem, config, "sm_90a"), config, call, "sm_90a", "sm_90a")
    remember(index, kernels)
    assert index.exists()
    out = _run(
        "import sys\n"
        "from pathlib import Path\n"
        "from kernel.loader import load\n"
        f"(kernel,) = load(Path({str(index)!r}))\n"
        "assert callable(kernel.function)\n"
        "print('tilelang' in sys.modules)\n"
        "print(kernel.get_kernel_source())\n"
    )
    imported, source = out.split("\n", 1)
    assert imported == "False"
    assert source.rstrip("\n") == kernels[0].get_kernel_source().rstrip("\n")
    if gate == "token":  # what the gated op launches, of a kernel warmup compiled: the entry function
        from kernel.builder import precompile

        warmed = Call(0.25, True, True)  # a call no other test indexes
        assert not isinstance(precompile([(problem, config, warmed)], arch="sm_90a")[0], ProbeFailure)
        out = _run(
            "import sys\n"
            "from kernel.config import Call, KernelConfig, Problem\n"
            "from kernel.gated_build import compile_gated\n"
            f"launch = compile_gated({problem!r}, {config!r}, {warmed!r}, arch='sm_90a')\n"
            "print(type(launch).__name__, 'tilelang' in sys.modules)\n"
        )
        assert out.split() == ["Function", "False"]
