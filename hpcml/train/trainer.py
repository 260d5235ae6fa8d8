"""The training loop on a parallelised model: micro-batches, AdamW, warmup + cosine,
global-norm clipping, metrics (loss, tokens/s, model FLOP/s, MFU, memory), run directory.

Per step it costs one all-reduce beyond what the parallel engines do themselves: the
squared gradient norm, the loss and a stop request travel together in one 3-element tensor.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hpcml import log
from hpcml import stop as stop_flag
from hpcml.errors import ConfigError
from hpcml.grid.layout import Layout
from hpcml.parallel.api import ParallelModel

logger = log.get_logger(__name__)


class TokenSource(Protocol):
    def global_batch(self, step: int, n: int) -> torch.Tensor: ...


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation and bookkeeping. Batch sizes are in sequences."""

    steps: int = 20
    global_batch: int = 8
    """Sequences per optimizer step over all data-parallel ranks."""
    micro_batch: int = 1
    """Sequences per forward/backward on one rank (per pipeline micro-batch under pp)."""
    seq_len: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    """Cosine decays to lr * min_lr_ratio at the last step."""
    warmup_steps: int = 2
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    seed: int = 0
    bf16: bool = False
    """Autocast matmuls to bfloat16 (parameters and optimizer state stay fp32)."""
    log_every: int = 1
    peak_flops: float | None = None
    """Peak FLOP/s of one device for MFU (from the site's hardware facts); None: MFU is 'n/a'."""
    run_dir: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "micro_batch", "seq_len", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {self.warmup_steps}")

    def check_layout(self, layout: Layout, max_seq_len: int) -> None:
        """Raise unless the batch and sequence split evenly over ``layout`` (no collective)."""
        per = layout.dp * self.micro_batch
        if self.global_batch % per:
            raise ConfigError(f"global batch {self.global_batch} is not divisible by dp {layout.dp} x micro-batch "
                              f"{self.micro_batch} = {per}")
        if self.seq_len % layout.cp:
            raise ConfigError(f"seq_len {self.seq_len} is not divisible by cp {layout.cp}")
        if self.seq_len > max_seq_len:
            raise ConfigError(f"seq_len {self.seq_len} exceeds the model's max_seq_len {max_seq_len}")
        n_micro = self.global_batch // per
        if layout.pp > 1 and n_micro < layout.pp:
            raise ConfigError(f"{n_micro} micro-batches per step < pp {layout.pp}: the pipeline would idle "
                              f"(raise global batch or lower micro-batch)")

    def micro_batches(self, layout: Layout) -> int:
        return self.global_batch // (layout.dp * self.micro_batch)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over ``warmup_steps``, then cosine to ``min_lr_ratio`` at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(params, cfg: TrainConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW without decay on 1-D parameters (norms), and the warmup + cosine schedule."""
    params = list(params)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=True)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


