"""Compiled kernels found again by our own key, without TileLang.

TileLang finds a kernel in its disk cache by hashing the printed TIR program, so a cache
hit still imports TileLang (a second or more), builds the program in its Python DSL and
prints it. The index here maps what decides a kernel (the code of the modules that
generate and launch it, the compiler's release, the problem's class, the config, the
call and the architectures) to the entries TileLang's cache holds for it. A later process
opens those shared libraries through TVM-FFI with TileLang's native libraries loaded but
not its Python package, and launches each through its entry function: the call
TileLang's own adapter makes last, without the adapter's Python around it.

An entry that is missing, unreadable or refused is a miss: the caller compiles through
TileLang (its disk cache then hits), and ``remember`` writes the entry again.
"""

import contextlib
import ctypes
import functools
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from kernel.config import Call, KernelConfig, Problem
from kernel.environment import GATED_MODULES, KERNEL_MODULES

INDEX_FORMAT = 1
INDEX_DIR = "decay-tuner-index"  # beside TileLang's own folders in its cache
# The modules whose code decides what a job compiles to: a family's code-key modules
# (``kernel.environment``) and the compile options of ``kernel.probe``. Their bytes are in the
# key, each family's its own, so that an edit to one family's code leaves the other's found.
_CODE = {
    "head": (*KERNEL_MODULES, "probe.py"),
    "token": (*GATED_MODULES, "probe.py"),
}
# TileLang's artifact of each execution backend (``tilelang.cache``): tvm_ffi is CUDA's default.
_LIBRARY = "executable.so"


class LoadedKernel:
    """One kernel of TileLang's disk cache: ``function(*tensors)`` launches it on torch's
    current stream with the arguments of TileLang's ``JITKernel``."""

    __slots__ = ("function", "path")

    def __init__(self, function: Any, path: Path) -> None:
        self.function = function
        self.path = path

    def __call__(self, *args: Any) -> Any:
        return self.function(*args)

    def get_kernel_source(self, kernel_only: bool = True) -> str:
        """The generated CUDA source, as ``JITKernel.get_kernel_source`` gives it."""
        source = (self.path / "device_kernel.cu").read_text()
        return source if kernel_only else source + "\n\n" + (self.path / "host_kernel.cu").read_text()


def cache_dir() -> Path:
    """TileLang's cache folder, as ``tilelang.env`` reads it."""
    return Path(os.environ.get("TILELANG_CACHE_DIR") or os.path.expanduser("~/.tilelang/cache"))


