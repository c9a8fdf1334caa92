"""What a GPU makes of a config before any timing: the compiled kernel's resources
the latency model reads (or their estimate before a compile), the HBM floor of a call, the blocks an
SM holds at once and the waves of the grid; and from them the analytic ratio, how full the
waves keep the SMs, which ranks grids (not pipelines) where no model is calibrated."""

import math
from dataclasses import dataclass
from typing import Any

from kernel import dkdv, rule
from kernel.arch import get_arch
from kernel.config import KernelConfig, Problem

REGISTERS_PER_SM, MAX_BLOCKS_PER_SM = 65536, 8
# Resident threads per SM: 2,048 on the data-centre parts, 1,536 on these (CUDA's tables).
THREADS_PER_SM, FEWER_THREADS_PER_SM = 2048, {"sm_86": 1536, "sm_89": 1536, "sm_120": 1536}
SMEM_RESERVED = 1024  # bytes of an SM's shared memory a block cannot opt into
# Registers per thread of the swept kernels, and of those split into 64 segments.
# evidence: docs/evidence.md#registers
TYPICAL_REGISTERS, SEGMENTS_64_REGISTERS = 168, {"forward": 224, "dkdv": 228}
PRODUCER_THREADS = 128  # the warp group TileLang adds where it warp-specialises


@dataclass(frozen=True)
class BlockResources:
    """What one block of a compiled kernel holds, as the probe reports it: registers per thread,
    shared memory bytes, threads. The latency model reads them."""

    registers: int
    smem_bytes: int
    threads: int

    @classmethod
    def of(cls, resources: Any) -> "BlockResources":
        """From ``kernel.probe.Resources`` or its ``to_dict()`` (a trial's user attrs)."""
        get = resources.get if isinstance(resources, dict) else lambda k: getattr(resources, k)
        smem = get("static_smem") + get("dynamic_smem")
        return cls(int(get("registers")), int(smem), int(get("threads_launched")))


def estimated_resources(problem: Problem, config: KernelConfig, sweep: str, arch: str) -> BlockResources:
    """The probe's resources before a compile: shared memory by the rule's arithmetic
    (``kernel.rule.smem_bytes``; the fused pass's, ``kernel.dkdv.smem_bytes``), equal to
    the compiled kernels' at every config the shipped sweeps timed; the threads plus TileLang's
    producer warp group where it warp-specialises; and the registers those kernels have
    (``TYPICAL_REGISTERS``, more split into 64 segments)."""
    smem = dkdv.smem_bytes(problem, config) if sweep == "dkdv" else rule.smem_bytes(problem, config)
    producer = PRODUCER_THREADS if get_arch(arch).setmaxnreg else 0
    registers = SEGMENTS_64_REGISTERS[sweep] if config.segments >= 64 else TYPICAL_REGISTERS
    return BlockResources(registers, smem, config.threads + producer)


STATE_BYTES = GATE_BYTES = 4  # the final state and a per-token gate's log-gates are fp32


def traffic_bytes(problem: Problem, *, sequences: int | None = None) -> int:
    """Fewest bytes a forward pass moves: Q and K (of ``Problem.qk_heads`` heads) and V
    read once, O written once (fp16 / bf16 elements), a per-token gate's fp32 log-gates
    ``g [B, S, H]`` read once, and the fp32 final state of each sequence
    (``problem.batch``, or ``sequences`` of a packed batch) written once."""
    p = problem
    n = p.batch if sequences is None else sequences
    gate = p.heads * GATE_BYTES if p.gate == "token" else 0
    tokens = p.batch * p.seqlen * ((2 * p.qk_heads * p.dk + 2 * p.heads * p.dv) * 2 + gate)
    return tokens + n * p.heads * p.dk * p.dv * STATE_BYTES


def floor_bytes(problem: Problem, sweep: str = "forward") -> int:
    """Fewest bytes the kernel moves in the call it was timed in: the forward's model call,
    ``traffic_bytes``; the fused dk+dv pass, Q, K, V and dO read and dK and dV written."""
    p = problem
    if sweep != "dkdv":
        return traffic_bytes(p)
    return p.batch * p.heads * p.seqlen * (3 * p.dk + 3 * p.dv) * 2


def blocks_per_sm(resources: BlockResources, arch: str) -> int:
    """Blocks that fit on one SM at once, by shared memory, threads and registers."""
    smem = (get_arch(arch).smem_per_block + SMEM_RESERVED) // max(resources.smem_bytes, 1)
    threads = FEWER_THREADS_PER_SM.get(arch, THREADS_PER_SM) // max(resources.threads, 1)
    registers = REGISTERS_PER_SM // max(resources.registers * resources.threads, 1)
    return max(1, min(MAX_BLOCKS_PER_SM, smem, threads, registers))


def grid(
    problem: Problem, config: KernelConfig, resources: BlockResources, arch: str, sms: int | None
) -> tuple[int, int, int]:
    """(blocks, blocks the GPU runs at once, waves) on ``sms`` SMs (default: the arch's
    reference GPU's)."""
    blocks = config.blocks(problem)
    slots = (sms or get_arch(arch).sms) * blocks_per_sm(resources, arch)
    return blocks, slots, math.ceil(blocks / slots)


def analytic_ratio(
    problem: Problem, config: KernelConfig, resources: BlockResources, arch: str, sms: int | None = None
) -> float:
    """The slots of the launched waves over the blocks that fill them (1: every wave full;
    a grid smaller than the GPU counts its idle slots)."""
    blocks, slots, waves = grid(problem, config, resources, arch, sms)
    return waves * slots / blocks
