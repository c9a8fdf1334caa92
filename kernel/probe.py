"""What the compiler says about a (problem, config), with no GPU.

TileLang lowers the kernel for an architecture of ``kernel.arch`` (``sm_90a`` unless
told); nvcc compiles the generated CUDA with ptxas in verbose mode; we parse registers,
spills and the stack frame, and read the dynamic shared memory from the lowered module.
ptxas never checks shared memory against the device, so the probe does, against the
architecture's limit per block.

Failures are values, not exceptions: a config that TileLang cannot lower (0.1.15 fails
every ``chunk=32`` and ``threads=256`` config whose scores stay in registers with "Layout
infer conflict", and some small tiles with "No valid warp partition") or that ptxas
rejects comes back as a :class:`ProbeFailure` carrying the compiler's message.
"""

import contextlib
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from kernel.arch import DEFAULT_ARCH, get_arch, target
from kernel.config import PLAIN_CALL, Call, KernelConfig, Problem
from kernel.variants import pass_configs, prim_funcs

NVCC_TIMEOUT_S = 300

FailureStage = Literal["lower", "nvcc"]


@dataclass(frozen=True)
class Resources:
    """Per-block resources of one compiled kernel, as ptxas and TileLang report them.

    For a variant of several kernels: spills summed; registers, stack and threads the
    largest; shared memory that of the kernel that needs the most.
    """

    registers: int  # per thread; warp-specialised consumers are capped at 240
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack_frame: int  # bytes
    static_smem: int  # bytes, from ptxas
    dynamic_smem: int  # bytes, from the lowered module
    threads_launched: int  # consumer threads plus TileLang's producer warp group
    seed_register_estimate: int  # the seed's fragment arithmetic, for comparison
    compile_seconds: float
    smem_limit: int  # bytes one block may opt into on the architecture compiled for
    arch: str  # the architecture compiled for (``kernel.arch.ARCHS``)

    @property
    def smem_bytes(self) -> int:
        return self.static_smem + self.dynamic_smem

    @property
    def spill_bytes(self) -> int:
        return self.spill_stores + self.spill_loads

    @property
    def fits_smem(self) -> bool:
        return self.smem_bytes <= self.smem_limit

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "smem_bytes": self.smem_bytes,
            "spill_bytes": self.spill_bytes,
            "fits_smem": self.fits_smem,
        }


@dataclass(frozen=True)
class ProbeFailure:
    """The compiler refused the kernel: at which stage, with which error and message."""

    stage: FailureStage
    error_type: str
    message: str
    compile_seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


ProbeResult = Resources | ProbeFailure

_PTXAS_PATTERNS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack_frame": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "static_smem": re.compile(r"(\d+) bytes smem"),
}


def parse_ptxas(log: str) -> dict[str, int]:
    """Pull the resources of the one entry function out of ``ptxas --verbose``."""
    found = {}
    for name, pattern in _PTXAS_PATTERNS.items():
        match = pattern.search(log)
        if match is None and name == "static_smem":  # ptxas omits a zero
            found[name] = 0
        elif match is None:
            raise ValueError(f"ptxas output has no '{name}' count:\n{log}")
        else:
            found[name] = int(match.group(1))
    return found


def lower(func: Any, *, arch: str = DEFAULT_ARCH):
    """Lower one prim func (built for ``arch``) to CUDA source for ``arch``: TileLang's
    ``CompiledArtifact``."""
    import tilelang
    from tilelang import tvm

    cuda = tvm.target.Target(target(arch))
    with cuda, tvm.transform.PassContext(opt_level=3, config=pass_configs(arch)):
        return tilelang.lower(func, target=cuda)


