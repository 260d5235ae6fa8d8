"""Online (and offline) training from any sample source: the loop a domain scientist comes for.

:func:`train_online` runs a trainer on the batches a :class:`~hpcml.stream.source.SampleSource`
puts in its buffer (simulations streaming over ZeroMQ, HDF5 files, or a source of one's
own), and owns everything around the steps that a run at a centre needs:

- resume: model, optimizer, schedule, step and the source's state (buffer contents and the
  keys already taken) from the latest checkpoint, on any number of trainer ranks;
- checkpoints every ``ckpt_every`` steps (asynchronous with ``async_save``: the LLM loop's
  :class:`~hpcml.train.checkpointing.CheckpointHook`), at the end and on a stop, the
  source's state beside the model;
- the walltime warning (:mod:`hpcml.stop`): every rank takes in what was already sent,
  saves and returns ``stopped`` (the caller exits :data:`hpcml.env.NOT_FINISHED`);
- one agreement per step among the ranks (:class:`~hpcml.stream.loader.StreamLoader`):
  every rank has a batch, the stream goes on, no stop was asked, the source lives;
- the drain: after the last step it keeps taking the stream in until it ends, so no
  simulation blocks on a trainer that left;
- the summary: exactly-once accounting of the whole campaign (:mod:`hpcml.train.online_report`)
  and what went wrong -- a run that lost samples is not ``ok``.

Steps and batch are the trainer's (``trainer.config.steps``, ``trainer.config.batch``): set
in one place. The trainer is any :class:`~hpcml.train.loop.TrainLoop` whose ``inputs`` takes
a list of samples (:class:`~hpcml.train.fields.FieldTrainer` is one). A checkpoint of another
campaign is never resumed. In a campaign, :meth:`OnlineConfig.from_campaign` reads all of
it from the driver's contract (:mod:`hpcml.contract`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcml import lifeline, log, safeio, waiting
from hpcml.contract import Contract
from hpcml.errors import ConfigError
from hpcml.numeric import is_int
from hpcml.stream.buffer import Buffer
from hpcml.stream.source import SampleSource
from hpcml.train.online_report import BENIGN_DROPS, earlier_final_loss, problems, summarize
from hpcml.train.online_state import check_campaign, load_source_states, simulations_in, source_tensors

FEEDBACK_KEY = "feedback"
"""Where a checkpoint's ``extra`` holds the per-simulation feedback table."""

if TYPE_CHECKING:
    from hpcml.train.loop import TrainLoop

__all__ = ["BENIGN_DROPS", "OnlineConfig", "OnlineResult", "OnlineRun", "check_campaign", "load_source_states",
           "simulations_in", "train_online"]