def _cache_on() -> bool:
    if os.environ.get("TILELANG_DISABLE_CACHE", "0").lower() in ("1", "true", "yes", "on"):
        return False
    tilelang = sys.modules.get("tilelang")  # disabled at run time (``tilelang.disable_cache``)
    return tilelang is None or bool(getattr(tilelang, "is_cache_enabled", lambda: True)())


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def _stamp(gate: str) -> str:
    """The code and compiler the key holds: our modules' bytes (``gate``'s family's), and the
    size and time of TileLang's and TVM-FFI's native libraries (a reinstall is a new stamp)."""
    digest = hashlib.sha256(f"{INDEX_FORMAT}".encode())
    here = Path(__file__).parent
    for name in _CODE[gate]:
        digest.update(name.encode() + b"\0" + (here / name).read_bytes())
    for package, lib in (("tilelang", "lib/libtilelang.so"), ("tvm_ffi", "lib/libtvm_ffi.so")):
        where = _package_dir(package)
        found = None if where is None else where / lib
        stat = found.stat() if found is not None and found.exists() else None
        digest.update(f"{package}:{found}:{stat and stat.st_size}:{stat and stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def index_path(problem: Problem, config: KernelConfig, call: Call, arch: str, run_on: str) -> Path:
    """Where the index keeps the entries of one job: ``problem`` its ``shape_generic``
    class, ``arch`` the architecture lowered for, ``run_on`` the GPU's."""
    key = {
        "stamp": _stamp(problem.gate),
        "problem": problem.to_dict(),
        "config": config.to_dict(),
        "call": call.to_dict(),
        "arch": arch,
        "run_on": run_on,
    }
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return cache_dir() / INDEX_DIR / f"{name}.json"


def load(index: Path) -> tuple[LoadedKernel, ...] | None:
    """The kernels ``index`` names, opened; None where it names none or one fails to open."""
    if not _cache_on():
        return None
    try:
        kept = json.loads(index.read_text())
        paths = [cache_dir() / entry for entry in kept["kernels"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if kept.get("format") != INDEX_FORMAT or not paths or not all((p / _LIBRARY).is_file() for p in paths):
        return None
    try:
        module = _runtime()
        return tuple(LoadedKernel(module.load_module(str(p / _LIBRARY))["main"], p) for p in paths)
    except Exception:  # a library TVM-FFI refuses: compile through TileLang instead
        return None


def remember(index: Path, kernels: tuple[Any, ...]) -> None:
    """Write the index entry of ``kernels`` (TileLang's ``JITKernel``s, each tagged with its
    cache entry on a compile or a disk-cache hit); nothing where the cache is off or one
    of them has no entry of the tvm_ffi backend."""
    if not _cache_on():
        return
    root = cache_dir().resolve()
    entries = []
    for kernel in kernels:
        path = getattr(kernel, "_tilelang_cache_path", None)
        if path is None or not (Path(path) / _LIBRARY).is_file():
            return
        with contextlib.suppress(ValueError):
            entries.append(str(Path(path).resolve().relative_to(root)))
    if len(entries) != len(kernels):
        return
    from kernel.files import write_json

    with contextlib.suppress(OSError):  # a read-only cache: every process compiles as before
        write_json(index, {"format": INDEX_FORMAT, "kernels": entries})


def fast_functions(kernels: tuple[Any, ...]) -> tuple[Any, ...]:
    """What launches each kernel most cheaply: a ``LoadedKernel``'s entry function; for
    TileLang's ``JITKernel``, the entry function of its cache entry where it has one
    (what its adapter calls, after checks of its own), else the kernel itself."""
    found = []
    for kernel in kernels:
        if isinstance(kernel, LoadedKernel):
            found.append(kernel.function)
            continue
        path = getattr(kernel, "_tilelang_cache_path", None)
        function = kernel
        if path is not None and (Path(path) / _LIBRARY).is_file() and _cache_on():
            with contextlib.suppress(Exception):
                function = _runtime().load_module(str(Path(path) / _LIBRARY))["main"]
        found.append(function)
    return tuple(found)


@functools.cache
def _runtime() -> Any:
    """TVM-FFI, with the native libraries a TileLang kernel calls into loaded: TVM's
    runtime (the CUDA module loader) and TileLang's (the TMA descriptors), as ``import
    tilelang`` loads them, but without its Python package. Where they do not load so,
    TileLang itself is imported."""
    import tvm_ffi

    if "tilelang" in sys.modules:
        return tvm_ffi
    lib = None if (where := _package_dir("tilelang")) is None else where / "lib"
    try:
        if lib is None:
            raise OSError("no tilelang package")
        for z3 in _z3_libraries():
            ctypes.CDLL(str(z3), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(lib / "libtvm_runtime.so"), mode=ctypes.RTLD_GLOBAL | os.RTLD_LAZY)
        ctypes.CDLL(str(lib / "libtvm_compiler.so"), mode=ctypes.RTLD_LOCAL | os.RTLD_LAZY)
        ctypes.CDLL(str(lib / "libtilelang.so"), mode=ctypes.RTLD_LOCAL | os.RTLD_LAZY)
    except OSError:
        import tilelang  # noqa: F401  (loads them its own way)
    return tvm_ffi


def _z3_libraries() -> list[Path]:
    """Z3's library from its package, which ``import tilelang`` loads first (a symlinked
    install breaks the relative path libtilelang.so names it by)."""
    where = _package_dir("z3")
    return [] if where is None or not (where / "lib" / "libz3.so").is_file() else [where / "lib" / "libz3.so"]