@dataclass(kw_only=True)
class Trainer:
    """Runs :class:`TrainConfig` on a :class:`ParallelModel` with a token source.

    ``hooks`` are called as ``hook(trainer, metrics)`` after every step: the place where
    checkpointing and streamed data attach.
    """

    model: ParallelModel
    config: TrainConfig
    data: TokenSource
    flops_per_token: float | None = None
    hooks: list[Callable[[Trainer, dict], None]] = field(default_factory=list)
    step: int = 0
    stop_requested: bool = False
    """Set on any rank to save and stop after the current step on all (a signal does this
    through :mod:`hpcml.stop`)."""

    def __post_init__(self) -> None:
        grid = self.model.grid
        self.grid = grid
        self.config.check_layout(grid.layout, self.model.parts[0].config.max_seq_len)
        self.optimizer, self.scheduler = make_optimizer(self.model.parameters(), self.config)
        self.history: list[dict] = []
        self._metrics_file = None
        if self.config.run_dir and grid.rank == 0:
            Path(self.config.run_dir).mkdir(parents=True, exist_ok=True)
            self._metrics_file = open(Path(self.config.run_dir) / "metrics.jsonl", "a")
            (Path(self.config.run_dir) / "config.json").write_text(json.dumps(
                {"train": asdict(self.config), "layout": grid.layout.degrees,
                 "parallel": asdict(self.model.config)}, indent=1, default=str))
        # dp ranks draw different randomness (e.g. dropout); tp / cp / pp ranks of one replica agree
        torch.manual_seed(self.config.seed + 1 + grid.coords["dp"])

    def local_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets): its dp slice of the global batch, its cp slice of the sequence."""
        lay, c = self.grid.layout, self.grid.coords
        tokens = self.data.global_batch(step, self.config.global_batch)
        per_dp = self.config.global_batch // lay.dp
        tokens = tokens[c["dp"] * per_dp:(c["dp"] + 1) * per_dp]
        x, y = tokens[:, :-1], tokens[:, 1:]
        chunk = self.config.seq_len // lay.cp
        sl = slice(c["cp"] * chunk, (c["cp"] + 1) * chunk)
        device = self.grid.torch.device
        return x[:, sl].contiguous().to(device), y[:, sl].contiguous().to(device)

    def train_step(self) -> dict[str, Any]:
        cfg, lay, device = self.config, self.grid.layout, self.grid.torch.device
        t0 = time.perf_counter()
        self.model.train()
        x, y = self.local_batch(self.step)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16) if cfg.bf16 else contextlib.nullcontext()
        loss = self.model.forward_backward(x, y, cfg.micro_batches(lay), autocast)
        self.model.sync_grads()
        share = torch.zeros(3, dtype=torch.float64)
        share[0] = self.model.local_sq_grad_norm()
        if loss is not None:  # last pipeline stage: every (dp, cp, tp) rank holds one share of the mean
            share[1] = loss / (lay.dp * lay.cp * lay.tp)
        share[2] = float(self.stop_requested or stop_flag.requested() is not None)  # reaches all ranks in one collective
        share = share.to(device)
        dist.all_reduce(share)
        sq_norm, global_loss, stop = share.tolist()
        grad_norm = math.sqrt(sq_norm)
        if cfg.grad_clip > 0:
            from hpcml.parallel.clip import scale_grads

            scale_grads(self.model.parameters(), grad_norm, cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        tokens = cfg.global_batch * cfg.seq_len
        metrics: dict[str, Any] = {"step": self.step + 1, "loss": global_loss, "grad_norm": grad_norm, "lr": lr,
                                   "step_s": dt, "tokens_per_s": tokens / dt, "stop": stop > 0,
                                   "time": time.time()}
        if self.flops_per_token:
            per_device = self.flops_per_token * tokens / dt / lay.world_size
            metrics["model_tflops_per_device"] = per_device / 1e12
            metrics["mfu"] = per_device / cfg.peak_flops if cfg.peak_flops else "n/a"
        metrics["peak_mem_mb"] = peak_memory_mb(device)
        self.step += 1
        return metrics

    def fit(self, steps: int | None = None) -> list[dict]:
        """Train until ``steps`` (default ``config.steps``) optimizer steps are done in total."""
        end = steps if steps is not None else self.config.steps
        while self.step < end:
            metrics = self.train_step()
            self.history.append(metrics)
            self._report(metrics, end)
            for hook in self.hooks:
                hook(self, metrics)
            if metrics["stop"]:
                logger.warning("stopping after step %d as asked (signal)", self.step)
                break
        if self._metrics_file:
            self._metrics_file.flush()
        return self.history

    def _report(self, m: dict, end: int) -> None:
        if self.grid.rank != 0:
            return
        if self._metrics_file:
            self._metrics_file.write(json.dumps(m) + "\n")
            self._metrics_file.flush()
        if self.config.progress and (m["step"] % self.config.log_every == 0 or m["step"] == end):
            width = 24
            done = int(width * m["step"] / end)
            mfu = m.get("mfu", "n/a")
            mfu = f"{mfu:.1%}" if isinstance(mfu, float) else mfu
            line = (f"[{'#' * done}{'.' * (width - done)}] step {m['step']}/{end} loss {m['loss']:.4f} "
                    f"gnorm {m['grad_norm']:.3f} lr {m['lr']:.2e} {m['tokens_per_s']:.0f} tok/s MFU {mfu} "
                    f"mem {m['peak_mem_mb']:.0f} MB")
            end_char = "\r" if sys.stderr.isatty() and m["step"] != end else "\n"
            print(line, end=end_char, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._metrics_file:
            self._metrics_file.close()
            self._metrics_file = None


__all__ = ["TrainConfig", "Trainer", "lr_factor", "make_optimizer"]
