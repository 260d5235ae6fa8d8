"""Online (and offline) training from any sample source: the loop a domain scientist comes for.

:func:`train_online` runs a trainer on the batches a :class:`~hpcml.stream.source.SampleSource`
puts in its buffer (simulations streaming over ZeroMQ, HDF5 files, or a source of one's
own), and owns everything around the steps that a run at a centre needs:

- resume: model, optimizer, schedule, step and the source's state (buffer contents and the
  keys already taken) from the latest checkpoint, on any number of trainer ranks;
- checkpoints every ``ckpt_every`` steps and at the end, the source's state beside the model;
- the walltime warning (:mod:`hpcml.stop`): every rank takes in what was already sent,
  saves and returns ``stopped`` (the caller exits :data:`hpcml.env.NOT_FINISHED`);
- the drain: after the last step it keeps taking the stream in until it ends, so no
  simulation blocks on a trainer that left;
- the summary of every rank's counters, and what went wrong (no silent success).

The trainer is any :class:`~hpcml.train.loop.TrainLoop` whose ``inputs`` takes a list of
samples (:class:`~hpcml.train.fields.FieldTrainer` is one): its checkpoints are the same as
the offline trainers' (:mod:`hpcml.train.checkpointing`), with the source's state and the
campaign id beside them. A checkpoint of another campaign is never resumed.
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcml import log
from hpcml.errors import ConfigError
from hpcml.stream.source import SampleSource

if TYPE_CHECKING:
    from hpcml.train.loop import TrainLoop

logger = log.get_logger(__name__)

_STATE = re.compile(r"^stream/rank_(\d{5})/(.+)$")

BENIGN_DROPS = frozenset({"stale_attempt"})
"""Drops that lose nothing: a retried simulation's older attempt, superseded by the new one.
Any other dropped message fails the run (its data never reached training)."""


@dataclass(frozen=True, kw_only=True)
class OnlineConfig:
    """How long to train and how to survive: ``repr()`` rebuilds it."""

    steps: int
    """Gradient steps at most (training also ends with the stream)."""
    batch: int
    """Samples per step on each trainer rank."""
    ckpt_dir: str | None = None
    """Where checkpoints go (``None``: none, and a stop cannot be resumed)."""
    ckpt_every: int = 0
    """Save every N steps (0: only at the end and on a stop)."""
    keep: int = 2
    """Checkpoints kept."""
    resume: bool = False
    """Continue from ``ckpt_dir``'s latest checkpoint, if it has one."""
    endpoints_file: str | None = None
    """Where to publish the sources' endpoints once all are listening (the Campaign waits for
    it); default ``$HPCML_STREAM_ENDPOINTS_FILE`` when the source has an endpoint."""
    campaign: str = ""
    """The campaign id: written with the endpoints and into every checkpoint; a resume
    refuses a checkpoint that holds another campaign ("": no check)."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "keep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"OnlineConfig.{name}={v!r}: expected an integer >= 1")
        if isinstance(self.ckpt_every, bool) or not isinstance(self.ckpt_every, int) or self.ckpt_every < 0:
            raise ConfigError(f"OnlineConfig.ckpt_every={self.ckpt_every!r}: expected an integer >= 0")
        if self.resume and not self.ckpt_dir:
            raise ConfigError("OnlineConfig.resume=True needs ckpt_dir: there is nothing to resume from")


@dataclass
class OnlineResult:
    status: str
    """``ok`` (trained, stream ended), ``stopped`` (saved on a stop request: resume it) or
    ``failed`` (see ``problems``)."""
    steps: int
    resumed_at: int | None = None
    problems: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    """Every rank's counters summed (rank 0; empty elsewhere)."""


# -- the source's state in a checkpoint ------------------------------------------------------
def source_tensors(source: SampleSource, rank: int) -> dict:
    """``stream/rank_NNNNN/<name>`` tensors of this rank's source state."""
    import torch

    return {f"stream/rank_{rank:05d}/{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in
            source.state().items() if v.size}


