"""One model-agnostic training loop: what the LLM :class:`~hpcml.train.trainer.Trainer` and
the field surrogates' :class:`~hpcml.train.fields.FieldTrainer` share.

A step on a :class:`~hpcml.parallel.ParallelModel`: forward and backward (micro-batched,
pipelined, sharded -- the model's business), gradient sync, then one all-reduce of a
3-element tensor carrying the squared gradient norm, the loss and a stop request;
global-norm clipping, AdamW, the warmup + cosine schedule (:mod:`hpcml.train.schedule`),
metrics (``metrics.jsonl``, a line per step, appended across resumes), the progress line.

Its checkpoint state follows one protocol (:class:`Stateful`, what torchtitan calls
Stateful): tensors (parameters, optimizer moments, per-rank RNG) plus a JSON ``extra``;
:mod:`hpcml.train.checkpointing` saves and loads any Stateful on any layout.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hpcml import ckpt, log, safeio
from hpcml.errors import DivergenceError
from hpcml import stop as stop_flag
from hpcml.parallel.api import ParallelModel
from hpcml.train import memory, run_record
from hpcml.train.config import LoopConfig
from hpcml.train.resume_schema import check_loop_extra
from hpcml.train.schedule import WarmupCosine

logger = log.get_logger(__name__)

MAX_NONFINITE_IN_ROW = 10
"""Steps in a row whose loss or gradients are NaN or infinite (each skipped) before training
stops with :class:`~hpcml.errors.DivergenceError`: a bad batch is passed over, a diverged run
ends before its saves of NaN weights rotate the good ones out."""


def make_optimizer(params, cfg: LoopConfig, schedule: WarmupCosine | None = None
                   ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW without decay on 1-D parameters (norms, biases), and the warmup + cosine schedule."""
    params = list(params)
    schedule = schedule or WarmupCosine.of(cfg)
    # one group per (decay, mesh): foreach kernels take plain tensors or DTensors of one mesh, not
    # a mix (a MoE model has plain routers, tp-sharded attention and ep-sharded experts)
    groups: dict[tuple, list] = {}
    for p in params:
        mesh = p.device_mesh if isinstance(p, DTensor) else None
        groups.setdefault((p.dim() >= 2, id(mesh)), []).append(p)
    opt = torch.optim.AdamW([{"params": ps, "weight_decay": cfg.weight_decay if decay else 0.0}
                             for (decay, _), ps in groups.items()] or [{"params": []}],
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=True)
    # a lambda, so LambdaLR's state_dict never carries the schedule (its resume rule is ours)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule(s))


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class Stateful(Protocol):
    """What a checkpoint holds of a trainer (:mod:`hpcml.train.checkpointing`)."""

    step: int

    def state_tensors(self, create: bool = False) -> dict[str, torch.Tensor]: ...

    def tensor_attrs(self) -> dict[str, dict]: ...

    def state_extra(self) -> dict: ...

    def load_state_extra(self, extra: dict, *, step: int | None = None, where: object = "") -> None: ...