def compile_kernel(
    problem: Problem,
    config: KernelConfig,
    arch: str = DEFAULT_ARCH,
    call: Call = PLAIN_CALL,
    *,
    run_on: str | None = None,
) -> tuple[Any, ...]:
    """TileLang-compile every kernel of the config for an explicit ``arch``: needs nvcc, not
    a GPU. Cached on disk, so a later ``kernel.build`` of the same (problem, config) on an
    ``arch`` GPU is a cache hit. ``run_on`` assembles ``arch``'s code for a GPU of another
    architecture (``kernel.arch.target``): the Ampere path run on a Hopper GPU."""
    config.check_fits(problem)
    return _compile(prim_funcs(problem, config, call, arch=arch), target(arch, run_on=run_on))


def compile_funcs(funcs: list, arch: str, *, run_on: str | None = None) -> tuple[Any, ...]:
    """TileLang-compile prim funcs built for ``arch`` (any kernel family's: the decode
    step's, ``kernel.decode_build``), as ``compile_kernel`` compiles a config's."""
    return _compile(funcs, target(arch, run_on=run_on))


def _compile(funcs: list, cuda: dict) -> tuple[Any, ...]:
    return tuple(kernel for kernel, _ in _compile_logged(funcs, cuda))


class _NvccOutput(logging.Handler):
    """What TileLang's nvcc run printed, ptxas's figures among it, kept for the thread that
    asked for it: TileLang logs it where ``TILELANG_VERBOSE`` is on, which also has ptxas
    print them. The compile's own thread calls nvcc, so each of ``_compile_logged``'s
    threads finds its kernel's output and no other."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.wanted = threading.local()

    def emit(self, record: logging.LogRecord) -> None:
        kept = getattr(self.wanted, "kept", None)
        if kept is not None and str(record.msg).startswith("PTXAS verbose output"):
            kept.append(record.getMessage())


_NVCC_OUTPUT = _NvccOutput()


def _keep_nvcc_output() -> None:
    """TileLang's nvcc runs in this process print ptxas's figures and log them to
    ``_NVCC_OUTPUT`` alone. ``TILELANG_VERBOSE`` does nothing else here: TileLang's CUDA
    compile reads it, and every compile of this project passes ``verbose=False``. The
    flags it adds (``--ptxas-options=--verbose -w``) are in TileLang's key for nvcc's
    output, not in its kernel cache's key, and change no instruction of the cubin (its
    SASS, ``cuobjdump -sass``; the file's bytes differ)."""
    from tilelang.contrib import nvcc

    os.environ["TILELANG_VERBOSE"] = "1"
    # TileLang's nvcc module logs its output (and its command: both where verbose, and
    # nothing else) to TileLang's logger, which ``_compile_logged`` silences; its own
    # logger, which only the probe's handler reads, takes them.
    logger = logging.getLogger("tilelang.contrib.nvcc")
    if _NVCC_OUTPUT not in logger.handlers:
        logger.addHandler(_NVCC_OUTPUT)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the figures are the probe's, not the terminal's
    nvcc.logger = logger


def _compile_logged(funcs: list, cuda: dict) -> list[tuple[Any, str | None]]:
    """``_compile``, each kernel with ptxas's log of its nvcc run, or None where TileLang
    ran none (a kernel from its memory or disk cache, or nvcc's output from its own)."""
    import tilelang

    # Compiler failures come back to the caller as exceptions (and from ``probe`` as
    # values); TileLang's logger would only repeat them, with pages of generated source.
    tilelang.set_log_level(logging.CRITICAL + 1)
    # The split's carry kernel is the same for many configs of a problem: TileLang warns on
    # each reuse from its memory cache, which is the reuse we want.
    logging.getLogger("tilelang.cache.kernel_cache").setLevel(logging.ERROR)
    _keep_nvcc_output()
    options = pass_configs(cuda["arch"])

    def one(func: Any) -> tuple[Any, str | None]:
        _NVCC_OUTPUT.wanted.kept = kept = []
        try:
            kernel = tilelang.compile(func, target=cuda, pass_configs=options, verbose=False)
        finally:
            _NVCC_OUTPUT.wanted.kept = None
        return kernel, (kept[0] if len(kept) == 1 else None)

    # A split's kernels compile in threads, as TileLang's autotuner compiles (its cache is
    # thread-safe, nvcc runs outside the GIL). evidence: docs/evidence.md#compile-threads
    with ThreadPoolExecutor(len(funcs)) as threads:
        return list(threads.map(one, funcs))


