"""The Trainer's checkpoints: what a resume needs, saved every N steps and on the
scheduler's warning signal, restored on any layout."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from hpcml import ckpt, log, stop
from hpcml.train.trainer import Trainer

logger = log.get_logger(__name__)


def _tensors(trainer: Trainer, create: bool = False) -> dict[str, torch.Tensor]:
    tensors = ckpt.training_tensors(trainer.model.named_parameters(), trainer.optimizer, create=create)
    tensors[f"rank_state/rank_{trainer.grid.rank:05d}/torch_rng"] = torch.get_rng_state()
    return tensors


def _attrs(trainer: Trainer) -> dict[str, dict]:
    """Tensor attributes: the vocabulary-padded tensors' logical shape, fused weights' widths."""
    cfg = trainer.model.parts[0].config
    vocab = {f"model/{n}": {"logical_shape": [cfg.vocab_size, cfg.dim]} for n in ("tok_embeddings.weight", "output.weight")}
    attrs = {**vocab, **{f"optim/{n[6:]}/{s}": a for n, a in vocab.items() for s in ("exp_avg", "exp_avg_sq")}}
    attrs.update(ckpt.state.fused_attrs({f"layers.{i}.{name}": widths for i in range(cfg.n_layers)
                                         for name, widths in cfg.fused_widths.items()}))
    return attrs


def save_trainer(trainer: Trainer, root: str | Path, keep: int | None = None,
                 saver: ckpt.AsyncSaver | None = None, overlap: bool = False) -> ckpt.SaveResult | float:
    """Model, optimizer, schedule, step, data position and per-rank RNG as ``root/step_N``.
    With an :class:`~hpcml.ckpt.AsyncSaver` the writing overlaps training: returns the
    seconds training was blocked (``overlap``: the copy too, see ``AsyncSaver.save``)."""
    extra = {"step": trainer.step, "data": {"next_step": trainer.step},
             "scheduler": trainer.scheduler.state_dict(),
             "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups],
             "train_config": asdict(trainer.config)}
    kwargs = dict(extra=extra, layout=trainer.grid.layout.degrees, keep=keep, tensor_attrs=_attrs(trainer))
    if saver is not None:
        return saver.save(root, trainer.step, _tensors(trainer), overlap=overlap, **kwargs)
    return ckpt.save(root, trainer.step, _tensors(trainer), comm=trainer.grid.comm, **kwargs)


def load_trainer(trainer: Trainer, path: str | Path, strict: bool = True) -> ckpt.LoadReport:
    """Restore what :func:`save_trainer` wrote, whatever layout wrote it. The per-rank RNG
    state comes back when this rank's was saved (same world size), else it stays as seeded."""
    tensors = _tensors(trainer, create=True)
    rng_name = f"rank_state/rank_{trainer.grid.rank:05d}/torch_rng"
    rng = tensors.pop(rng_name)
    report = ckpt.load(path, tensors, strict=strict, comm=trainer.grid.comm, tensor_attrs=_attrs(trainer))
    extra = report.extra
    trainer.step = int(extra["step"])
    for group, saved in zip(trainer.optimizer.param_groups, extra["param_groups"]):
        group.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items()})
    trainer.scheduler.load_state_dict(extra["scheduler"])
    if not ckpt.load(report.path, {rng_name: rng}, strict=False).missing:
        torch.set_rng_state(rng)
    logger.info("resumed step %d from %s (saved on %s), read %.2fx the bytes needed", trainer.step, report.path,
                report.layout, report.read_amplification)
    return report


class CheckpointHook:
    """Save every ``every`` steps and when SIGTERM or SIGUSR1 arrived on any rank (then stop).

    ``async_save``: periodic saves overlap training (a writer process per rank); a save on
    a signal is synchronous, since the job is about to end. ``overlap`` (with
    ``async_save``): the snapshot copy also runs beside the next forward and backward, the
    next optimizer step waiting for it -- a gain only where the copy does not take the
    compute's cores (measured in docs/benchmarks.md). Call :meth:`close` before exit.
    """

    def __init__(self, root: str | Path, every: int, keep: int | None = 3, async_save: bool = False,
                 signals: tuple[int, ...] = stop.STOP_SIGNALS, overlap: bool = False) -> None:
        self.root, self.every, self.keep = Path(root), every, keep
        self.async_save, self.overlap = async_save, overlap
        self.saver: ckpt.AsyncSaver | None = None
        self.saved: list[Path] = []
        self.blocked_s: list[float] = []
        stop.install(signals)  # the Trainer reads stop.requested() every step

    def __call__(self, trainer: Trainer, metrics: dict) -> None:
        if metrics.get("stop"):
            self.close()
            self.saved.append(save_trainer(trainer, self.root, keep=self.keep).path)
        elif self.async_save and self.saver is None:
            # at the first step: start the writer and fill its staging buffer in the background,
            # so the first save blocks only for its copy (collective: every rank runs hooks)
            self.saver = ckpt.AsyncSaver(trainer.grid.comm)
            self.saver.reserve(_tensors(trainer), tensor_attrs=_attrs(trainer))
            if self.overlap:  # the next optimizer step, the first thing to change the saved tensors, waits
                trainer.optimizer.register_step_pre_hook(lambda *_: self.saver.wait_staged())
        if not metrics.get("stop") and self.every and trainer.step % self.every == 0:
            if not self.async_save:
                self.saved.append(save_trainer(trainer, self.root, keep=self.keep).path)
                return
            self.blocked_s.append(save_trainer(trainer, self.root, keep=self.keep, saver=self.saver,
                                                overlap=self.overlap))
            self.saved.append(self.root / f"step_{trainer.step:08d}")

    def close(self) -> None:
        """Wait for a save in flight and commit it (collective)."""
        if self.saver is not None:
            self.saver.close()
