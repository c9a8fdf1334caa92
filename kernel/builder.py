"""Build a callable kernel for one (problem, config) on the current CUDA device."""

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import as_completed
from dataclasses import dataclass
from typing import Any

import torch

from kernel import loader
from kernel.arch import local_arch
from kernel.config import PLAIN_CALL, Call, KernelConfig, Problem, retnet_decay, whole_chunks
from kernel.probe import ProbeFailure, ProbeResult, compile_kernel, probe
from kernel.processes import compile_pool
from kernel.variants import launch, launch_dkdv, launch_pool, shape_generic, unused_state

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ScalarDecayKernel:
    """``kernel(q, k, v) -> o`` for one compiled (problem, config, call), of either variant.

    q, k: ``[B, S, H, DK]``; v: ``[B, S, H, DV]``; contiguous CUDA tensors of the problem's
    heads, head sizes and dtype, of any B and S the config tiles (the compiled kernels take
    them from the tensors: ``kernel.variants.shape_generic``); ``problem`` is the shape
    ``run`` launches for. ``decay``: each head's alpha in (0, 1], an fp32 CUDA tensor ``[H]`` (default:
    RetNet's, ``kernel.config.retnet_decay``). With ``call.initial_state``, ``initial_state`` is
    the fp32 ``[B, H, DK, DV]`` state before the first token; with ``call.final_state``,
    ``final_state`` is the fp32 ``[B, H, DK, DV]`` tensor that receives the state after
    the last. Pass ``out=`` to write into an existing ``[B, S, H, DV]`` tensor. A kernel
    compiled for packed sequences (``call.packed``) takes q, k, v ``[1, T, H, D]`` of any
    T, the int32 ``cu_seqlens`` ``[N + 1]`` and states ``[N, H, DK, DV]``.
    """

    problem: Problem
    config: KernelConfig
    compiled: tuple[
        Any, ...
    ]  # tilelang.JITKernel (or kernel.loader.LoadedKernel) per kernel, in launch order
    call: Call = PLAIN_CALL
    lowered_for: str | None = None  # the architecture lowered for (``build``'s); None: this GPU's
    launchers: tuple[Any, ...] | None = None  # what launches each kernel (default: ``compiled``)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        decay: torch.Tensor | None = None,
        initial_state: torch.Tensor | None = None,
        final_state: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        p, call = self.problem, self.call
        given = {
            "initial_state": (initial_state, call.initial_state),
            "final_state": (final_state, call.final_state),
            "cu_seqlens": (cu_seqlens, call.packed),
        }
        for name, (tensor, compiled_for) in given.items():
            if (tensor is not None) != compiled_for:
                raise ValueError(f"this kernel was compiled {'with' if compiled_for else 'without'} {name}")
        batch, seqlen = (q.shape[0], q.shape[1]) if isinstance(q, torch.Tensor) and q.dim() == 4 else (0, 0)
        sequences = batch
        if call.packed:
            if not (
                isinstance(q, torch.Tensor)
                and q.dim() == 4
                and isinstance(cu_seqlens, torch.Tensor)
                and cu_seqlens.dim() == 1
                and cu_seqlens.numel() >= 2
            ):
                raise ValueError("a packed call takes q [1, T, H, DK] and cu_seqlens [N + 1]")
            batch, seqlen, sequences = 1, q.shape[1], cu_seqlens.numel() - 1
        qk_shape = (batch, seqlen, p.heads, p.dk)
        vo_shape = (batch, seqlen, p.heads, p.dv)
        state_shape = (sequences, p.heads, p.dk, p.dv)
        dtype = TORCH_DTYPES[p.dtype]
        check_tensor("q", q, qk_shape, dtype)
        if out is None:
            out = torch.empty(vo_shape, dtype=dtype, device=q.device)
        if decay is None:
            decay = constant_decay(retnet_decay(p.heads), p.heads, q.device)
        tensors = [("k", k, qk_shape, dtype), ("v", v, vo_shape, dtype), ("out", out, vo_shape, dtype)]
        tensors.append(("decay", decay, (p.heads,), torch.float32))
        tensors += [
            (n, t, state_shape, torch.float32)
            for n, t in (("initial_state", initial_state), ("final_state", final_state))
            if t is not None
        ]
        if call.packed:
            tensors.append(("cu_seqlens", cu_seqlens, (sequences + 1,), torch.int32))
        for name, tensor, shape, kind in tensors:
            check_tensor(name, tensor, shape, kind)
            if tensor.device != q.device:
                raise ValueError(f"{name} is on {tensor.device} but q is on {q.device}")
        kernel = self if call.packed else self.serving(dataclasses.replace(p, batch=batch, seqlen=seqlen))
        return kernel.run(q, k, v, decay, initial_state, final_state, out, cu_seqlens)[0]

    def serving(self, problem: Problem) -> "ScalarDecayKernel":
        """This kernel launched for ``problem``, a shape of the same heads, head sizes and
        dtype: the same compiled kernels. ``ValueError`` where the config cannot tile it."""
        if problem == self.problem:
            return self
        arch = self.lowered_for or cuda_arch()
        if shape_generic(problem, self.config, arch) != shape_generic(self.problem, self.config, arch):
            raise ValueError(f"this kernel was compiled for {self.problem}, not {problem}")
        self.config.check_fits(problem)
        return dataclasses.replace(self, problem=problem)

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        decay: torch.Tensor,
        initial_state: torch.Tensor | None = None,
        final_state: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        states: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The call on tensors already checked as ``__call__`` checks them (as
        ``decay_attention`` does): no check again on the way to the launch. Returns the
        output and, split, the state entering each segment (``kernel.variants.launch``:
        given as ``states``, only the outputs kernel runs)."""
        if out is None:
            out = torch.empty_like(v, memory_format=torch.contiguous_format)
        h0, ht = self._states(initial_state, final_state, q.device)
        p, c = self.problem, self.config
        used = launch(
            p, c, self.call, self.launchers or self.compiled, q, k, v, decay, h0, out, ht, cu_seqlens, states
        )
        return out, used

    def run_pool(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        decay: torch.Tensor,
        pool: torch.Tensor,
        out: torch.Tensor,
        cu_seqlens: torch.Tensor,
        slots: torch.Tensor,
        from_pool: torch.Tensor,
    ) -> torch.Tensor:
        """A pool call (``call.slots``) on checked tensors: q, k ``[1, T, H, DK]``, v and
        ``out`` ``[1, T, H, DV]``, the int32 ``cu_seqlens`` ``[N + 1]``, the fp32 pool ``[P,
        H, DK, DV]`` read and written in place at the slots ``[N]`` (of ``call.slots``'s
        dtype), ``from_pool`` int8 ``[N]``: nonzero where a sequence starts from its slot
        (``kernel.scalar_decay.pool_fwd``). Returns ``out``."""
        p = self.problem
        rows = pool.view(-1, 1, p.dk, p.dv)
        launch_pool(self.launchers or self.compiled, q, k, v, decay, rows, out, cu_seqlens, slots, from_pool)
        return out

    def run_dkdv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        do: torch.Tensor,
        decay: torch.Tensor,
        initial_state: torch.Tensor | None = None,
        final_state: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        dk: torch.Tensor | None = None,
        dv: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dk, dv)`` of the fused reversed pass (``call.dkdv``, ``kernel.dkdv``) on
        tensors checked as ``run``'s: do ``[B, S, H, DV]``; ``initial_state``, dS's start
        after the last token; ``final_state`` receives dS at the first; ``dk`` and ``dv``,
        where given, receive the gradients (like k and v)."""
        dk = torch.empty_like(k) if dk is None else dk
        dv = torch.empty_like(v) if dv is None else dv
        h0, ht = self._states(initial_state, final_state, q.device)
        p, c = self.problem, self.config
        launch_dkdv(
            p, c, self.call, self.launchers or self.compiled, q, k, v, do, decay, h0, ht, dk, dv, cu_seqlens
        )
        return dk, dv

    def _states(self, initial: torch.Tensor | None, final: torch.Tensor | None, device: torch.device):
        """H0 and HT as the kernels declare them, ``[rows, 1, DK, DV]``: the call's states,
        or ``unused_state`` where it has none."""
        p = self.problem
        if initial is None or final is None:
            key = (p.batch * p.heads, p.dk, p.dv, device)
            unused = _UNUSED.get(key)
            if unused is None:
                unused = _UNUSED[key] = unused_state(p, device)
        return (unused if t is None else t.view(-1, 1, p.dk, p.dv) for t in (initial, final))

    @property
    def source(self) -> str:
        """The generated CUDA source of every kernel."""
        return "\n".join(c.get_kernel_source() for c in self.compiled)


