"""The GPU architectures the kernel compiles for, and what each offers it: one registry (``ARCHS``).

Shared memory per block is the most one block may opt into, the CUDA C++ Programming
Guide's "Maximum amount of shared memory per thread block" (Compute Capabilities,
technical specifications: https://docs.nvidia.com/cuda/cuda-programming-guide/05-appendices/compute-capabilities.html):
163 KB (166,912 B) on 8.0, 99 KB (101,376 B) on 8.6, 8.9 and 12.0, 227 KB (232,448 B) on
9.0 and 10.0. ptxas never checks it against a device: the probe and the search space do.

``sms`` is the SM count of each architecture's reference GPU, the first of ``gpus``: what a
compile-only run sizes one wave of blocks by (``tuner.space.wave_seeds``); on a GPU its own
count wins (``kernel.builder.sm_count``). A100 108 and H100 SXM5 132 (NVIDIA's A100 and H100
architecture whitepapers; the H100 PCIe has 114, the H200 the SXM5's 132); B200 148 (74 of
the 80 SMs of each of its two dies); the others are their datasheets' CUDA cores over the
128 per SM of GA10x, Ada and Blackwell: A10 9,216 (72), L4 7,424 (58), RTX 5090 21,760 (170).

Only Hopper has the asynchronous warpgroup MMA (``wgmma``) the kernels issue without
waiting; elsewhere they issue TileLang's ``T.gemm`` (``kernel.mma``). TMA copies and
warp specialisation are TileLang's lowering of the same ``T.copy`` and ``T.Pipelined``,
per target: the kernels name neither. TileLang 0.1.15 warp-specialises wherever TMA
exists (sm_90a, sm_100a, sm_120) and then emits ``setmaxnreg``, which sm_120 lacks (nvcc:
"tl::warpgroup_reg_alloc requires a target with CTA register reconfiguration"): where
``setmaxnreg`` is missing the pipeline is not warp-specialised
(``kernel.variants.pass_configs``).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    """One compile target: its name as TileLang and nvcc spell it, and its limits."""

    name: str  # "sm_90a"
    capability: tuple[int, int]  # what torch.cuda.get_device_capability() returns on it
    smem_per_block: int  # bytes one block may opt into
    sms: int  # streaming multiprocessors of the reference GPU, the first of ``gpus``
    wgmma: bool  # Hopper's asynchronous warpgroup MMA
    setmaxnreg: bool  # register reconfiguration, which TileLang's warp-specialised pipeline needs
    gpus: str  # examples, for messages

    @property
    def symbolic_shapes(self) -> bool:
        """Whether the kernels take their batch size and sequence length from the tensors at
        launch, one compile serving every shape (``kernel.variants.shape_generic``): where
        TileLang warp-specialises the pipeline. Elsewhere TileLang 0.1.15 fails to
        software-pipeline a chunk loop of symbolic length with 2 stages or more ("Downcast
        from tirx.Sub to ir.IntImm"), so each shape compiles its own kernels."""
        return self.setmaxnreg

    @property
    def code(self) -> str:
        """The SASS target of this capability without arch-specific features (``sm_90``):
        what a GPU of it runs when another arch's code is lowered for it (``run_on``)."""
        return f"sm_{self.capability[0]}{self.capability[1]}"


ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch("sm_80", (8, 0), 166_912, 108, False, False, "A100, A800"),
        Arch("sm_86", (8, 6), 101_376, 72, False, False, "A10, A40, RTX 3090"),
        Arch("sm_89", (8, 9), 101_376, 58, False, False, "L4, L40, RTX 4090"),
        Arch("sm_90a", (9, 0), 232_448, 132, True, True, "H100, H200"),
        Arch("sm_100a", (10, 0), 232_448, 148, False, True, "B200, GB200"),
        Arch("sm_120", (12, 0), 101_376, 170, False, False, "RTX 5090, RTX PRO 6000"),
    )
}
# The target of a compile-only run on a machine without a GPU.
DEFAULT_ARCH = "sm_90a"


def get_arch(name: str) -> Arch:
    """The registry's entry for ``name``; ``ValueError`` in one line for any other name."""
    if name not in ARCHS:
        raise ValueError(f"unknown architecture {name!r}: the kernel compiles for {', '.join(ARCHS)}")
    return ARCHS[name]


def arch_of_capability(major: int, minor: int) -> Arch:
    """The registry's entry for a GPU of compute capability ``major.minor``."""
    for arch in ARCHS.values():
        if arch.capability == (major, minor):
            return arch
    raise ValueError(
        f"this GPU (compute capability {major}.{minor}) is not a target of the kernel; "
        f"it compiles for {', '.join(ARCHS)} (--arch explores one compile-only)"
    )


def target(arch: str, *, run_on: str | None = None) -> dict:
    """TileLang's CUDA target lowering for ``arch``. ``run_on`` (an arch of the registry)
    assembles that lowering for another GPU: ``sm_80`` code (``cp.async``, ``mma``) run on
    an H200 is ``target("sm_80", run_on="sm_90a")``; without it nvcc builds ``arch``'s
    binary alone, which an H200 refuses (``CUDA_ERROR_NO_BINARY_FOR_GPU``)."""
    found = {"kind": "cuda", "arch": get_arch(arch).name}
    if run_on is not None and get_arch(run_on).name != found["arch"]:
        found["code"] = [get_arch(run_on).code]
    return found


def local_arch() -> str | None:
    """The visible GPU's architecture (a name of ``ARCHS``), or None without a CUDA device;
    ``ValueError`` for a GPU the kernel does not target."""
    import torch

    if not torch.cuda.is_available():
        return None
    return arch_of_capability(*torch.cuda.get_device_capability()).name


def resolve(requested: str | None) -> tuple[str, bool]:
    """(the architecture to compile for, whether its kernels can run and be timed here).

    Without ``requested``: the local GPU's, or ``DEFAULT_ARCH`` compile-only where there is
    none. With it: that architecture, run only where the local GPU is one of it."""
    if requested is None:
        here = local_arch()
        return (here or DEFAULT_ARCH), here is not None
    get_arch(requested)
    try:
        here = local_arch()
    except ValueError:  # a GPU of no target: --arch explores compile-only
        here = None
    return requested, here == requested
