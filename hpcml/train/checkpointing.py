"""Checkpoints of any trainer on the shared loop (one state protocol,
:class:`~hpcml.train.loop.Stateful`): what a resume needs, saved every N steps and on the
scheduler's warning signal, restored on any layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal
from pathlib import Path

import torch

from hpcml import ckpt, log, stop
from hpcml.ckpt.format import refuse_saves_over
from hpcml.train.loop import Stateful, TrainLoop

logger = log.get_logger(__name__)


def save_trainer(trainer: Stateful, root: str | Path, keep: int | None = None,
                 saver: ckpt.AsyncSaver | None = None, overlap: bool = False, *,
                 extra_tensors: dict[str, torch.Tensor] | None = None,
                 extra: dict | None = None) -> ckpt.SaveResult | float:
    """A trainer's state (:class:`~hpcml.train.loop.Stateful`: model, optimizer, schedule,
    step, per-rank RNG) as ``root/step_N``, with ``extra_tensors`` (e.g. a sample source's
    state) and ``extra`` JSON beside it. With an :class:`~hpcml.ckpt.AsyncSaver` the writing
    overlaps training: returns the seconds training was blocked (``overlap``: the copy of
    the trainer's own tensors too, see ``AsyncSaver.save``; ``extra_tensors``, which may
    change before the next optimizer step, are copied at once)."""
    tensors = {**trainer.state_tensors(), **(extra_tensors or {})}
    kwargs = dict(extra={**trainer.state_extra(), **(extra or {})}, layout=trainer.grid.layout.degrees, keep=keep,
                  tensor_attrs=trainer.tensor_attrs())
    if saver is not None:
        return saver.save(root, trainer.step, tensors, overlap=overlap, copy_now=set(extra_tensors or ()), **kwargs)
    return ckpt.save(root, trainer.step, tensors, comm=trainer.grid.comm, **kwargs)


def load_trainer(trainer: Stateful, path: str | Path, strict: bool = True) -> ckpt.LoadReport:
    """Restore what :func:`save_trainer` wrote, whatever layout wrote it. The per-rank RNG
    state comes back when this rank's was saved (same world size), else it stays as seeded."""
    tensors = trainer.state_tensors(create=True)
    rng_name = f"rank_state/rank_{trainer.grid.rank:05d}/torch_rng"
    rng = tensors.pop(rng_name)
    report = ckpt.load(path, tensors, strict=strict, comm=trainer.grid.comm, tensor_attrs=trainer.tensor_attrs())
    trainer.load_state_extra(report.extra, step=report.step, where=report.path)  # the step is the manifest's
    if not ckpt.load(report.path, {rng_name: rng}, strict=False).missing:
        torch.set_rng_state(rng)
    logger.info("resumed step %d from %s (saved on %s), read %.2fx the bytes needed", trainer.step, report.path,
                report.layout, report.read_amplification)
    return report


