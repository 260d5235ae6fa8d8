"""How to parallelise a model on the grid: the choices for each axis, and the layer-split rule."""

from __future__ import annotations

from dataclasses import dataclass

from hpcml.errors import ConfigError
from hpcml.numeric import is_int

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")
#: The data-parallel gradient reduction's dtypes (the planner prices the same names).
REDUCE_DTYPES = ("fp32", "bf16")
#: When FSDP reduce-scatters gradients under accumulation (the planner prices the same names).
GRAD_SYNCS = ("microbatch", "step")
#: FPDT's chunked attention kernel takes no document mask (refused where a run asks for both).
NO_DOC_MASK = ("document masking under FPDT is not built (its chunked kernel takes no mask): drop --fpdt-chunk "
               "(Ulysses and all-gather cp take the mask), or --doc-mask")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Choices for each axis; the degrees themselves come from the grid's layout."""

    fsdp: bool = False
    """dp: shard parameters, gradients and optimizer state with FSDP2 (ZeRO-3-like); False: replicate and
    all-reduce gradients (DDP)."""
    reshard_after_forward: bool = True
    """FSDP only: False keeps parameters gathered from forward to backward (ZeRO-2-like: more memory,
    fewer all-gathers)."""
    dp_replicate: int | str = 1
    """FSDP only: HSDP (hybrid sharding) -- the data ranks in this many replicas, each sharding the
    parameters over its own ranks (the shard groups consecutive: inside a node when the node map
    allows), gradients all-reduced across the replicas. ``"node"``: a replica per node of the
    data group. 1: plain FSDP over every data rank."""
    hpz: bool = False
    """FSDP only (ZeRO++'s hpZ): after forward, keep the parameters sharded over the data ranks of
    this rank's node instead of all of them, so backward's all-gathers stay inside the node (at the
    memory of a node's shard of every block until its backward)."""
    qwz: bool = False
    """FSDP only (ZeRO++'s qwZ): all-gather weights in int8, ``quant_block`` values a scale
    (:mod:`hpcml.parallel.zeropp`); compute sees them rounded, the optimizer's stay exact."""
    qgz: bool = False
    """FSDP only (ZeRO++'s qgZ): reduce-scatter gradients inside the node in full precision, then
    across nodes in int8 (data ranks in equal consecutive blocks per node; not with dp_replicate)."""
    quant_block: int = 256
    """qwZ / qgZ: values per quantization block (each with its fp32 scale: 4 / block bytes a value)."""
    sequence_parallel: bool = False
    """tp: shard norms and residuals along the sequence between tensor-parallel regions (Megatron-SP)."""
    pp_schedule: str = "1f1b"
    """gpipe, 1f1b or interleaved1f1b."""
    stages_per_rank: int | None = None
    """Pipeline stages on each pp rank; None: 2 for interleaved1f1b, else 1."""
    layers_per_stage: tuple[int, ...] | None = None
    """Explicit split of the layers over all stages; None: the balanced rule of :func:`split_layers`."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward."""
    cp_kind: str = "ulysses"
    """cp: ulysses (an all-to-all trades sequence for heads: heads divisible by cp) or allgather
    (keys and values all-gathered, the causal mask offset: any number of kv heads; Llama 3's)."""
    fpdt_chunk: int = 0
    """cp: FPDT (docs/parallel.md): each rank's sequence in strided chunks of this many positions,
    attention, MLP and logits + loss chunk by chunk, so activation memory follows the chunk, not
    the sequence; 0: plain Ulysses. Works on cp 1 too (chunking alone)."""
    loss_chunk: int = 0
    """The output layer and the loss this many positions at a time, each chunk's gradients taken in
    its forward (a fused linear cross-entropy: the vocabulary-sized fp32 logits and their gradient
    are never whole, one chunk's at a time); 0: whole. Without a pipeline and sequence parallelism;
    FPDT chunks its loss by ``fpdt_chunk`` already."""
    reduce_dtype: str = "fp32"
    """dp: the dtype gradients cross the wire in. bf16 halves the reduction's bytes (FSDP2's
    ``MixedPrecisionPolicy(reduce_dtype=bfloat16)``, DDP's flat all-reduce cast): each rank's
    gradient rounded to bf16 and summed in bf16, the result back in the parameters' dtype."""

    grad_sync: str | None = None
    """FSDP: when gradients are reduce-scattered under gradient accumulation. microbatch: after each
    micro-batch's backward (FSDP2's and torchtitan's way: a rank holds its gradients sharded, at the
    cost of a reduce-scatter a micro-batch); step: once, after the last (fewer collectives, but every
    rank holds the whole of its unsharded fp32 gradients meanwhile: 4 bytes a parameter). None:
    microbatch, or under a pipeline its schedule's rule (``torch.distributed.pipelining`` reduces
    after the last backward only)."""
    param_dtype: str = "fp32"
    """FSDP: the dtype its all-gather hands the compute (FSDP2's ``MixedPrecisionPolicy(param_dtype=)``;
    the shards, the optimizer and the checkpoints stay fp32). bf16 gathers half the bytes and computes
    in bf16 without autocast's cached bf16 copy of every weight (torchtitan's way); the LLM trainer
    sets it when it trains in bf16 under FSDP."""

    def __post_init__(self) -> None:
        if self.param_dtype not in REDUCE_DTYPES:
            raise ConfigError(f"param_dtype {self.param_dtype!r}: expected one of {', '.join(REDUCE_DTYPES)}")
        if self.param_dtype != "fp32" and not self.fsdp:
            raise ConfigError(f"param_dtype {self.param_dtype!r} without fsdp: it is FSDP's gather dtype (set "
                              f"fsdp=True, or train in bf16 by autocast alone)")
        if self.grad_sync is not None and self.grad_sync not in GRAD_SYNCS:
            raise ConfigError(f"grad_sync {self.grad_sync!r}: expected one of {', '.join(GRAD_SYNCS)}")
        if self.grad_sync is not None and not self.fsdp:
            raise ConfigError(f"grad_sync {self.grad_sync!r} without fsdp: it is when FSDP reduce-scatters; DDP "
                              f"all-reduces once a step, after the last micro-batch (set fsdp=True, or drop it)")
        if self.dp_replicate != "node" and (not is_int(self.dp_replicate) or self.dp_replicate < 1):
            raise ConfigError(f"dp_replicate {self.dp_replicate!r}: expected a whole number >= 1 of replicas, or "
                              f"'node' (one per node)")
        if (self.dp_replicate != 1 or self.hpz) and not self.fsdp:
            raise ConfigError(f"dp_replicate {self.dp_replicate!r}, hpz {self.hpz}: hybrid sharding and hpZ shard "
                              f"parameters; set fsdp=True (llm_pretrain.py --fsdp): without FSDP the data ranks "
                              f"already replicate")
        if (self.qwz or self.qgz) and not self.fsdp:
            raise ConfigError(f"qwz {self.qwz}, qgz {self.qgz}: quantized all-gathers and reduce-scatters are "
                              f"FSDP's; set fsdp=True (llm_pretrain.py --fsdp)")
        if self.qgz and self.dp_replicate != 1:
            raise ConfigError(f"qgz with dp_replicate {self.dp_replicate!r}: hybrid sharding reduce-scatters inside "
                              f"the node and all-reduces across replicas in full precision; use qgz with FSDP over "
                              f"every data rank (with hpz), or HSDP without it")
        if not is_int(self.quant_block) or self.quant_block < 1:
            raise ConfigError(f"quant_block {self.quant_block!r}: expected a whole number >= 1 of values a scale")
        if self.hpz and not self.reshard_after_forward:
            raise ConfigError("hpz with reshard_after_forward=False: hpZ reshards after forward to the node's "
                              "ranks, ZeRO-2 does not reshard at all; use one of them")
        if self.hpz and self.dp_replicate != 1:
            raise ConfigError(f"hpz with dp_replicate {self.dp_replicate!r}: hybrid sharding already keeps its "
                              f"shards inside the node; hpZ is for FSDP over every data rank")
        if not is_int(self.fpdt_chunk) or self.fpdt_chunk < 0:
            raise ConfigError(f"fpdt_chunk {self.fpdt_chunk!r}: expected a whole number of positions >= 0 (0: off)")
        if not is_int(self.loss_chunk) or self.loss_chunk < 0:
            raise ConfigError(f"loss_chunk {self.loss_chunk!r}: expected a whole number of positions >= 0 (0: off)")
        if self.loss_chunk and (self.fpdt_chunk or self.sequence_parallel):
            raise ConfigError(f"loss_chunk {self.loss_chunk} with fpdt_chunk {self.fpdt_chunk}, sequence_parallel "
                              f"{self.sequence_parallel}: FPDT chunks its loss by fpdt_chunk already, and sequence "
                              f"parallelism splits the positions the chunks would take; drop one")
        if self.cp_kind not in ("ulysses", "allgather"):
            raise ConfigError(f"cp_kind {self.cp_kind!r}: expected ulysses or allgather")
        if self.fpdt_chunk and self.cp_kind != "ulysses":
            raise ConfigError(f"fpdt_chunk {self.fpdt_chunk} with cp_kind {self.cp_kind}: FPDT's chunks go through "
                              f"Ulysses' all-to-alls; use cp_kind ulysses")
        if self.fpdt_chunk and self.sequence_parallel:
            raise ConfigError(f"fpdt_chunk {self.fpdt_chunk} with sequence_parallel: FPDT chunks the sequence "
                              f"itself; use one of them")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ConfigError(f"reduce_dtype {self.reduce_dtype!r}: expected one of {', '.join(REDUCE_DTYPES)}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"pp_schedule {self.pp_schedule!r} unknown: expected one of {', '.join(PP_SCHEDULES)}")
        if self.stages_per_rank is not None and self.stages_per_rank < 1:
            raise ConfigError(f"stages_per_rank must be >= 1, got {self.stages_per_rank}")
        if self.pp_schedule == "interleaved1f1b" and self.stages_per_rank == 1:
            raise ConfigError("interleaved1f1b needs stages_per_rank >= 2, got 1")
        if self.pp_schedule != "interleaved1f1b" and (self.stages_per_rank or 1) != 1:
            raise ConfigError(f"{self.pp_schedule} runs one stage per rank, got stages_per_rank {self.stages_per_rank}")

    @property
    def n_stages_per_rank(self) -> int:
        return self.stages_per_rank or (2 if self.pp_schedule == "interleaved1f1b" else 1)


def pipeline_refuses(config: ParallelConfig, pp: int) -> str | None:
    """Why ``config`` cannot run under a pipeline of ``pp`` ranks, or None: the schedule reduces
    gradients after its last backward and computes the loss itself."""
    if pp > 1 and config.grad_sync == "microbatch":
        return (f"grad_sync microbatch with pp {pp}: torch.distributed.pipelining reduce-scatters after a step's "
                f"last backward only; drop grad_sync (or set it to step)")
    if pp > 1 and config.loss_chunk:
        return (f"loss_chunk {config.loss_chunk} with pp {pp}: the pipeline's schedule computes the loss itself; "
                f"the chunked loss runs without a pipeline")
    return None


def split_layers(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage: as even as possible; the remainder goes to the stages nearest the
    middle, and the first and last stages (which also hold the embedding and the output
    layer) get an extra layer only when every middle stage has one.
    """
    if n_layers < n_stages:
        raise ConfigError(f"n_layers {n_layers} < pipeline stages {n_stages}: every stage needs at least one layer")
    base, rem = divmod(n_layers, n_stages)
    centre = (n_stages - 1) / 2
    order = sorted(range(n_stages), key=lambda s: (s in (0, n_stages - 1) and n_stages > 2, abs(s - centre), s))
    counts = [base] * n_stages
    for s in order[:rem]:
        counts[s] += 1
    return counts
