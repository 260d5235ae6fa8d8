"""The LLM trainer: the shared loop (:mod:`hpcml.train.loop`) on token batches --
micro-batches, each rank's dp slice of the global batch and cp slice of the sequence,
tokens/s, model FLOP/s and MFU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hpcml import log
from hpcml.errors import ConfigError
from hpcml.parallel.api import ParallelModel
from hpcml.parallel.docmask import document_ids
from hpcml.parallel.fpdt import local_positions
from hpcml.train.config import TrainConfig, check_source  # noqa: F401 (the trainer's API)
from hpcml.train.loop import TrainLoop, make_optimizer

logger = log.get_logger(__name__)


class TokenSource(Protocol):
    """``global_batch(step, n)``: the ``[n, seq_len + 1]`` tokens of ``step``, the same on every
    layout; a source that also has ``rows(step, n, lo, hi)`` (rows ``lo .. hi`` of it) is read
    only for this rank's rows."""

    def global_batch(self, step: int, n: int) -> torch.Tensor: ...


class Trainer(TrainLoop):
    """Runs :class:`TrainConfig` on a parallelised language model with a token source.
    ``fit()`` draws the batch of each step from ``data``, so any layout trains on the same samples."""

    def __init__(self, *, model: ParallelModel, config: TrainConfig, data: TokenSource,
                 flops_per_token: float | None = None, hooks: list[Callable] | None = None) -> None:
        config.check_layout(model.grid.layout, model.parts[0].config.max_seq_len, model.config.fpdt_chunk,
                            model.config.loss_chunk)
        super().__init__(model, config, hooks)
        self.data, self.flops_per_token = data, flops_per_token
        self.val: tuple[TokenSource, int, int] | None = None

    def validate_on(self, source: TokenSource, *, every: int, batches: int = 4) -> None:
        """Report ``val_loss`` -- the mean loss over the first ``batches`` global batches of
        ``source`` (the same ones each time) -- every ``every`` steps and after the last."""
        if every < 1 or batches < 1:
            raise ConfigError(f"validation every {every} steps on {batches} batches: expected both >= 1")
        check_source(source, self.config.seq_len, self.model.parts[0].config.vocab_size, "validation data",
                     self.config.doc_mask_eod)
        self.val = (source, every, batches)

    def evaluate(self, source: TokenSource, batches: int) -> float:
        """The mean loss over ``source``'s first ``batches`` global batches (forward only, every layout alike)."""
        lay = self.grid.layout
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.config.bf16 else None
        self.model.train(False)
        try:
            total = torch.zeros(1, dtype=torch.float64, device=self.device)
            for k in range(batches):
                batch = self.local_batch(k, source)
                loss = self.model.forward_loss(*self.inputs(batch), self.n_micro(), autocast, self.every_stage(batch))
                if loss is not None:  # last pipeline stage: each (dp, cp, tp) rank one share of the mean
                    total += loss / (lay.dp * lay.cp * lay.tp)
            dist.all_reduce(total, group=self.grid.torch.group)
            return float(total) / batches
        finally:
            self.model.train(True)
            self.model.reshard()  # as it was: FSDP's root gathered by this forward would stay so until a backward

    def after_update(self) -> dict[str, Any]:
        val = self.val
        if val is None or not (self.step % val[1] == 0 or self.step == self.config.steps):
            return {}
        return {"val_loss": self.evaluate(val[0], val[2])}

    def local_batch(self, step: int, source: TokenSource | None = None) -> tuple[torch.Tensor, ...]:
        """This rank's (inputs, targets): its dp slice of the global batch, its cp positions of the
        sequence (a contiguous slice, or FPDT's strided chunks: :func:`local_positions`); under
        document masking also every position's document, of the whole sequence."""
        lay, c = self.grid.layout, self.grid.coords
        data = self.data if source is None else source
        n = self.config.global_batch
        per_dp = n // lay.dp
        lo, hi = c["dp"] * per_dp, (c["dp"] + 1) * per_dp
        if hasattr(data, "rows"):  # a corpus on disk: read only this rank's sequences
            tokens = data.rows(step, n, lo, hi)
        else:
            tokens = data.global_batch(step, n)[lo:hi]
        x, y = tokens[:, :-1], tokens[:, 1:]
        pos = local_positions(self.config.seq_len, c["cp"], lay.cp, self.model.config.fpdt_chunk)
        batch = x[:, pos].contiguous().to(self.device), y[:, pos].contiguous().to(self.device)
        if self.config.doc_mask_eod is None:
            return batch
        return (*batch, document_ids(x, self.config.doc_mask_eod).to(self.device))  # every position's document

    def inputs(self, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        return batch[0], batch[1]

    def every_stage(self, batch: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        return {"doc_ids": batch[2]} if len(batch) > 2 else {}

    def n_micro(self) -> int:
        return self.config.micro_batches(self.grid.layout)

    def train_step(self, batch: Any = None, extra: dict | None = None, *, agree_stop: bool = True) -> dict[str, Any]:
        return super().train_step(self.local_batch(self.step) if batch is None else batch, extra, agree_stop=agree_stop)

    def fit(self, steps: int | None = None) -> list[dict]:  # type: ignore[override]
        """Train until ``steps`` (default ``config.steps``) optimizer steps are done in total."""
        return super().fit(self.local_batch, steps)

    def step_metrics(self, batch: Any, dt: float) -> dict[str, Any]:
        cfg, lay = self.config, self.grid.layout
        tokens = cfg.global_batch * cfg.seq_len
        m: dict[str, Any] = {"tokens_per_s": tokens / dt}
        if self.flops_per_token:
            per_device = self.flops_per_token * tokens / dt / lay.world_size
            m["model_tflops_per_device"] = per_device / 1e12
            m["mfu"] = per_device / cfg.peak_flops if cfg.peak_flops else "n/a"
        return m

    def progress_line(self, m: dict, end: int) -> str:
        width = 24
        done = int(width * m["step"] / end)
        mfu = m.get("mfu", "n/a")
        mfu = f"{mfu:.1%}" if isinstance(mfu, float) else mfu
        return (f"[{'#' * done}{'.' * (width - done)}] step {m['step']}/{end} loss {m['loss']:.4f} "
                f"gnorm {m['grad_norm']:.3f} lr {m['lr']:.2e} {m['tokens_per_s']:.0f} tok/s MFU {mfu} "
                f"mem {m['peak_mem_mb']:.0f} MB")

    def state_extra(self) -> dict:
        """The loop's state, the data position, and the model's config (``extra["model"]``):
        a checkpoint alone rebuilds its model (``hpcml ckpt export --format hf`` reads it)."""
        return {**super().state_extra(), "data": {"next_step": self.step},
                "model": self.model.parts[0].config.describe()}

    def load_state_extra(self, extra: dict, *, step: int | None = None, where: object = "") -> None:
        super().load_state_extra(extra, step=step, where=where)
        model = extra.get("model")
        saved = model.get("config") if isinstance(model, dict) else None
        if isinstance(saved, dict) and self.grid.rank == 0:
            now = self.model.parts[0].config.to_dict()
            changed = {k: (v, now.get(k)) for k, v in saved.items() if now.get(k) != v}
            if changed:  # shapes were checked by the load; this names what the tensors do not show
                logger.warning("model config differs from the checkpoint's (saved, now): %s", changed)


__all__ = ["TokenSource", "TrainConfig", "Trainer", "make_optimizer"]