def probe(
    problem: Problem, config: KernelConfig, *, arch: str = DEFAULT_ARCH, call: Call = PLAIN_CALL
) -> ProbeResult:
    """Compile ``(problem, config)`` for ``arch`` and report its resources, or the failure.

    The compile goes through TileLang's disk cache (see ``compile_kernel``). Raises
    ``ValueError`` only for a config that cannot tile the problem at all
    (``KernelConfig.check_fits``) or an unknown ``arch``: those are a caller's mistakes, not
    compiler findings.
    """
    config.check_fits(problem)
    return probe_funcs(
        lambda: prim_funcs(problem, config, call, arch=arch),
        arch=arch,
        seed_register_estimate=config.seed_register_estimate(problem),
    )


def probe_funcs(
    make: Callable[[], list], *, arch: str = DEFAULT_ARCH, seed_register_estimate: int = 0
) -> ProbeResult:
    """``probe`` of the prim funcs ``make()`` returns (made inside, where a TileLang
    failure to build them is a finding): any kernel family's, the decode step's too
    (``kernel.decode_build.probe_decode``)."""
    limit = get_arch(arch).smem_per_block
    start = time.perf_counter()
    try:
        with _captured_output() as printed:
            funcs = make()
            # Their TIR before compiling: TileLang's lowering renames variables of the
            # funcs it compiles (sm_80's thread binding), which a disk-cache hit never
            # does, so the script after a compile is no key another process finds.
            scripts = [f.script() for f in funcs]
            compiled = _compile_logged(funcs, target(arch))
    except Exception as exc:  # TVM raises many types; each is recorded, none is swallowed
        stage: FailureStage = "nvcc" if "Compilation error" in str(exc) else "lower"
        message = "\n".join(filter(None, (printed.text.strip(), str(exc))))
        return ProbeFailure(stage, type(exc).__name__, _summary(message), time.perf_counter() - start)
    per_kernel = []
    for (kernel, log), func, script in zip(compiled, funcs, scripts):
        found = _kernel_resources(kernel, func, script, arch, log)
        if isinstance(found, str):
            return ProbeFailure("nvcc", "CompilationError", _summary(found), time.perf_counter() - start)
        per_kernel.append(found)
    smem = max(per_kernel, key=lambda f: f["static_smem"] + f["dynamic_smem"])
    return Resources(
        registers=max(f["registers"] for f in per_kernel),
        spill_stores=sum(f["spill_stores"] for f in per_kernel),
        spill_loads=sum(f["spill_loads"] for f in per_kernel),
        stack_frame=max(f["stack_frame"] for f in per_kernel),
        static_smem=smem["static_smem"],
        dynamic_smem=smem["dynamic_smem"],
        threads_launched=max(f["threads_launched"] for f in per_kernel),
        seed_register_estimate=seed_register_estimate,
        compile_seconds=time.perf_counter() - start,
        smem_limit=limit,
        arch=get_arch(arch).name,
    )


class _Printed:
    text = ""


@contextlib.contextmanager
def _captured_output() -> Iterator[_Printed]:
    """Catch what TileLang's native code prints on the process's stdout and stderr (its
    "Fatal: No valid warp partition" and source excerpts), so that it lands in the
    failure's message instead of the user's terminal."""
    printed = _Printed()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield printed
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            sink.seek(0)
            printed.text = sink.read().decode(errors="replace")


def launch_resources(artifact: Any) -> tuple[int, int]:
    """(dynamic shared memory bytes, threads per block) of a lowered TileLang artifact."""
    (device_func,) = artifact.device_mod.functions.values()
    # The extents are JSON but for a symbolic grid (packed sequences), so read the one we need.
    threads = re.search(r'"threadIdx\.x": *(\d+)', str(device_func.attrs["thread_extent"]))
    return int(device_func.attrs.get("dyn_shared_memory_buf", 0)), int(threads[1])