# (rows, DK, DV, device) -> ``unused_state``'s prefix for them, kept: a view of its buffer,
# which stays valid when a larger call replaces the buffer.
_UNUSED: dict[tuple, torch.Tensor] = {}


@functools.cache
def constant_decay(alpha: float | tuple[float, ...], heads: int, device: torch.device) -> torch.Tensor:
    """One alpha for every head, or a tuple of one per head, as the fp32 ``[H]`` tensor
    the kernels read (made once).

    Made during a CUDA-graph capture, its fill would run only on replay while the cache
    kept it: a first call with a new float decay must come before the capture."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise ValueError(f"call once with decay={alpha} before capturing a CUDA graph, then capture")
    alphas = alpha if isinstance(alpha, tuple) else (alpha,) * heads
    return torch.tensor(alphas, dtype=torch.float32, device=device)


def check_tensor(name: str, tensor: Any, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Raise ``ValueError`` unless ``tensor`` is a contiguous CUDA tensor of this shape and dtype."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(tensor.shape)}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")
    if tensor.device.type != "cuda":
        raise ValueError(f"{name} must be on a CUDA device, got {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def cuda_arch() -> str:
    """The current device's architecture as ``kernel.arch`` names it (``sm_90a`` on
    Hopper); ``ValueError`` for a GPU the kernel does not target."""
    arch = local_arch()
    if arch is None:
        raise RuntimeError("no CUDA device is visible to torch")
    return arch


@functools.cache
def sm_count() -> int:
    """Streaming multiprocessors of the current device."""
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


@functools.cache
def memory_bandwidth() -> float | None:
    """The current device's peak memory bandwidth in bytes/s, from its memory clock and bus
    width (double data rate); None where the driver reports neither."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    rate = 2 * getattr(props, "memory_clock_rate", 0) * 1e3 * getattr(props, "memory_bus_width", 0) / 8
    return rate or None