def load_source_states(ckpt_path) -> list[dict[str, np.ndarray]]:
    """Every saved rank's source state from checkpoint ``ckpt_path`` (plain HDF5, no pickle)."""
    from hpcml import ckpt

    states: dict[int, dict[str, np.ndarray]] = {}
    for name, t in ckpt.read_tensors(ckpt_path, "stream/").items():
        m = _STATE.match(name)
        if m:
            states.setdefault(int(m.group(1)), {})[m.group(2)] = t.numpy()
    for st in states.values():
        st.setdefault("seen", np.zeros((0, 2), np.int64))
    return [states[r] for r in sorted(states)]


def simulations_in(ckpt_path, outputs: int) -> set[int]:
    """Simulations of which checkpoint ``ckpt_path`` holds at least ``outputs`` samples
    (every output): their data survives a restart, so a resumed campaign need not run them
    again. One that finished after the save is not among them."""
    seen = Counter(int(sim) for st in load_source_states(ckpt_path) for sim, _ in st["seen"].tolist())
    return {sim for sim, n in seen.items() if n >= outputs}


def check_campaign(ckpt_dir, campaign: str) -> None:
    """Refuse to resume ``ckpt_dir``'s latest checkpoint when it holds another campaign than ``campaign``."""
    from hpcml import ckpt

    if not campaign:
        return
    path, step, extra = ckpt.read_extra(ckpt_dir)
    saved = extra.get("campaign", "")
    if saved != campaign:
        raise ConfigError(f"checkpoint {path} (step {step}) belongs to campaign {saved or 'unknown'!r}, not "
                          f"{campaign!r}: resume that campaign, or use a new run directory")


