"""What a measurement depends on besides the config.

``environment()`` names the GPU, the libraries and the compiler, and identifies the
kernels by their code: ``kernel_key`` hashes the syntax tree of the modules that generate
and launch the CUDA, with docstrings dropped (comments never reach the tree), so prose
and formatting never make a stored timing stale, and any changed constant or expression
does.
"""

import ast
import functools
import hashlib
import json
import re
import subprocess
from pathlib import Path
from typing import Any

ENVIRONMENT_KEYS = ("gpu", "capability", "arch", "tilelang", "torch", "cuda", "nvcc", "kernel")
# The modules whose code decides the constant-decay kernels' CUDA and how it is launched.
KERNEL_MODULES = (
    "config.py",
    "arch.py",
    "mma.py",
    "scalar_decay.py",
    "seq_split.py",
    "dkdv.py",
    "variants.py",
)
# The decode step's (``kernel.decode``): its own key, ``decode_kernel`` in a decode study's
# environment, so that a changed decode kernel never reuses a decode trial and the forward's
# key (what the stored forward results and the shipped tables are trusted by) stays as it is.
DECODE_MODULES = ("arch.py", "decode.py", "decode_build.py")
DECODE_KERNEL = "decode_kernel"
# A per-token gate's forward's (``kernel.gated``, ``Problem.gate``), the same way:
# ``gated_kernel`` in a gated study's environment and beside a table's gated entries.
GATED_MODULES = (
    "config.py",
    "arch.py",
    "mma.py",
    "scalar_decay.py",
    "variants.py",
    "gated.py",
    "gated_build.py",
)
GATED_KERNEL = "gated_kernel"


def code_digest(source: str) -> str:
    """sha256 of ``source``'s syntax tree without docstrings or positions."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or ([] if isinstance(node, ast.Module) else [ast.Pass()])
    return hashlib.sha256(_dump(tree).encode()).hexdigest()


def _dump(node: object) -> str:
    """``node`` as text, without the fields that hold None or an empty list: what Python
    versions add to a node (3.12's ``type_params``) or leave out of ``ast.dump`` (3.13)
    is one of those, so the same code gives the same text under 3.10 to 3.13."""
    if isinstance(node, list):
        return "[" + ", ".join(map(_dump, node)) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    fields = (f"{k}={_dump(v)}" for k, v in ast.iter_fields(node) if v is not None and v != [])
    return f"{type(node).__name__}({', '.join(fields)})"


def kernel_key(sources: dict[str, str] | None = None, modules: tuple[str, ...] = KERNEL_MODULES) -> str:
    """The kernels' identity: one digest over ``modules`` (name -> source; by default this
    package's, read once a process: the code it runs)."""
    if sources is None:
        return _package_kernel_key(modules)
    joined = "".join(f"{name}:{code_digest(sources[name])}\n" for name in modules)
    return hashlib.sha256(joined.encode()).hexdigest()[:12]


@functools.cache
def _package_kernel_key(
    modules: tuple[str, ...],
) -> str:  # 0.1 s of parsing: once, not at every environment()
    here = Path(__file__).parent
    return kernel_key({name: (here / name).read_text() for name in modules}, modules)


def decode_environment(arch: str | None = None) -> dict[str, Any]:
    """``environment(arch)`` and the decode step's code key (``DECODE_MODULES``): what a
    decode trial is measured in."""
    return environment(arch) | {DECODE_KERNEL: kernel_key(modules=DECODE_MODULES)}


def gated_environment(arch: str | None = None) -> dict[str, Any]:
    """``environment(arch)`` and the per-token gate's code key (``GATED_MODULES``): what a
    gated trial is measured in."""
    return environment(arch) | {GATED_KERNEL: kernel_key(modules=GATED_MODULES)}


@functools.cache
def nvcc_version() -> str | None:
    """The release of the nvcc TileLang compiles with (``13.0``), or None without one."""
    try:
        from tilelang.contrib import nvcc

        out = subprocess.run([nvcc.get_nvcc_compiler(), "--version"], capture_output=True, text=True).stdout
    except Exception:  # no CUDA toolkit: nothing is compiled here, nothing to record
        return None
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else None


def environment(arch: str | None = None) -> dict[str, Any]:
    """GPU, library and compiler versions, the architecture compiled for (``arch``;
    default: this GPU's, ``kernel.arch.resolve``) and the kernels' identity: a measurement
    taken under one environment is never reused under another."""
    import tilelang
    import torch

    from kernel.arch import resolve

    gpu = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name() if gpu else None,
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if gpu else None,
        "arch": resolve(arch)[0],
        "tilelang": tilelang.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nvcc": nvcc_version(),
        "kernel": kernel_key(),
    }


def env_key(env: dict[str, Any]) -> str:
    """sha256 of the sorted environment: the key measurements are cached under."""
    return hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:16]


def mismatches(saved: dict[str, Any], here: dict[str, Any] | None = None) -> list[str]:
    """How ``saved`` differs from ``here`` (default: this machine's environment), one
    'key: file .., here ..' each."""
    here = here or environment()
    return [
        f"{k}: file {saved.get(k)!r}, here {here[k]!r}" for k in ENVIRONMENT_KEYS if saved.get(k) != here[k]
    ]