def build(
    problem: Problem, config: KernelConfig, call: Call = PLAIN_CALL, *, lower_for: str | None = None
) -> ScalarDecayKernel:
    """Compile the kernel for the current CUDA device and return it ready to call.

    ``lower_for`` (an architecture of ``kernel.arch``) lowers the kernel as for that
    architecture and assembles it for this GPU: another architecture's code path, run
    here (the Ampere path on Hopper: ``lower_for="sm_80"``). Raises ``ValueError`` for a
    config that cannot tile the problem and ``RuntimeError`` when there is no CUDA device.
    Compiler failures propagate from TileLang; use :func:`kernel.probe.probe` first to get them
    as values. A per-token gate's problem (``Problem.gate``) is ``ValueError`` too: its kernel
    is launched by ``kernel.gated_build`` (``decay_attention(..., g=)``).
    """
    if problem.gate != "head":
        raise ValueError(f"{problem}: a per-token gate's kernel is launched by kernel.gated_build, not built")
    here = cuda_arch()
    key = (shape_generic(problem, config, lower_for or here), config, call, lower_for or here, here)
    config.check_fits(problem)
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = _COMPILED[key] = load_or_compile(*key, problem)
    return ScalarDecayKernel(problem, config, compiled[0], call, lower_for, compiled[1])