# -- the loop --------------------------------------------------------------------------------
def train_online(trainer: TrainLoop, source: SampleSource, *, grid, config: OnlineConfig,
                 on_step: Callable[[dict], None] | None = None) -> OnlineResult:
    """Train until ``config.steps`` or the end of the stream, then drain and save; collective
    over ``grid.comm``. ``on_step(metrics)`` runs after each step (and its checkpoint)."""
    from mpi4py import MPI

    from hpcml import stop
    from hpcml.stream.loader import StreamLoader
    from hpcml.stream.routing import write_endpoints
    from hpcml.train.checkpointing import load_trainer, save_trainer

    comm, rank = grid.comm, grid.rank
    ckpt_dir = Path(config.ckpt_dir) if config.ckpt_dir else None
    resumed_at = None
    if config.resume and (ckpt_dir / "latest").exists():
        check_campaign(ckpt_dir, config.campaign)  # every rank, before any collective
        report = load_trainer(trainer, ckpt_dir)
        source.load_state(load_source_states(report.path))
        resumed_at = trainer.step
        if rank == 0:
            logger.info("resumed at step %d from %s (saved on %s); buffer %d samples", trainer.step, report.path,
                        report.layout, len(source.buffer))
    source.start()
    endpoint = getattr(source, "endpoint", None)
    endpoints = comm.gather(endpoint)
    target = config.endpoints_file or (os.environ.get("HPCML_STREAM_ENDPOINTS_FILE") if endpoint else None)
    if rank == 0 and target:  # last: the Campaign starts no simulation before every server listens
        write_endpoints(target, config.campaign, endpoints)

    saved = {"step": None, "samples": -1}  # what the last save holds: the end skips a save of the same state

    def save() -> None:
        if ckpt_dir is not None:
            saved.update(step=trainer.step, samples=int(source.stats()["samples"]))
            save_trainer(trainer, ckpt_dir, keep=config.keep, extra_tensors=source_tensors(source, rank),
                         extra={"campaign": config.campaign})

    def stopped() -> OnlineResult:  # every rank, together: keep what arrived, save, say "not finished"
        source.quiesce()
        save()
        stop.finished()
        source.stop()
        if rank == 0:
            logger.info("stopped by signal at step %d%s", trainer.step, " after saving" if ckpt_dir else
                        " (no ckpt_dir: nothing saved)")
        return OnlineResult("stopped" if ckpt_dir else "failed", trainer.step, resumed_at,
                            [] if ckpt_dir else ["stopped with no ckpt_dir: the run cannot be resumed"])

    stopping = lambda: stop.requested() is not None  # noqa: E731
    loader = StreamLoader(source, comm, config.batch, should_stop=stopping)
    buffer = source.buffer
    t_train = time.perf_counter()
    while trainer.step < config.steps:
        batch = loader.next_batch()
        if batch is None:
            break
        m = trainer.train_step(batch, extra={"buffer_len": len(buffer)})
        if config.ckpt_every and trainer.step % config.ckpt_every == 0:
            save()
        if on_step is not None:
            on_step(m)
    if loader.stopped:
        return stopped()
    train_s = time.perf_counter() - t_train
    # keep the stream flowing until it ends everywhere; the ranks agree every round (all
    # ended, or a stop on any), so they leave together
    drained = 0
    flags = np.zeros(3, np.int32)
    while True:
        ended = buffer.ended  # read first: once ended, the count below is final
        unchanged = saved["step"] == trainer.step and saved["samples"] == source.stats()["samples"] and not drained
        flags[:] = (int(ended), int(not stopping()), int(unchanged))
        comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MIN)  # [all ended, none asked to stop, no state new since the save]
        if not flags[1]:
            return stopped()
        if flags[0]:
            break
        if buffer.config.policy == "reservoir":  # never blocks the stream: just wait for its end
            time.sleep(0.05)
        else:
            drained += len(buffer.get(1, timeout=0.05) or [])
    if not flags[2]:  # the last periodic save already holds this state otherwise
        save()
    stats = comm.gather({**source.stats(), "unused": loader.unused() + drained, "starved_s": loader.starved_s,
                         "agree_s": loader.agree_s, "train_s": train_s,
                         "since_first_batch_s": time.perf_counter() - loader.t_first_batch
                         if loader.t_first_batch else 0.0})
    source.stop()
    result = OnlineResult("ok", trainer.step, resumed_at)
    if trainer.step == 0:
        result.problems.append("the trainer took 0 gradient steps")
    if rank == 0:
        result.summary = _summary(stats, trainer, config, grid.layout.world_size)
        died = [f"trainer rank {r}: {s['error']}" for r, s in enumerate(stats) if s.get("error")]
        if died:
            result.problems.append(f"the sample source died ({'; '.join(died)}): data sent after that was lost")
        empty = [r for r, s in enumerate(stats) if s["samples"] == 0]
        if empty:
            result.problems.append(f"trainer rank(s) {empty} received no sample")
        dropped = {k: n for k, n in result.summary["dropped_messages"].items() if k not in BENIGN_DROPS}
        if dropped:
            why = ", ".join(f"{n} {reason}" for reason, n in sorted(dropped.items()))
            result.problems.append(f"{sum(dropped.values())} message(s) were dropped ({why}): see the trainer's log")
    result.status = "failed" if result.problems else "ok"
    return result


def _summary(stats: list[dict], trainer, config: OnlineConfig, world: int) -> dict:
    busy = sum(s["since_first_batch_s"] for s in stats)
    history = getattr(trainer, "history", [])
    return {"samples_ingested": sum(s["samples"] for s in stats),
            "duplicate_samples": sum(s.get("duplicates", 0) for s in stats),
            "dropped_messages": dict(sum((Counter(s.get("dropped", {})) for s in stats), Counter())),
            "intake_mb_s": sum(s.get("intake_mb_s", 0.0) for s in stats),
            "bytes_ingested": sum(s.get("bytes", 0) for s in stats),
            "samples_unused": sum(s["unused"] for s in stats),
            "samples_trained": trainer.step * config.batch * world, "gradient_steps": trainer.step,
            "final_loss": history[-1]["loss"] if history else None,
            "trainer_idle_fraction": sum(s["starved_s"] for s in stats) / busy if busy else 0.0,
            "agreement_fraction": sum(s["agree_s"] for s in stats) / busy if busy else 0.0,
            "train_s": max(s["train_s"] for s in stats),
            "buffer": {"per_rank": [s.get("buffer", {}) for s in stats]}, "train_ranks": world}
