"""The time model's constants, fitted per device family (``calibration.json``), and the memory
outside every count: what a calibration writes and every prediction reads."""

from __future__ import annotations

from dataclasses import dataclass


#: Memory outside every count that a layout without FSDP keeps (communicator buffers, library
#: workspaces): the planner's default, not fitted -- no published table isolates it (unverified).
BASE_RESERVED_GIB = 2.0


def elementwise_passes(c: Constants, compiled: bool) -> float:
    """A block's memory-bound passes per token, fewer where ``torch.compile`` fused them."""
    return c.elementwise_passes * (c.compiled_passes if compiled else 1.0)


def reserved_gib(c: Constants, zero: int) -> float:
    """The memory outside every count of a layout at ZeRO stage ``zero`` (see ``Constants.reserved_gib``)."""
    return c.reserved_gib if zero >= 2 else min(c.reserved_gib, BASE_RESERVED_GIB)


@dataclass(frozen=True, kw_only=True)
class Constants:
    """Fitted per device family (``calibration.json``)."""

    gemm_eff: float = 0.75
    """Share of peak the largest matmuls reach."""
    m_half: float = 256.0
    """Rows (tokens of a micro-batch on one rank) at which a matmul reaches half of ``gemm_eff``."""
    n_half: float = 64.0
    """Local width (hidden / tp) at which a matmul reaches half of ``gemm_eff``."""
    elementwise_passes: float = 40.0
    """Hidden-state-sized reads and writes per token of a block's forward outside the matmuls
    (norms, activation, rotary, residuals, casts): memory-bound, at the device's bandwidth."""
    compiled_passes: float = 0.5
    """Share of ``elementwise_passes`` a block compiled by ``torch.compile`` still makes (``compile``:
    inductor fuses the norms, the activation, the rotary embedding and the residual adds into fewer
    kernels). Fitted on the runs that publish a block compiled and not (torchtitan's); 0.5, the
    default, an estimate (unverified) where a family has none."""
    fp8_eff: float = 1.0
    """The FP8 matmuls' share of the FP8 peak relative to the bf16 matmuls' share of theirs
    (``precision`` fp8: casts, scaling and smaller tiles keep FP8 GEMMs further from their peak)."""
    attn_eff: float = 0.0
    """Share of peak the fused attention kernel reaches on its scores and values (flash attention
    does not run at GEMM efficiency, least so causal and at small head sizes); 0: the matmuls'."""
    attn_eff_fused: float = 0.0
    """The same for Megatron's attention (Transformer Engine's fused kernel: cuDNN's on Hopper, which
    NVIDIA's recipes select), fitted after the others on the family's Megatron rows; 0: ``attn_eff``."""
    softmax_passes: float = 6.0
    """Reads and writes of each attention score per forward with eager (unfused) attention."""
    comm_eff: float = 0.75
    """Share of a link's bandwidth a ring collective moves (NCCL's bus bandwidth / link)."""
    latency_s: float = 20e-6
    """Per collective call."""
    dp_overlap: float = 0.5
    """Share of the compute that data-parallel traffic can hide behind (the last micro-batch's
    backward for DDP buckets, each micro-batch for FSDP's prefetch; with ``overlap`` the schedule,
    or under Megatron without a pipeline one micro-batch: its ``no_sync`` holds the others')."""
    tp_overlap: float = 0.6
    """Share of tensor-parallel traffic hidden behind the matmuls when the layout has ``overlap``."""
    step_overhead_s: float = 0.0
    """Per step, whatever the layout (launch, Python)."""
    block_s: float = 0.0
    """Fixed cost of one block's forward and backward per micro-batch beyond its arithmetic:
    eager dispatch of its ops (measured on CPU; on GPUs hidden behind the kernels, 0)."""
    tp_block_s: float = 0.0
    """Fixed cost a tensor-parallel block adds per micro-batch (DTensor dispatch, collective calls)."""
    sp_block_s: float = 0.0
    """The same with sequence parallelism (more redistributions)."""
    cp_block_s: float = 0.0
    """Fixed cost Ulysses adds to a block per micro-batch."""
    fsdp_unit_s: float = 0.0
    """Fixed cost of one FSDP unit per micro-batch (gathers, copies in and out)."""
    reserved_gib: float = BASE_RESERVED_GIB
    """Memory outside every count under FSDP (zero 2 and 3): the runtime's and communicators' own,
    and what the allocator keeps beyond what it hands out -- FSDP gathers and reduce-scatters each
    unit into buffers on streams of their own, which it cannot reuse for anything else. Fitted on
    the FSDP runs that publish their memory (torchtitan's). Other layouts, whose parameters and
    gradients stay in place, keep at most :data:`BASE_RESERVED_GIB`."""