def load_or_compile(
    generic: Problem, config: KernelConfig, call: Call, arch: str, here: str, problem: Problem
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(the kernels, what launches each: ``kernel.loader.fast_functions``): opened from
    TileLang's disk cache by our index where an earlier process compiled them (no TileLang
    imported, no program built), else compiled (or found) by TileLang and indexed."""
    index = loader.index_path(generic, config, call, arch, here)
    kernels = loader.load(index)
    if kernels is None:
        kernels = compile_class(problem, config, call, arch, run_on=here)
        loader.remember(index, kernels)
    return kernels, loader.fast_functions(kernels)


def compile_class(
    problem: Problem, config: KernelConfig, call: Call, arch: str, *, run_on: str | None = None
):
    """``compile_kernel`` for ``problem``'s ``shape_generic`` class. Where TileLang fails to
    lower the class of whole chunks (it does for some splits of 32-token chunks: "[ThreadSync]
    Cannot lower a required shared-memory sync inside a divergent region"), the class of
    ragged ones, which serves every length, is compiled in its place."""
    try:
        return compile_kernel(problem, config, arch, call, run_on=run_on)
    except ValueError:
        raise
    except Exception:
        generic = shape_generic(problem, config, arch) != problem
        if not (generic and whole_chunks(problem, config.chunk)):
            raise
        ragged = dataclasses.replace(problem, seqlen=problem.seqlen + 1)
        return compile_kernel(ragged, config, arch, call, run_on=run_on)


# (shape_generic shape, config, call, arch, GPU arch) -> the compiled kernels, which serve
# every B and S of the shape: each is compiled (or read from the disk cache) once a process.
_COMPILED: dict[tuple, tuple[Any, ...]] = {}


def compiles() -> int:
    """Kernels this process has compiled, or read from TileLang's disk cache, for ``build``:
    what a call of a new batch size or sequence length must not add (the bench counts them)."""
    return len(_COMPILED)


def precompile(
    jobs: Sequence[tuple[Problem, KernelConfig] | tuple[Problem, KernelConfig, Call]],
    *,
    arch: str,
    workers: int | None = None,
    run_on: str | None = None,
    done: Callable[[], object] | None = None,
) -> list[ProbeResult]:
    """Probe many (problem, config[, call]) jobs in parallel processes, in their order.
    Each probe compiles through TileLang's disk cache, so a later ``build`` of the same job
    is a cache hit. ``done`` is called as each job ends (a progress bar's update).

    ``run_on`` (a GPU's architecture, other than ``arch``): each job the probe passes is
    also compiled as ``build(..., lower_for=arch)`` compiles it on that GPU, into the same
    cache."""
    full = [(*job[:2], job[2] if len(job) > 2 else PLAIN_CALL) for job in jobs]
    workers = workers or min(len(full), os.cpu_count() or 1) or 1
    with compile_pool(workers) as pool:
        futures = [pool.submit(_probe, *job, arch=arch, run_on=run_on) for job in full]
        if done is not None:
            for _ in as_completed(futures):
                done()
        return [future.result() for future in futures]


def _probe(
    problem: Problem, config: KernelConfig, call: Call, *, arch: str, run_on: str | None
) -> ProbeResult:
    res = probe(problem, config, arch=arch, call=call)
    if not isinstance(res, ProbeFailure):
        here = run_on or arch
        with contextlib.suppress(Exception):  # ahead of time only: the build raises it again
            # The probe's kernels (TileLang's memory cache), or those of the GPU it runs on,
            # indexed for a later process's ``build`` (``kernel.loader``).
            kernels = compile_class(problem, config, call, arch, run_on=here)
            index = loader.index_path(shape_generic(problem, config, arch), config, call, arch, here)
            loader.remember(index, kernels)
    return res