class TrainLoop:
    """The loop on a :class:`ParallelModel`. A subclass says how a batch becomes model inputs
    and targets (:meth:`inputs`) and what its throughput counts (:meth:`step_metrics`).

    ``hooks`` run as ``hook(trainer, metrics)`` after every step of :meth:`fit`: where
    checkpointing attaches.
    """

    def __init__(self, model: ParallelModel, config: LoopConfig,
                 hooks: list[Callable[[TrainLoop, dict], None]] | None = None) -> None:
        self.model, self.config, self.grid = model, config, model.grid
        self.device = self.grid.torch.device
        self.hooks = list(hooks or [])
        self.schedule = WarmupCosine.of(config)
        self.optimizer, self.scheduler = make_optimizer(model.parameters(), config, self.schedule)
        self.step = 0
        self.end_step: int | None = None
        """The step the last :meth:`fit` trains to (None before one): a checkpoint hook saves that step."""
        self.history: list[dict] = []
        self.skipped_steps = 0
        """Steps whose loss or gradients were NaN or infinite: not applied (``"skipped"`` in their metrics)."""
        self.nonfinite_in_row = 0
        self.divergence_waits = False
        """Set by a population's selection (a tournament, PBT), which replaces a diverged member's
        model: such a member skips its steps until a round does, instead of ending the job."""
        self.diverged = False
        """Waiting so (:attr:`divergence_waits`): its last :data:`MAX_NONFINITE_IN_ROW` steps or more were skipped."""
        self.stop_requested = False
        """Set on any rank to stop after the current step on all (a signal does this through :mod:`hpcml.stop`)."""
        self._metrics_file = None
        self._pending_config: str | None = None
        """config.json, not written over an earlier run's until this one's first step says whether it resumes it."""
        if config.run_dir and self.grid.rank == 0:
            Path(config.run_dir).mkdir(parents=True, exist_ok=True)
            shape = getattr(model.parts[0], "config", None) if getattr(model, "parts", None) else None
            record = json.dumps(
                {"train": asdict(config), "layout": self.grid.layout.degrees, "parallel": asdict(model.config),
                 # the model's own config where it has one (hpcml plan calibrate reads the blocks from it)
                 **({"model": shape.to_dict()} if hasattr(shape, "to_dict") else {})}, indent=1, default=str)
            if run_record.holds_run(config.run_dir):
                self._pending_config = record
            else:
                safeio.replace(Path(config.run_dir) / "config.json", record)
        self.account = memory.account_of(model) if config.memory_account else None
        # dp ranks draw different randomness (e.g. dropout); tp / cp / pp ranks of one replica agree
        torch.manual_seed(config.seed + 1 + self.grid.coords["dp"])

    # -- what a subclass says ------------------------------------------------------------
    def inputs(self, batch: Any) -> tuple[tuple[torch.Tensor, ...] | torch.Tensor, torch.Tensor]:
        """(model inputs, targets) on this rank's device."""
        raise NotImplementedError

    def every_stage(self, batch: Any) -> dict[str, torch.Tensor]:
        """Keyword inputs of ``batch`` every pipeline stage takes (:meth:`ParallelModel.forward_backward`)."""
        return {}

    def check_batch(self, batch: Any) -> str | None:
        """Why this model cannot train on ``batch`` (the first one: e.g. its output's shape is
        not the targets'), in one line, or None; online training agrees on it over the ranks
        before the first step, so a deterministic mistake fails at once, on every rank."""
        return None

    def n_micro(self) -> int:
        return 1

    #: Whether :meth:`sample_losses` gives each sample's loss (online feedback reports them).
    per_sample_losses = False

    def sample_losses(self, batch: Any) -> list[float]:
        """The loss of each sample of ``batch`` on its own, without gradients."""
        raise NotImplementedError(f"{type(self).__name__} gives no per-sample losses")

    def samples_per_step(self) -> int | None:
        """Samples this rank trains on per step when its batches come from a sample source
        (online training): the config's ``batch`` where it has one; None: it takes none."""
        return getattr(self.config, "batch", None)

    def step_metrics(self, batch: Any, dt: float) -> dict[str, Any]:
        return {}

    def progress_line(self, m: dict, end: int) -> str:
        return f"[train] step {m['step']}/{end} loss {m['loss']:.4e} gnorm {m['grad_norm']:.3f} lr {m['lr']:.2e}"

    # -- a step ----------------------------------------------------------------------------
    def train_step(self, batch: Any, extra: dict | None = None, *, agree_stop: bool = True) -> dict[str, Any]:
        """One optimizer step; ``agree_stop=False``: the stop was agreed before it (the batch
        source did), so its one collective does not carry the stop flag."""
        cfg, lay = self.config, self.grid.layout
        t0 = time.perf_counter()
        self.model.train()
        x, y = self.inputs(batch)
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if cfg.bf16 else None
        with self.account or contextlib.nullcontext():
            loss = self.model.forward_backward(x, y, self.n_micro(), autocast, self.every_stage(batch))
        self.model.sync_grads()
        names = self.model.stat_names
        share = torch.zeros(3 + len(names), dtype=torch.float64)
        share[0] = self.model.local_sq_grad_norm()
        if loss is not None:  # last pipeline stage: every (dp, cp, tp) rank holds one share of the mean
            share[1] = loss / (lay.dp * lay.cp * lay.tp)
        share[2] = float(agree_stop and (self.stop_requested or stop_flag.requested() is not None))
        share[3:] = torch.tensor(self.model.step_stats(), dtype=torch.float64)
        share = share.to(self.device)
        dist.all_reduce(share, group=self.grid.torch.group)  # the step's one collective beyond the engines' own
        sq_norm, global_loss, stop, *stats = share.tolist()
        grad_norm = math.sqrt(sq_norm) if sq_norm >= 0 else math.nan
        finite = math.isfinite(global_loss) and math.isfinite(grad_norm)  # the same on every rank: all-reduced
        if finite:
            self.nonfinite_in_row, self.diverged = 0, False
            if cfg.grad_clip > 0:
                from hpcml.parallel.clip import scale_grads

                scale_grads(self.model.parameters(), grad_norm, cfg.grad_clip)
            self.optimizer.step()
            self.model.after_step()
        else:  # skipped, as Megatron skips an overflowed step: one NaN update would make every weight NaN
            self._nonfinite(global_loss, grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()  # skipped or not: the schedule follows the step count (a resume finds them agreeing)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        self.step += 1
        m: dict[str, Any] = {"step": self.step, "loss": global_loss, "grad_norm": grad_norm, "lr": lr, "step_s": dt,
                             **({} if finite else {"skipped": True}),
                             **self.step_metrics(batch, dt), "peak_mem_mb": peak_memory_mb(self.device),
                             "stop": stop > 0, "time": time.time(), **dict(zip(names, stats)),
                             **self.model.take_comm_bytes(), **(extra or {}),
                             **self.after_update()}
        if self.account is not None:
            m.update(memory.summary(self.account.take()))
        self.history.append(m)
        self._report(m, max(cfg.steps, self.step))
        return m

    def _nonfinite(self, loss: float, grad_norm: float) -> None:
        """A step whose loss or gradient norm is NaN or infinite is not applied; after
        :data:`MAX_NONFINITE_IN_ROW` in a row training stops (on every rank at once)."""
        self.nonfinite_in_row += 1
        self.skipped_steps += 1
        step = self.step + 1
        if self.nonfinite_in_row >= MAX_NONFINITE_IN_ROW:
            why = (f"training diverged: the loss or the gradient norm was NaN or infinite at {self.nonfinite_in_row} "
                   f"steps in a row (steps {step - self.nonfinite_in_row + 1}-{step}: loss {loss}, gradient norm "
                   f"{grad_norm}); none was applied, so the weights are those of step {step - self.nonfinite_in_row}")
            if not self.divergence_waits:
                raise DivergenceError(f"{why} -- lower the learning rate, or look for non-finite values in the data "
                                      f"those steps read")
            if not self.diverged and self.grid.rank == 0:
                logger.warning("%s: this member's steps are skipped until a selection round gives it another "
                               "member's model", why)
            self.diverged = True
            return
        if self.grid.rank == 0:
            logger.warning("step %d skipped: loss %s, gradient norm %s (%d in a row; at %d %s)", step, loss, grad_norm,
                           self.nonfinite_in_row, MAX_NONFINITE_IN_ROW,
                           "this member waits for a selection round" if self.divergence_waits else "training stops")

    def after_update(self) -> dict[str, Any]:
        """Figures of the weights just updated, for this step's metrics (a validation loss);
        called on every rank after the optimizer step (collectives allowed)."""
        return {}

    def fit(self, next_batch: Callable[[int], Any], steps: int | None = None, *,
            hooks: Sequence[Callable[[TrainLoop, dict], None]] = (), extra: Callable[[Any], dict] | None = None,
            agree_stop: bool = True) -> list[dict]:
        """Train on ``next_batch(step)`` until ``steps`` (default ``config.steps``) steps are done
        in total, ``next_batch`` gives None (a source that ended or stopped: agreed over the
        ranks, so all leave together), or a stop was asked for on any rank. ``hooks`` run after
        each step, after the trainer's own; ``extra(batch)`` adds figures to the step's metrics.
        ``agree_stop=False``: ``next_batch`` agrees on a stop itself before every step (a
        :class:`~hpcml.stream.loader.StreamLoader`), so the step does not: one agreement a step."""
        end = steps if steps is not None else self.config.steps
        self.end_step = end
        while self.step < end:
            batch = next_batch(self.step)
            if batch is None:
                break
            metrics = self.train_step(batch, extra(batch) if extra is not None else None, agree_stop=agree_stop)
            for hook in (*self.hooks, *hooks):
                hook(self, metrics)
            if metrics["stop"]:
                logger.warning("stopping after step %d as asked (signal)", self.step)
                break
        return self.history

    def _report(self, m: dict, end: int) -> None:
        if self.grid.rank != 0:
            return
        if self.config.run_dir:
            if self._pending_config is not None:  # an earlier run's record: continued if resumed, else set aside
                if m["step"] == 1:
                    run_record.set_aside(self.config.run_dir)
                safeio.replace(Path(self.config.run_dir) / "config.json", self._pending_config)
                self._pending_config = None
            if self._metrics_file is None:  # appended: a resumed run's history shows the steps it redid
                self._metrics_file = os.fdopen(safeio.open_fd(Path(self.config.run_dir) / "metrics.jsonl",
                                                              os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a")
            self._metrics_file.write(json.dumps(m) + "\n")
            self._metrics_file.flush()
        if self.config.progress and (m["step"] % self.config.log_every == 0 or m["step"] == end):
            last = m["step"] == end
            print(self.progress_line(m, end), end="\n" if last or not sys.stderr.isatty() else "\r",
                  file=sys.stderr, flush=True)

    # -- checkpoint state (Stateful) -----------------------------------------------------------
    def state_tensors(self, create: bool = False) -> dict[str, torch.Tensor]:
        self.model.reshard()  # an evaluation just before left FSDP's root gathered: save the shards and their moments
        tensors = ckpt.training_tensors(self.model.named_parameters(), self.optimizer, create=create)
        tensors[f"rank_state/rank_{self.grid.rank:05d}/torch_rng"] = torch.get_rng_state()
        return tensors

    def tensor_attrs(self) -> dict[str, dict]:
        return self.model.plan.tensor_attrs()

    def state_extra(self) -> dict:
        return {"step": self.step, "scheduler": self.scheduler.state_dict(), "schedule": self.schedule.state(),
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
                "train_config": asdict(self.config)}

    def load_state_extra(self, extra: dict, *, step: int | None = None, where: object = "") -> None:
        """Step, optimizer hyper-parameters and schedule; a changed ``steps`` stretches the
        schedule from the saved step (:mod:`hpcml.train.schedule`). ``extra`` is checked first
        (:mod:`hpcml.train.resume_schema`) against ``step``, the manifest's (``where``: the checkpoint)."""
        check_loop_extra(extra, extra.get("step") if step is None else step, where or "being resumed",
                         self.scheduler.state_dict(), self.optimizer.param_groups)
        self.step = int(extra["step"])
        # parameter groups are one per (decay, mesh): another layout may have another count
        n = len(self.optimizer.param_groups)
        state = {k: ([v[0]] * n if isinstance(v, list) and v and k in ("base_lrs", "_last_lr") else v)
                 for k, v in extra["scheduler"].items()}
        self.scheduler.load_state_dict(state)
        saved = extra.get("schedule") or {"steps": extra["train_config"]["steps"], "anchor": None}
        self.schedule.resume(self.step, saved)
        for group in self.optimizer.param_groups:  # the saved group of the same kind (decayed or not)
            same = [g for g in extra["param_groups"] if (g.get("weight_decay", 0) > 0) == (group["weight_decay"] > 0)]
            saved_group = (same or extra["param_groups"])[0]
            group.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in saved_group.items()
                          if k != "weight_decay" or same})
            group["lr"] = group["initial_lr"] * self.schedule(self.step)
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        if int(saved["steps"]) != self.config.steps and self.grid.rank == 0:
            logger.info("steps %d -> %d on resume at step %d: the schedule is stretched from lr %.3e",
                        int(saved["steps"]), self.config.steps, self.step, self.scheduler._last_lr[0])

    def close(self) -> None:
        if self._metrics_file:
            self._metrics_file.close()
            self._metrics_file = None


__all__ = ["LoopConfig", "Stateful", "TrainLoop", "make_optimizer"]
