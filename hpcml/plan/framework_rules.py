"""A layout's rules that read its degrees (checked again for each candidate of a search) and what
a framework other than hpcml cannot run, each a one-line reason."""

from __future__ import annotations

from hpcml.errors import ConfigError


def deepspeed_refuses(pp: int, zero: int, schedule: str, overlap: bool) -> str | None:
    """Why Megatron-DeepSpeed cannot run these settings, or None: its pipeline engine runs one
    schedule (1F1B) and ZeRO 0-1 only (``ZeRO-2 and ZeRO-3 are incompatible with pipeline
    parallelism``); its BF16_Optimizer reduces gradients after the last micro-batch, with nothing
    to overlap."""
    if pp > 1 and zero >= 2:
        return (f"framework deepspeed with pp {pp} and zero {zero}: DeepSpeed's pipeline engine runs ZeRO 0 or 1 "
                f"only (ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism) -- use zero 1, or pp 1")
    if pp > 1 and schedule != "1f1b":
        return (f"framework deepspeed with schedule {schedule}: DeepSpeed's pipeline engine runs 1F1B only "
                f"(its TrainSchedule) -- use schedule 1f1b")
    if overlap and zero < 2:
        return (f"framework deepspeed with overlap at zero {zero}: DeepSpeed's BF16_Optimizer all-reduces the "
                f"gradients after the last micro-batch, with nothing to overlap -- drop overlap")
    return None


def check_degrees(lay) -> None:
    """The rules a layout's degrees, batch and sequence split must meet (:class:`PlanLayout`'s, and
    :meth:`PlanLayout.with_degrees`' alone), each a one-line ConfigError naming the values."""
    model_ranks = lay.tp * lay.cp * lay.pp
    if lay.gpus % model_ranks:
        raise ConfigError(f"gpus {lay.gpus} is not divisible by tp {lay.tp} x cp {lay.cp} x pp {lay.pp} = "
                          f"{model_ranks}")
    if (lay.cp * lay.dp) % lay.ep:
        raise ConfigError(f"ep {lay.ep} does not divide cp {lay.cp} x dp {lay.dp} = {lay.cp * lay.dp} "
                          f"(experts fold over the data ranks)")
    if lay.global_batch % (lay.dp * lay.micro_batch):
        raise ConfigError(f"global_batch {lay.global_batch} is not divisible by dp {lay.dp} x micro_batch "
                          f"{lay.micro_batch} = {lay.dp * lay.micro_batch}")
    if lay.seq_len % lay.cp or (lay.sequence_parallel and lay.seq_len % (lay.cp * lay.tp)):
        raise ConfigError(f"seq_len {lay.seq_len} is not divisible by cp {lay.cp}"
                          + (f" x tp {lay.tp} (sequence parallel)" if lay.sequence_parallel else ""))
    if lay.dp % lay.dp_replicate:
        raise ConfigError(f"dp_replicate {lay.dp_replicate} does not divide dp {lay.dp}")
    if lay.sequence_parallel and lay.cp > 1 and lay.framework == "hpcml":
        raise ConfigError(f"sequence_parallel with cp {lay.cp} > 1 is not supported by hpcml's trainer: use cp "
                          f"alone (framework megatron, torchtitan or deepspeed prices both)")
    if lay.fpdt_chunk and (lay.sequence_parallel or lay.seq_len % (lay.cp * lay.fpdt_chunk)):
        raise ConfigError(f"fpdt_chunk {lay.fpdt_chunk}: seq_len {lay.seq_len} must be a multiple of cp "
                          f"{lay.cp} x fpdt_chunk, without sequence_parallel")
    if lay.loss_chunk and lay.seq_len % (lay.cp * lay.loss_chunk):
        raise ConfigError(f"loss_chunk {lay.loss_chunk}: seq_len {lay.seq_len} must be a multiple of cp {lay.cp} x "
                          f"loss_chunk (the loss runs over whole chunks of each rank's positions)")
    if lay.grad_sync is not None:
        _check_grad_sync(lay)
    if lay.pp > 1 and lay.framework == "hpcml" and lay.microbatches < lay.pp:
        raise ConfigError(f"{lay.microbatches} micro-batches per step < pp {lay.pp}: hpcml's pipeline would "
                          f"idle (raise global_batch or lower micro_batch)")
    if lay.schedule == "interleaved1f1b":
        if lay.stages_per_rank is not None and lay.stages_per_rank < 2:
            raise ConfigError(f"interleaved1f1b needs stages_per_rank >= 2, got {lay.stages_per_rank}")
        rounds = max(1, lay.microbatches // lay.pp)
        if lay.microbatches % rounds:
            raise ConfigError(f"interleaved1f1b needs micro-batches ({lay.microbatches}) divisible by its rounds "
                              f"({rounds} = micro-batches // pp {lay.pp}, torch's rule)")
    elif lay.stages_per_rank not in (None, 1):
        raise ConfigError(f"{lay.schedule} runs one stage per rank, got stages_per_rank {lay.stages_per_rank}")

def _check_grad_sync(lay) -> None:
    """A sync named where it means something: FSDP (zero 2-3); once a step under a pipeline
    (every framework's); once a step without one hpcml's trainer alone."""
    if lay.zero < 2:
        raise ConfigError(f"grad_sync {lay.grad_sync} with zero {lay.zero}: it is when FSDP (zero 2 or 3) "
                          f"reduce-scatters gradients")
    if lay.grad_sync == "microbatch" and lay.pp > 1:
        raise ConfigError(f"grad_sync microbatch with pp {lay.pp}: a pipeline reduces once a step, after its "
                          f"last backward (torch.distributed.pipelining, Megatron)")
    if lay.grad_sync == "step" and lay.pp == 1 and lay.framework != "hpcml":
        raise ConfigError(f"grad_sync step with framework {lay.framework}: without a pipeline only hpcml's "
                          f"trainer can be told to reduce once a step ({lay.framework} reduces each micro-batch's)")
