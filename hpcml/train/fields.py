"""Training a field surrogate on streamed (or file) samples, data-parallel over the grid's dp axis.

The samples come as batches of :class:`hpcml.stream.Sample` (parameters, time, whole
field) from a loader the caller owns; this loop only normalises, steps and reports. DDP
is torch's own (one bucketed all-reduce per step); the loss for the log travels in one
more small all-reduce. Normalisation is fixed up front from the campaign's parameter
bounds, so every rank and every restart uses the same one.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hpcml import log
from hpcml.errors import ConfigError
from hpcml.grid.mpi import ProcessGrid
from hpcml.train.trainer import lr_factor  # the same warmup + cosine as the LLM trainer

logger = log.get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class FieldScales:
    """Affine maps to O(1) inputs and targets: params -> [0, 1] from their bounds, t / t_max,
    (field - offset) / scale."""

    param_lo: tuple[float, ...]
    param_hi: tuple[float, ...]
    t_max: float
    field_offset: float = 0.0
    field_scale: float = 1.0

    def __post_init__(self) -> None:
        if len(self.param_lo) != len(self.param_hi) or any(h <= lo for lo, h in zip(self.param_lo, self.param_hi)):
            raise ConfigError(f"FieldScales needs lo < hi per parameter, got {self.param_lo} and {self.param_hi}")
        if self.t_max <= 0 or self.field_scale <= 0:
            raise ConfigError(f"FieldScales needs t_max > 0 and field_scale > 0, got {self.t_max}, {self.field_scale}")

    def inputs(self, params: np.ndarray, t: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = np.asarray(self.param_lo, np.float32), np.asarray(self.param_hi, np.float32)
        return (torch.from_numpy(((params - lo) / (hi - lo)).astype(np.float32)),
                torch.from_numpy((np.asarray(t, np.float32) / self.t_max)))

    def target(self, fields: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(((fields - self.field_offset) / self.field_scale).astype(np.float32))

    def field(self, y: torch.Tensor) -> np.ndarray:
        return y.detach().cpu().numpy() * self.field_scale + self.field_offset


@dataclass(frozen=True, kw_only=True)
class FieldTrainConfig:
    """Optimisation of the surrogate. ``repr()`` rebuilds it."""

    steps: int = 200
    """Gradient steps at most (training also ends when the stream does)."""
    batch: int = 8
    """Samples per step on each data-parallel rank."""
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 10
    weight_decay: float = 0.0
    seed: int = 0
    log_every: int = 10
    run_dir: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.warmup_steps < 0:
            raise ConfigError(f"lr must be > 0 and warmup_steps >= 0, got {self.lr}, {self.warmup_steps}")


class FieldTrainer:
    """AdamW with warmup + cosine on an (params, t) -> field model, DDP over the grid's dp axis,
    on the device the grid bound this rank to (a GPU with NCCL/RCCL/XCCL, else the CPU)."""

    def __init__(self, model: nn.Module, grid: ProcessGrid, config: FieldTrainConfig, scales: FieldScales) -> None:
        if grid.layout.world_size != grid.layout.dp:
            raise ConfigError(f"field surrogates train data-parallel only: layout {grid.layout.degrees} has other axes")
        self.grid, self.config, self.scales = grid, config, scales
        torch.manual_seed(config.seed)  # the same initial weights on every rank (DDP also broadcasts them)
        self.device = grid.torch.device if grid.torch is not None else torch.device("cpu")
        self.module = model.to(self.device)
        self.model = self.module
        if grid.layout.dp > 1:
            ids = [self.device] if self.device.type != "cpu" else None
            self.model = nn.parallel.DistributedDataParallel(self.module, device_ids=ids,
                                                             process_group=grid.torch.mesh["dp"].get_group())
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, config))
        self.step = 0
        self.history: list[dict] = []
        self._metrics = None
        if config.run_dir and grid.rank == 0:
            Path(config.run_dir).mkdir(parents=True, exist_ok=True)
            self._metrics = open(Path(config.run_dir) / "metrics.jsonl", "a")

    def _tensors(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        params = np.stack([s.params for s in batch])
        t = np.array([s.t for s in batch], np.float32)
        p, tt = self.scales.inputs(params, t)
        y = self.scales.target(np.stack([s.fields[0] for s in batch]))
        return p.to(self.device), tt.to(self.device), y.to(self.device)

    def train_step(self, batch, extra: dict | None = None) -> dict:
        t0 = time.perf_counter()
        self.model.train()
        p, t, y = self._tensors(batch)
        loss = nn.functional.mse_loss(self.model(p, t), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        mean = loss.detach().reshape(1).clone()
        if self.grid.layout.dp > 1:
            dist.all_reduce(mean, group=self.grid.torch.mesh["dp"].get_group())
            mean /= self.grid.layout.dp
        self.step += 1
        m = {"step": self.step, "loss": float(mean), "lr": lr, "step_s": time.perf_counter() - t0,
             "samples_per_s": len(batch) * self.grid.layout.dp / (time.perf_counter() - t0), **(extra or {})}
        self.history.append(m)
        self._report(m)
        return m

    def _report(self, m: dict) -> None:
        if self.grid.rank != 0:
            return
        if self._metrics:
            self._metrics.write(json.dumps(m) + "\n")
            self._metrics.flush()
        if self.config.progress and (m["step"] % self.config.log_every == 0 or m["step"] == self.config.steps):
            print(f"[train] step {m['step']}/{self.config.steps} loss {m['loss']:.4e} lr {m['lr']:.2e} "
                  f"{m['samples_per_s']:.0f} samples/s" + (f" buffer {m['buffer_len']}" if "buffer_len" in m else ""),
                  flush=True)

    @torch.no_grad()
    def predict(self, params: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Fields [B, nx, ny] in physical units for parameter rows and times."""
        self.module.eval()
        p, tt = self.scales.inputs(np.asarray(params, np.float32), np.asarray(t, np.float32))
        return self.scales.field(self.module(p.to(self.device), tt.to(self.device)))

    def rel_l2(self, params: np.ndarray, t: np.ndarray, fields: np.ndarray) -> float:
        """||prediction - truth|| / ||truth|| over the whole set (per-sample ratios would be
        dominated by early times, whose fields are near zero)."""
        pred = self.predict(params, t)
        return float(np.linalg.norm(pred - fields) / max(float(np.linalg.norm(fields)), 1e-12))

    # -- checkpoint content ------------------------------------------------------------
    def tensors(self, create: bool = False) -> dict[str, torch.Tensor]:
        from hpcml import ckpt

        return ckpt.training_tensors(self.module.named_parameters(), self.optimizer, create=create)

    def extra(self) -> dict:
        return {"step": self.step, "scheduler": self.scheduler.state_dict(), "train_config": asdict(self.config),
                "scales": asdict(self.scales)}

    def restore(self, extra: dict) -> None:
        self.step = int(extra["step"])
        self.scheduler.load_state_dict(extra["scheduler"])

    def close(self) -> None:
        if self._metrics:
            self._metrics.close()
            self._metrics = None
