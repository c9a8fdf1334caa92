"""The kernels' tensor-core MMAs, portable from sm_80 up.

On Hopper an MMA is issued as ``T.wgmma_gemm`` and not waited for, so the code after it
overlaps the tensor cores until a ``wait`` retires it. Elsewhere the same statements issue
TileLang's ``T.gemm``, which TileLang lowers per target (``mma.sync`` on Ampere, Ada and
Blackwell) and which returns with its result ready: every ``wait`` becomes no statement at
all. One kernel source therefore serves every architecture, and the CUDA generated for
``sm_90a`` is what the Hopper-only source generated (experiments/portable_codegen/).
"""

from dataclasses import dataclass

import tilelang.language as T

from kernel.arch import get_arch


@dataclass(frozen=True)
class Mma:
    """The MMA statements of one architecture; called inside ``@T.macro`` bodies."""

    asynchronous: bool  # issue without waiting (Hopper's wgmma)

    def gemm(self, A, B, C, **knobs):
        """``C (+)= A @ B`` (``T.gemm``'s arguments: transposes, ``clear_accum``, ``policy``)."""
        return (T.wgmma_gemm if self.asynchronous else T.gemm)(A, B, C, **knobs)

    def wait(self, pending: int):
        """Wait until at most ``pending`` issued MMAs may still run; nothing where each
        MMA already returned with its result."""
        return T.wait_wgmma(pending) if self.asynchronous else None


def mma_for(arch: str, *, rows: int) -> Mma:
    """The MMA statements ``arch`` (a name of ``kernel.arch.ARCHS``) compiles for tiles of
    ``rows`` rows: wgmma needs 64-row tiles, so smaller ones wait for each MMA."""
    return Mma(asynchronous=get_arch(arch).wgmma and rows % 64 == 0)