logger = log.get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class OnlineConfig:
    """How to keep a run: checkpoints, resume, where to report. ``repr()`` rebuilds it."""

    ckpt_dir: str | None = None
    """Where checkpoints go (``None``: none, and a stop cannot be resumed)."""
    ckpt_every: int = 0
    """Save every N steps (0: only at the end and on a stop)."""
    keep: int = 2
    """Checkpoints kept."""
    async_save: bool = False
    """Periodic saves overlap training (a writer process per rank, as the LLM loop's)."""
    resume: bool = False
    """Continue from ``ckpt_dir``'s latest checkpoint, if it has one."""
    endpoints_file: str | None = None
    """Where to publish the sources' endpoints once all are listening (the campaign's
    simulations wait for it)."""
    campaign: str = ""
    """The campaign id: written with the endpoints and into every checkpoint; a resume
    refuses a checkpoint that holds another campaign ("": no check)."""
    run: str = ""
    """This run of the campaign (the driver's): the endpoints file says it."""
    summary_file: str | None = None
    """Where rank 0 writes the summary (the campaign reads it: ``train_summary.json``)."""
    feedback_file: str | None = None
    """Where rank 0 publishes per-simulation losses for the campaign's sampler
    (:mod:`hpcml.train.feedback`; ``feedback.json`` in a campaign; None: not kept)."""
    feedback_every: int = 10
    """Steps between evaluations of the batch per simulation (one extra forward each)."""
    val_every: int = 0
    """Steps between validations by the run's ``validate`` (published as feedback metrics, for a
    campaign's target; 0: none during training)."""

    def __post_init__(self) -> None:
        for name, least in (("keep", 1), ("ckpt_every", 0), ("feedback_every", 1), ("val_every", 0)):
            v = getattr(self, name)
            if not is_int(v) or v < least:
                raise ConfigError(f"OnlineConfig.{name}={v!r}: expected an integer >= {least}")
        if self.resume and not self.ckpt_dir:
            raise ConfigError("OnlineConfig.resume=True needs ckpt_dir: there is nothing to resume from")

    @classmethod
    def from_campaign(cls, contract: Contract | None = None, **overrides: Any) -> OnlineConfig:
        """The config the campaign's contract implies: checkpoints in ``run_dir/checkpoints``,
        resume when the driver says so, the campaign and run, the endpoints and summary files."""
        c = contract or Contract.from_env()
        base = dict(ckpt_dir=str(c.ckpt_dir), resume=c.resume, campaign=c.campaign, run=c.run,
                    endpoints_file=c.endpoints_file if c.streams else None, summary_file=str(c.summary_file),
                    feedback_file=str(c.feedback_file))
        return cls(**{**base, **overrides})


@dataclass
class OnlineResult:
    status: str
    """``ok`` (trained, stream ended, nothing lost), ``stopped`` (saved on a stop request:
    resume it) or ``failed`` (see ``problems``)."""
    steps: int
    resumed_at: int | None = None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What the run should know that does not fail it (samples never trained on)."""
    summary: dict[str, Any] = field(default_factory=dict)
    """Every rank's counters summed (rank 0; empty elsewhere)."""
    missing: int = 0
    """Samples of completed simulations that never reached training (every rank knows)."""
    repeat: bool = False
    """Failed so that a relaunch would fail alike: no step taken from a stream that ended whole
    (too few samples for a batch, none sent)."""

    @property
    def incomplete(self) -> bool:
        """Failed, with samples of completed simulations that never arrived: a relaunch cannot
        bring them back (a resumed campaign runs those simulations again)."""
        return self.status == "failed" and self.missing > 0


def train_online(trainer: TrainLoop, source: SampleSource, *, grid, config: OnlineConfig,
                 on_step: Callable[[dict], None] | None = None) -> OnlineResult:
    """Train until ``trainer.config.steps`` or the end of the stream, then drain and save;
    collective over ``grid.comm``. ``on_step(metrics)`` runs after each step (and its checkpoint)."""
    return OnlineRun(trainer, source, grid=grid, config=config, on_step=on_step).run()


