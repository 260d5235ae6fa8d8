"""The trainers' configs and the checks on them, with no torch: a mistake in a run's
configuration is refused on every rank in a fraction of a second, before each rank spends
seconds importing torch (minutes, on thousands of ranks reading a shared file system)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpcml.errors import ConfigError
from hpcml.grid.layout import Layout
from hpcml.numeric import is_int, is_real
from hpcml.parallel.config import NO_DOC_MASK


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    """Optimisation and bookkeeping every trainer has. ``repr()`` rebuilds it."""

    steps: int = 20
    """Optimizer steps in total (a resume with another value stretches the schedule: :mod:`hpcml.train.schedule`)."""
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    """Cosine decays to lr * min_lr_ratio at the last step."""
    warmup_steps: int = 2
    weight_decay: float = 0.1
    """AdamW decay of matrices (parameters of >= 2 dims; norms and biases are not decayed)."""
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    seed: int = 0
    bf16: bool = False
    """Autocast matmuls to bfloat16 (parameters and optimizer state stay fp32)."""
    log_every: int = 1
    run_dir: str | None = None
    """Where ``metrics.jsonl`` and ``config.json`` go (rank 0)."""
    progress: bool = True
    memory_account: bool = False
    """Count the bytes saved for backward per layer (:mod:`hpcml.train.memory`) into each step's
    metrics: ``saved_mib``, ``saved_mib_per_layer`` (rank 0's; costs a hook per saved tensor)."""

    def __post_init__(self) -> None:
        for name in ("steps", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        for name in ("lr", "min_lr_ratio", "grad_clip"):
            v = getattr(self, name)
            if not is_real(v) or v != v:
                raise ConfigError(f"{name}={v!r}: expected a number (grad_clip 0: no clipping)")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1 or self.grad_clip < 0:
            raise ConfigError(f"lr must be > 0, min_lr_ratio in [0, 1], grad_clip >= 0; got {self.lr}, "
                              f"{self.min_lr_ratio}, {self.grad_clip}")


def check_source(source: Any, seq_len: int, vocab_size: int, what: str = "data",
                 eod: int | None = None) -> None:
    """ConfigError (no collective: the same on every rank) for a token source of other
    sequences than the training's, with ids past the model's embedding, or -- under document
    masking by ``eod`` -- whose documents end with another token."""
    if getattr(source, "seq_len", seq_len) != seq_len:
        raise ConfigError(f"the {what}'s sequences are {source.seq_len} tokens, the training's seq_len {seq_len}: "
                          f"open the {what} with seq_len={seq_len}")
    if hasattr(source, "check_vocab"):
        source.check_vocab(vocab_size)
    eods = getattr(source, "eods", None)
    if eod is not None and eods is not None and eods != {eod}:
        raise ConfigError(f"document masking by end-of-document token {eod}, but the {what}'s documents end with "
                          f"{sorted(eods)}: mask by the data's token (files of one tokenizer)")


@dataclass(frozen=True, kw_only=True)
class TrainConfig(LoopConfig):
    """:class:`LoopConfig` plus the token batch. Batch sizes are in sequences."""

    global_batch: int = 8
    """Sequences per optimizer step over all data-parallel ranks."""
    micro_batch: int = 1
    """Sequences per forward/backward on one rank (per pipeline micro-batch under pp)."""
    seq_len: int = 32
    peak_flops: float | None = None
    """Peak FLOP/s of one device for MFU (from the site's hardware facts); None: MFU is 'n/a'."""
    doc_mask_eod: int | None = None
    """Document masking: attention stays within the packed documents, each ended by this token id
    (the data's ``eod``); None: every position attends to the whole sequence before it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("global_batch", "micro_batch", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        eod = self.doc_mask_eod
        if eod is not None and (not is_int(eod) or eod < 0):
            raise ConfigError(f"doc_mask_eod {eod!r}: expected a token id (an int >= 0) or None")

    def check_layout(self, layout: Layout, max_seq_len: int, fpdt_chunk: int = 0, loss_chunk: int = 0) -> None:
        """Raise unless the batch and sequence split evenly over ``layout`` (and FPDT's, or the
        loss's, chunks of ``fpdt_chunk`` / ``loss_chunk`` positions per rank), with no collective."""
        per = layout.dp * self.micro_batch
        if self.global_batch % per:
            raise ConfigError(f"global batch {self.global_batch} is not divisible by dp {layout.dp} x micro-batch "
                              f"{self.micro_batch} = {per}")
        if self.seq_len % layout.cp:
            raise ConfigError(f"seq_len {self.seq_len} is not divisible by cp {layout.cp}")
        if fpdt_chunk and self.seq_len % (layout.cp * fpdt_chunk):
            raise ConfigError(f"seq_len {self.seq_len} is not divisible by cp {layout.cp} x fpdt_chunk {fpdt_chunk} = "
                              f"{layout.cp * fpdt_chunk} (each rank holds whole chunks)")
        if loss_chunk and self.seq_len % (layout.cp * loss_chunk):
            raise ConfigError(f"seq_len {self.seq_len} is not divisible by cp {layout.cp} x loss_chunk {loss_chunk} = "
                              f"{layout.cp * loss_chunk} (the loss runs over whole chunks of each rank's positions)")
        if fpdt_chunk and self.doc_mask_eod is not None:
            raise ConfigError(NO_DOC_MASK)
        if self.seq_len > max_seq_len:
            raise ConfigError(f"seq_len {self.seq_len} exceeds the model's max_seq_len {max_seq_len}")
        n_micro = self.global_batch // per
        if layout.pp > 1 and n_micro < layout.pp:
            raise ConfigError(f"{n_micro} micro-batches per step < pp {layout.pp}: the pipeline would idle "
                              f"(raise global batch or lower micro-batch)")

    def micro_batches(self, layout: Layout) -> int:
        return self.global_batch // (layout.dp * self.micro_batch)