class CheckpointHook:
    """Save every ``every`` steps, at the last step of :meth:`TrainLoop.fit` (``final``: a run
    of 1,000 steps saving every 300 keeps step 1,000, not 900), and when SIGTERM or SIGUSR1
    arrived on any rank (then stop). ``every=0``: only on a signal.

    ``async_save``: periodic saves overlap training (a writer process per rank); a save on
    a signal is synchronous, since the job is about to end. ``overlap`` (with
    ``async_save``): the snapshot copy of the model and optimizer also runs beside the next
    forward and backward, the next optimizer step waiting for it. ``"auto"`` (the default)
    turns it on where the state lives on an accelerator (the copy is device-to-host, beside
    the compute) and off on CPU, where the copy would take the compute's cores (measured in
    docs/benchmarks.md). ``state``: what else each save holds,
    as ``(tensors, extra JSON)`` taken at the moment of the save (online training's sample
    source). ``resumed``: the trainer resumed, or will before its first step, from what
    ``root`` holds; without it a ``root`` holding an earlier run's saves is refused here
    (:func:`refuse_saves_over`). Call :meth:`close` before exit.
    """

    def __init__(self, root: str | Path, every: int, keep: int | None = 3, async_save: bool = False,
                 signals: tuple[int, ...] = stop.STOP_SIGNALS, overlap: bool | Literal["auto"] = "auto",
                 state: Callable[[], tuple[dict[str, torch.Tensor], dict]] | None = None, *,
                 resumed: bool = False, final: bool = True) -> None:
        if overlap not in (True, False, "auto"):
            raise ValueError(f"CheckpointHook(overlap={overlap!r}): expected True, False or 'auto'")
        if not resumed:
            refuse_saves_over(root, "load them first (load_trainer) and pass resumed=True, or give an empty directory")
        self.root, self.every, self.keep = Path(root), every, keep
        self.async_save, self.overlap, self.state, self.final = async_save, overlap, state, final
        self.saver: ckpt.AsyncSaver | None = None
        self.saved: list[Path] = []
        self.blocked_s: list[float] = []
        self._owner = False
        self._guarded = False
        stop.install(signals)  # the Trainer reads stop.requested() every step

    def claim(self, comm) -> None:
        """Take the directory's lock now (collective; at the latest the first step does): a
        second job on it is refused on every rank, before a script loads or trains anything."""
        if not self._owner:
            ckpt.lock.hold_on(self.root, comm)
            self._owner = True

    def __call__(self, trainer: TrainLoop, metrics: dict) -> None:
        self.claim(trainer.grid.comm)  # a second job on this directory is refused at its first step, not its first save
        if metrics.get("stop"):
            self.save(trainer)
            return
        if self.async_save and self.saver is None:
            # at the first step: start the writer and fill its staging buffer in the background,
            # so the first save blocks only for its copy (collective: every rank runs hooks)
            self.saver = ckpt.AsyncSaver(trainer.grid.comm)
            own = trainer.state_tensors()
            self.saver.reserve(own, tensor_attrs=trainer.tensor_attrs())
            if self.overlap == "auto":
                self.overlap = any(t.device.type != "cpu" for t in own.values())
                logger.info("async saves: the snapshot copy %s", "overlaps the next step (state on an accelerator)"
                            if self.overlap else "blocks training (state on CPU: the copy would take its cores)")
            if self.overlap and not self._guarded:  # the next optimizer step, the first thing to change the
                # saved tensors, waits (once per hook: a synchronous save drops the saver, the next makes another)
                trainer.optimizer.register_step_pre_hook(lambda *_: self.saver is not None and self.saver.wait_staged())
                self._guarded = True
        last = self.final and trainer.step == getattr(trainer, "end_step", None)
        if self.every and (trainer.step % self.every == 0 or last):  # the trained model is never left unsaved
            if not self.async_save:
                self.save(trainer)
                return
            tensors, extra = self.state() if self.state is not None else ({}, {})
            self.blocked_s.append(save_trainer(trainer, self.root, keep=self.keep, saver=self.saver,
                                                overlap=self.overlap, extra_tensors=tensors, extra=extra))
            self.saved.append(self.root / f"step_{trainer.step:08d}")

    def save(self, trainer: TrainLoop) -> None:
        """Save now, synchronously, after committing any save in flight (collective)."""
        self._commit()
        tensors, extra = self.state() if self.state is not None else ({}, {})
        self.saved.append(save_trainer(trainer, self.root, keep=self.keep, extra_tensors=tensors, extra=extra).path)

    def _commit(self) -> None:
        if self.saver is not None:
            self.saver.close()
            self.saver = None

    def close(self) -> None:
        """Wait for a save in flight and commit it (collective), then give up the directory
        (another job may save there now)."""
        try:
            self._commit()
        finally:
            if self._owner:
                ckpt.lock.release(self.root)
                self._owner = False