class OnlineRun:
    """One online training run: resume, train, drain, report (see the module docstring)."""

    def __init__(self, trainer: TrainLoop, source: SampleSource, *, grid, config: OnlineConfig,
                 on_step: Callable[[dict], None] | None = None,
                 validate: Callable[[], dict[str, float]] | None = None, comm=None) -> None:
        """``validate()``: run-wide figures (a held-out error), every ``config.val_every`` steps
        on every rank (it may be collective), published with the feedback. ``comm``: the ranks
        that share the data (the loader's agreement, the endpoints, the summary), numbered as
        the source's trainer ranks; default ``grid.comm`` (a population's: the whole job,
        :func:`hpcml.train.population_online.stream_comm`)."""
        from hpcml.stream.loader import StreamLoader
        from hpcml.train.checkpointing import CheckpointHook
        from hpcml.train.population_online import member_keep

        if not isinstance(source, SampleSource) or not isinstance(getattr(source, "buffer", None), Buffer):
            raise ConfigError(f"source {type(source).__name__} is not a hpcml.stream.source.SampleSource with a "
                              f"buffer: subclass SampleSource (each member has a default) and set its buffer")
        self.batch = trainer.samples_per_step()
        if not is_int(self.batch) or self.batch < 1:
            raise ConfigError(f"trainer.config.batch={self.batch!r}: online training takes the per-rank batch from "
                              f"the trainer's config (FieldTrainConfig(batch=...)), an integer >= 1")
        self.trainer, self.source, self.grid, self.config, self.on_step = trainer, source, grid, config, on_step
        self.validate = validate
        self.comm = comm if comm is not None else grid.comm
        self.rank = self.comm.Get_rank()
        self.steps = trainer.config.steps
        capacity = source.buffer.config.capacity
        if self.batch > capacity:
            raise ConfigError(f"batch={self.batch} is more than the buffer's capacity={capacity}: no batch could ever "
                              f"be served; give a buffer of at least the batch")
        self.hook = None if not config.ckpt_dir else CheckpointHook(
            config.ckpt_dir, config.ckpt_every, keep=member_keep(config.ckpt_dir, self.grid, config.keep),
            async_save=config.async_save,
            state=self._source_state, resumed=config.resume, final=False)  # the end's save is the run's (drained)
        self.feedback = None
        if config.feedback_file and trainer.per_sample_losses:
            from hpcml.train.feedback import SimFeedback

            self.feedback = SimFeedback(path=config.feedback_file, every=config.feedback_every, comm=self.comm,
                                        param_names=source.param_names, campaign=config.campaign, run=config.run)
        self.loader = StreamLoader(source, self.comm, self.batch, should_stop=self._stopping,
                                   novel=self.feedback.novel if self.feedback is not None else None)
        self.resumed_at: int | None = None
        self._saved: tuple[int, int] | None = None  # (step, samples) the last save holds
        self.drained = 0
        self._batch: list | None = None  # the batch of the step under way (feedback looks at it after)
        self._checked = False  # the first batch checked against the model, on every rank

    def _source_state(self) -> tuple[dict, dict]:
        """A save's extra tensors and JSON: the source's state, whose own count of samples is
        what the save holds (the source ingests on while the save is written); noted as the
        last save's (step, samples)."""
        tensors = source_tensors(self.source, self.rank)
        seen = tensors.get(f"stream/rank_{self.rank:05d}/seen")
        self._saved = (self.trainer.step, 0 if seen is None else int(seen.shape[0]))
        extra = {"campaign": self.config.campaign}
        if self.feedback is not None:
            extra[FEEDBACK_KEY] = self.feedback.state()  # collective: every rank saves, and so gathers
        return tensors, extra

    def _stopping(self) -> bool:
        """A stop asked for here: a signal, or the trainer's own flag (the loader agrees on it)."""
        from hpcml import stop

        return self.trainer.stop_requested or stop.requested() is not None

    # -- phases ---------------------------------------------------------------------------------
    def run(self) -> OnlineResult:
        lifeline.start()  # in a campaign: exit if the driver or this launch is gone
        self._resume()
        self._start()
        t0 = time.perf_counter()
        self._train()
        if self.loader.stopped:
            return self._stopped()
        train_s = time.perf_counter() - t0
        if not self._drain():
            return self._stopped()
        return self._finish(train_s)

    def _resume(self) -> None:
        from hpcml.train.checkpointing import load_trainer

        cfg = self.config
        if not cfg.resume:
            return
        path: str | Path | None = cfg.ckpt_dir
        if getattr(self.grid, "pop", 1) > 1:  # a population: the newest step every member holds
            from hpcml.train.population_online import member_resume

            path = member_resume(cfg.ckpt_dir, self.grid, required=False)
        elif not (Path(cfg.ckpt_dir) / "latest").exists():
            path = None
        if path is None:
            return
        check_campaign(path, cfg.campaign)  # every rank, before any collective
        report = load_trainer(self.trainer, path)
        if self.trainer.step > self.steps:  # every rank read the same step: all raise, nothing hangs
            raise ConfigError(f"resumed at step {self.trainer.step} from {report.path}, past steps={self.steps}: "
                              f"nothing would be trained; give steps >= {self.trainer.step} (the learning-rate "
                              f"schedule stretches from the saved step)")
        self.source.load_state(load_source_states(report.path))
        if self.feedback is not None:
            self.feedback.load_state(report.extra.get(FEEDBACK_KEY), self.trainer.step)
        self.resumed_at = self.trainer.step
        self._saved = (self.trainer.step, int(self.source.stats()["samples"]))
        if self.rank == 0:
            logger.info("resumed at step %d from %s (saved on %s); buffer %d samples%s", self.trainer.step,
                        report.path, report.layout, len(self.source.buffer),
                        "; the step budget is spent: only the stream is taken in" if self.trainer.step == self.steps
                        else "")

    def _start(self) -> None:
        from hpcml.contract import write_endpoints

        self.source.start()
        endpoint = self.source.endpoint
        endpoints = waiting.gather(self.comm, endpoint)  # the ranks' servers start at their own pace
        caps = self.comm.gather(self.source.max_connections)
        if self.rank == 0 and self.config.endpoints_file and endpoint is not None:
            # last: the campaign starts no simulation before every server listens
            write_endpoints(self.config.endpoints_file, self.config.campaign, endpoints, self.config.run,
                            max_connections=min((c for c in caps if c), default=None))

    def _train(self) -> None:
        """:meth:`TrainLoop.fit` on the loader's batches: the loader agrees over the ranks before
        every step whether all have a batch and whether to stop, so the step itself does not."""
        self.trainer.fit(self._next_batch, self.steps, hooks=[self._after_step], extra=self._step_extra,
                         agree_stop=False)

    def _next_batch(self, step: int) -> list | None:
        batch = self._batch = self.loader.next_batch()
        if batch is not None and not self._checked:
            self._check_first(batch)
            self._checked = True
        if batch is not None and self.feedback is not None and self.loader.novel:  # never trained on: how wrong first
            self.feedback.fresh(self.trainer, batch)
        return batch

    def _step_extra(self, batch: list) -> dict:
        buffer = self.source.buffer
        return {"buffer_len": len(buffer), "ingested": buffer.stats.ingested}

    def _after_step(self, trainer: TrainLoop, m: dict) -> None:
        if self.feedback is not None:
            step = trainer.step
            self.feedback.metrics["loss"] = float(m["loss"])
            if self.validate is not None and self.config.val_every and step % self.config.val_every == 0:
                self.feedback.metrics.update({**self.validate(), "val_step": float(step)})  # before the publish
            self.feedback.step(trainer, self._batch, step)
        if self.hook is not None:  # periodic saves (a stop is this run's to save: _stopped, after a quiesce)
            self.hook(trainer, m)
        if self.on_step is not None:
            self.on_step(m)

    def _check_first(self, batch) -> None:
        """The trainer's own check of the data (the model's output against the samples' shape),
        agreed by every rank before the first step: one rank's error is raised on all."""
        problem = self.trainer.check_batch(batch)
        first = batch[0] if batch else None
        shape = (first.sim, list(np.shape(first.fields))) if hasattr(first, "fields") else None
        views = waiting.allgather(self.comm, (problem, shape))
        found = [p for p, _ in views if p]
        shapes = {tuple(s[1]): s[0] for _, s in views if s is not None}
        if not found and len(shapes) > 1:
            (a, sa), (b, sb) = list(shapes.items())[:2]
            found = [f"simulation {sa}'s samples are {list(a)} (fields x grid), simulation {sb}'s {list(b)}: every "
                     f"sample of a training must share one grid"]
        if found:
            raise ConfigError(found[0])

    def _save(self) -> None:
        if self.feedback is not None and self.feedback.published_at != self.trainer.step:
            self.feedback.publish(self.trainer.step)  # the driver's view as of the last step (collective)
        if self.hook is not None:
            self.hook.save(self.trainer)

    def _stopped(self) -> OnlineResult:
        """Every rank, together: keep what arrived, save, say "not finished"."""
        from hpcml import stop

        self.source.quiesce()
        self.source.stop()  # nothing taken in after the save below could be kept: take nothing more
        self._save()
        stop.finished()
        ckpt = self.hook is not None
        if self.rank == 0:
            logger.info("stopped by signal at step %d%s", self.trainer.step,
                        " after saving" if ckpt else " (no ckpt_dir: nothing saved)")
        return OnlineResult("stopped" if ckpt else "failed", self.trainer.step, self.resumed_at,
                            [] if ckpt else ["stopped with no ckpt_dir: the run cannot be resumed"])

    def _drain(self) -> bool:
        """Keep the stream flowing until it ends on every rank (they agree each round, so they
        leave together); False if a stop came first."""
        from hpcml.stream.loader import agree_min

        buffer, flags = self.source.buffer, np.zeros(2, np.int32)
        while True:
            flags[:] = (int(buffer.ended), int(not self._stopping()))  # ended read first: the count is then final
            agree_min(self.comm, flags)
            if not flags[1]:
                return False
            if flags[0]:
                return True
            if buffer.config.policy != "reservoir" and len(buffer) >= buffer.config.capacity:
                self.drained += len(buffer.get(1, timeout=0.05) or [])  # full: make room, the stream flows on
            else:  # a reservoir never blocks the stream; room left keeps every sample for the checkpoint
                time.sleep(0.05)

    def _finish(self, train_s: float) -> OnlineResult:
        if self.feedback is not None and self.feedback.published_at != self.trainer.step:
            self.feedback.publish(self.trainer.step)  # collective: the last word on every simulation
        changed = self._saved != (self.trainer.step, int(self.source.stats()["samples"])) or self.drained
        if self.hook is not None and waiting.allreduce(self.comm, int(bool(changed))):
            self._save()  # the last periodic save holds this state otherwise
        if self.hook is not None:
            self.hook.close()
        loader = self.loader
        stats = waiting.gather(self.comm, {
            **self.source.stats(), "accounting": self.source.accounting(),
            "unused": loader.unused() + self.drained, "drained": self.drained, "starved_s": loader.starved_s,
            "agree_s": loader.agree_s, "train_s": train_s,
            "since_first_batch_s": time.perf_counter() - loader.t_first_batch if loader.t_first_batch else 0.0})
        self.source.stop()
        result = OnlineResult("ok", self.trainer.step, self.resumed_at)
        if self.rank == 0:
            history = self.trainer.history
            result.summary = summarize(stats, steps=self.trainer.step, batch=self.batch,
                                       world=self.comm.Get_size(),
                                       final_loss=history[-1]["loss"] if history else earlier_final_loss(
                                           self.config.summary_file, campaign=self.config.campaign,
                                           step=self.trainer.step))
            result.problems, result.notes = problems(result.summary, stats, self.trainer.step, batch=self.batch,
                                                     budget=self.steps, policy=self.source.buffer.config.policy)
            for note in result.notes:
                logger.warning(note)
        repeat = self.trainer.step == 0 and not any(s.get("error") for s in stats or [])  # the stream ended whole
        result.problems, result.notes, result.missing, result.repeat = waiting.bcast(self.comm, (  # one outcome
            result.problems, result.notes, result.summary.get("samples_missing", 0), repeat))  # on every rank
        result.status = "failed" if result.problems else "ok"
        if self.rank == 0 and self.config.summary_file:
            self.write_summary(result)
        return result

    def write_summary(self, result: OnlineResult, **more: Any) -> None:
        """Rank 0: the summary file the campaign reads (its campaign and run say whose it is);
        a figure that is NaN or infinite (a diverged loss) is null, or the campaign refuses it all."""
        safeio.write_json(self.config.summary_file, safeio.finite({
            **result.summary, **more, "status": result.status, "problems": result.problems, "notes": result.notes,
            "resumed_at": result.resumed_at, "campaign": self.config.campaign, "run": self.config.run,
            "time": time.time(), "pid": os.getpid()}))

