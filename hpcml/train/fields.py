"""Training a field surrogate on streamed (or file) samples: the shared loop
(:mod:`hpcml.train.loop`) on batches of :class:`hpcml.stream.Sample` (parameters, time,
whole field), data-parallel over the grid's dp axis -- replicated with one gradient
all-reduce, or sharded with FSDP2 (``ParallelConfig(fsdp=True)``) for large surrogates.

Normalisation is fixed up front from the campaign's parameter bounds, so every rank and
every restart uses the same one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from hpcml import log
from hpcml.errors import ConfigError
from hpcml.grid.mpi import ProcessGrid
from hpcml.parallel import ParallelConfig, parallelize
from hpcml.train.loop import LoopConfig, TrainLoop

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
class FieldTrainConfig(LoopConfig):
    """:class:`LoopConfig` for a surrogate (its own defaults) plus the per-rank batch."""

    steps: int = 200
    """Gradient steps at most (training also ends when the stream does)."""
    batch: int = 8
    """Samples per step on each data-parallel rank."""
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 10
    weight_decay: float = 0.0
    beta2: float = 0.999
    grad_clip: float = 0.0
    log_every: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.batch < 1:
            raise ConfigError(f"batch must be >= 1, got {self.batch}")


class FieldTrainer(TrainLoop):
    """An (params, t) -> field model trained with MSE on normalised samples, over the grid's
    dp axis, on the device the grid bound this rank to (a GPU with NCCL/RCCL/XCCL, else the CPU).
    The weights start as dp rank 0's on every rank."""

    def __init__(self, model: nn.Module, grid: ProcessGrid, config: FieldTrainConfig, scales: FieldScales,
                 parallel: ParallelConfig | None = None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
        if grid.torch is None:
            grid.init_torch()
        self.scales = scales
        self.module = model
        self.loss_fn = loss_fn or nn.functional.mse_loss
        super().__init__(parallelize(model, grid, parallel, loss_fn=self.loss_fn), config)

    def inputs(self, batch) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        params = np.stack([s.params for s in batch])
        t = np.array([s.t for s in batch], np.float32)
        p, tt = self.scales.inputs(params, t)
        y = self.scales.target(np.stack([s.fields[0] for s in batch]))
        return (p.to(self.device), tt.to(self.device)), y.to(self.device)

    @torch.no_grad()
    def check_batch(self, batch) -> str | None:
        """The model's output for one sample against that sample's field (collective under FSDP)."""
        self.module.eval()
        try:
            x, y = self.inputs(batch[:1])
            out = self.module(*x)
        except Exception as e:  # noqa: BLE001 -- e.g. a Linear of the wrong width, scales of other parameters
            return (f"the model cannot take simulation {batch[0].sim}'s sample ({type(e).__name__}: "
                    f"{' '.join(str(e).split())[:300]})")
        finally:
            self.module.train()
        got, want = tuple(out.shape[1:]), tuple(y.shape[1:])
        if got != want:
            return (f"the model's output per sample is {list(got)}, but simulation {batch[0].sim}'s field is "
                    f"{list(want)}: the model must output the simulation's grid (e.g. MLPSurrogateConfig(shape="
                    f"{want}))")
        return None

    per_sample_losses = True

    @torch.no_grad()
    def sample_losses(self, batch) -> list[float]:
        """The training loss of each sample of ``batch`` on its own, without gradients (one
        forward; collective under FSDP): what :mod:`hpcml.train.feedback` reports per simulation."""
        self.module.eval()
        try:
            x, y = self.inputs(batch)
            out = self.module(*x)
            return [float(self.loss_fn(out[i:i + 1], y[i:i + 1])) for i in range(len(batch))]
        finally:
            self.module.train()

    def step_metrics(self, batch, dt: float) -> dict[str, Any]:
        return {"samples_per_s": len(batch) * self.grid.layout.dp / dt}

    def progress_line(self, m: dict, end: int) -> str:
        return (f"[train] step {m['step']}/{end} loss {m['loss']:.4e} lr {m['lr']:.2e} {m['samples_per_s']:.0f} "
                f"samples/s" + (f" buffer {m['buffer_len']}" if "buffer_len" in m else ""))

    @torch.no_grad()
    def predict(self, params: np.ndarray, t: np.ndarray) -> np.ndarray:
        """Fields in physical units for parameter rows and times (collective under FSDP)."""
        self.module.eval()
        p, tt = self.scales.inputs(np.asarray(params, np.float32), np.asarray(t, np.float32))
        return self.scales.field(self.module(p.to(self.device), tt.to(self.device)))

    def rel_l2(self, params: np.ndarray, t: np.ndarray, fields: np.ndarray) -> float:
        """||prediction - truth|| / ||truth|| over the whole set (per-sample ratios would be
        dominated by early times, whose fields are near zero)."""
        pred = self.predict(params, t)
        return float(np.linalg.norm(pred - fields) / max(float(np.linalg.norm(fields)), 1e-12))

    def state_extra(self) -> dict:
        return {**super().state_extra(), "scales": asdict(self.scales)}