# The resources a kernel's entry in the resources cache holds. A change to how they are found
# (the ptxas command, its parsing, the launch resources) bumps RESOURCES_FORMAT, which is in the
# cache key: entries made the old way are then never read.
RESOURCE_FIELDS = (*_PTXAS_PATTERNS, "dynamic_smem", "threads_launched")
RESOURCES_FORMAT = 1


def read_resources(path: Path) -> dict[str, int] | None:
    """A resources cache entry, or None where there is none, it cannot be read or lacks a field."""
    with contextlib.suppress(OSError, ValueError):
        kept = json.loads(path.read_text())
        if isinstance(kept, dict) and all(isinstance(kept.get(k), int) for k in RESOURCE_FIELDS):
            return kept
    return None


def _kernel_resources(
    compiled: Any, func: Any, script: str, arch: str, log: str | None = None
) -> dict[str, int] | str:
    """One compiled kernel's resources (ptxas's and the launch's), or ptxas's log where it
    fails. ptxas's figures are those of TileLang's nvcc run (``log``) where its compile ran
    one, else of a run of our own. Kept on disk beside TileLang's kernel cache
    (``resources/``), keyed by the kernel's TIR as built (``script``, taken before any
    compile) and CUDA source, the architecture, the TileLang and nvcc releases and
    ``RESOURCES_FORMAT``: a probe that hits TileLang's cache skips the lowering and the
    ptxas run too, which cost as much as the compile itself. An entry that cannot be read,
    or lacks a field, is made again."""
    import tilelang
    import tilelang.env

    from kernel.environment import nvcc_version
    from kernel.files import write_json

    source = compiled.get_kernel_source()
    key = [script, source, arch, tilelang.__version__, str(nvcc_version()), str(RESOURCES_FORMAT)]
    path = Path(
        tilelang.env.TILELANG_CACHE_DIR,
        "resources",
        hashlib.sha256("\0".join(key).encode()).hexdigest() + ".json",
    )
    keep = tilelang.env.is_cache_enabled()
    kept = read_resources(path) if keep else None
    if kept is not None:
        return kept
    # A disk-cache hit carries no lowered module: lower again for the launch resources.
    dynamic_smem, threads_launched = launch_resources(compiled.artifact or lower(func, arch=arch))
    ok, log = (True, log) if log is not None else _ptxas(source, arch)
    if not ok:
        return log
    found = parse_ptxas(log) | {"dynamic_smem": dynamic_smem, "threads_launched": threads_launched}
    if keep:
        write_json(path, found)  # atomic: a concurrent probe reads the whole file or none
    return found


def _ptxas(source: str, arch: str) -> tuple[bool, str]:
    """Compile CUDA source to a cubin with TileLang's own flags; return (ok, ptxas log)."""
    from tilelang.contrib import nvcc

    with tempfile.TemporaryDirectory(prefix="decay-probe-") as tmp:
        src, cubin = Path(tmp, "kernel.cu"), Path(tmp, "kernel.cubin")
        src.write_text(source)
        cmd = [
            nvcc.get_nvcc_compiler(), "--cubin", "-O3", f"-arch={arch}",
            *nvcc.default_compile_options(), "--ptxas-options=--verbose", "-w",
            "-o", str(cubin), str(src),
        ]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=NVCC_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return False, f"nvcc timed out after {NVCC_TIMEOUT_S} s"
        return proc.returncode == 0, proc.stdout + proc.stderr


def _summary(message: str, limit: int = 2000) -> str:
    """The compiler's message, trimmed: nvcc's error lines when there are any."""
    errors = [ln for ln in message.splitlines() if "error" in ln.lower()]
    return ("\n".join(errors) if errors else message.strip())[:limit]
