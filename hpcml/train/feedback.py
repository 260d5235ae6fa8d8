"""What online training knows about each simulation, published for the campaign's sampler
(issue 25: the surrogate steers the ensemble).

Every step counts the samples of each simulation trained on; every ``every`` steps the
trainer also evaluates its batch without gradients (:meth:`FieldTrainer.sample_losses`, one
forward: collective under FSDP, so every rank does it at the same steps) and keeps, per
simulation, an exponential average of the loss of its samples. Then rank 0 gathers every
rank's table (each rank trains on the simulations routed to it) and replaces
``run_dir/feedback.json`` atomically: ``{"campaign", "run", "step", "time", "params": [names],
"metrics": {"loss", "val_rel_l2", ...}, "sims": {sim: {"params": [...], "loss", "samples",
"age", "fresh", "surprise"}}}``, ``age`` being the steps since the simulation's loss was last evaluated.

``loss`` is in-sample: once trained on, a simulation's samples fit better than its
neighbourhood would, so a hard region whose simulations are memorised looks easy. The
trainer also measures each simulation the first time a batch brings it, before the step
that trains on it (:meth:`SimFeedback.fresh`; the loader makes every rank take that extra
forward at the same step): ``fresh`` is that out-of-sample loss -- how wrong the surrogate
was at these parameters before it saw them -- and ``surprise`` is ``fresh`` over the
training loss of the step before, comparable across the run (an untrained model is equally
wrong everywhere: ~1; later, a simulation in a region the surrogate has not learnt: >> 1). The driver reads it with
:func:`hpcml.ensemble.waves.read_feedback`. The table is saved with every checkpoint and
comes back on resume, so a resumed campaign's sampler sees the feedback it would have seen.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hpcml import safeio
from hpcml.errors import ConfigError
from hpcml.log import get_logger
from hpcml.numeric import is_int, is_real

logger = get_logger(__name__)

MAX_SIMS = 1 << 20
"""Simulations a checkpoint's table may hold (a campaign of more would want another format)."""


class SimFeedback:
    """Per-simulation loss, sample count and age; see the module docstring."""

    def __init__(self, *, path: str | Path | None, every: int, comm, param_names: Sequence[str] = (),
                 campaign: str = "", run: str = "", ema: float = 0.5) -> None:
        if not is_int(every) or every < 1:
            raise ConfigError(f"feedback every={every!r}: expected an integer >= 1 (steps between evaluations)")
        if not 0.0 < ema <= 1.0:
            raise ConfigError(f"feedback ema={ema!r}: expected a weight in (0, 1] of the newest evaluation")
        self.path, self.every, self.comm = (Path(path) if path else None), every, comm
        self.param_names, self.campaign, self.run, self.ema = list(param_names), campaign, run, ema
        self.sims: dict[int, dict[str, Any]] = {}
        self.metrics: dict[str, float] = {}
        """Run-wide figures published beside the table (the latest loss, a validation error)."""
        self.published_at: int | None = None
        self._published: dict[int, dict[str, Any]] | None = None  # the merged table, until the next step

    def step(self, trainer, batch, step: int) -> None:
        """After a training step on ``batch`` (collective every ``every`` steps)."""
        self._published = None  # every rank steps together: all drop it alike
        for s in batch:
            rec = self.sims.get(s.sim)
            if rec is None:
                rec = self.sims[s.sim] = self._new(s)
            rec["samples"] += 1
        if step % self.every:
            return
        losses = trainer.sample_losses(batch)
        for s, loss in zip(batch, losses):
            if not math.isfinite(loss):
                continue
            rec = self.sims[s.sim]
            if rec["at"] == step and rec["loss"] is not None:  # another sample of it in this batch: average in
                rec["loss"] = 0.5 * (rec["loss"] + float(loss))
            else:
                rec["loss"] = float(loss) if rec["loss"] is None else \
                    self.ema * float(loss) + (1 - self.ema) * rec["loss"]
            rec["at"] = step
        self.publish(step)

    @staticmethod
    def _new(sample) -> dict[str, Any]:
        return {"params": [float(v) for v in np.asarray(sample.params).ravel()], "loss": None, "samples": 0,
                "at": None, "fresh": None, "surprise": None}

    def novel(self, batch) -> bool:
        """Whether ``batch`` brings a simulation never trained on (for the loader's agreement)."""
        return any(s.sim not in self.sims for s in batch)

    def fresh(self, trainer, batch) -> None:
        """Before the step that trains on ``batch`` (collective: every rank, when the loader says
        any rank's batch is novel): each new simulation's loss on its samples here, and that
        over the last training loss (``surprise``)."""
        losses = trainer.sample_losses(batch)
        new: dict[int, tuple[Any, list[float]]] = {}  # sim -> (a sample of it, its losses here)
        for s, loss in zip(batch, losses):
            if s.sim not in self.sims and math.isfinite(loss):
                new.setdefault(s.sim, (s, []))[1].append(float(loss))
        ref = self.metrics.get("loss")
        if ref is None or not (math.isfinite(ref) and ref > 0):  # the first step: this batch is the reference
            ref = float(np.mean([v for v in losses if math.isfinite(v)] or [0.0]))
        for sim, (sample, mine) in new.items():
            rec = self.sims[sim] = self._new(sample)
            rec["fresh"] = float(np.mean(mine))
            rec["surprise"] = rec["fresh"] / ref if ref > 0 else None

    def merged(self) -> dict[int, dict[str, Any]]:
        """Every rank's table, merged (collective): per simulation the entry evaluated last."""
        out: dict[int, dict[str, Any]] = {}
        for table in self.comm.allgather(self.sims):
            for sim, rec in table.items():
                have = out.get(sim)
                if have is None or (rec["at"] or -1, rec["samples"]) > (have["at"] or -1, have["samples"]):
                    out[sim] = rec
        return out

    def publish(self, step: int) -> None:
        """Gather and, on rank 0, replace the file (collective)."""
        table = self._published = self.merged()
        self.published_at = step
        if self.path is None or self.comm.Get_rank() != 0:
            return
        names = self.param_names or [f"p{i}" for i in range(max((len(r["params"]) for r in table.values()),
                                                                 default=0))]
        safeio.write_json(self.path, {
            "campaign": self.campaign, "run": self.run, "step": step, "time": time.time(), "params": names,
            "metrics": {k: v for k, v in self.metrics.items() if math.isfinite(v)},
            "sims": {str(sim): {"params": r["params"], "loss": r["loss"], "samples": r["samples"],
                                "age": None if r["at"] is None else step - r["at"], "fresh": r.get("fresh"),
                                "surprise": r.get("surprise")}
                     for sim, r in sorted(table.items())}})

    # -- checkpoint ---------------------------------------------------------------------------
    def state(self) -> dict:
        """The merged table for a checkpoint's ``extra`` (collective, unless it was just published:
        every rank saves alike)."""
        table = self._published if self._published is not None else self.merged()  # a save follows a publish
        loss = self.metrics.get("loss")  # surprise's reference: a resumed run goes on from it
        return {"every": self.every, "sims": {str(k): v for k, v in sorted(table.items())},
                **({"loss": loss} if loss is not None and math.isfinite(loss) else {})}

    def load_state(self, state: dict | None, step: int) -> None:
        """Take back a checkpoint's table (saved at ``step``); a checkpoint from before feedback
        existed has none. Untrusted input: every entry is checked, in one line if it does not fit."""
        if state is None:
            return
        try:
            table = state["sims"]
            if len(table) > MAX_SIMS:
                raise ValueError(f"{len(table)} simulations, more than {MAX_SIMS}")
            sims = {}
            for k, v in table.items():
                rec = {"params": [float(x) for x in v["params"]],
                       "loss": None if v["loss"] is None else float(v["loss"]),
                       "samples": int(v["samples"]), "at": None if v["at"] is None else int(v["at"]),
                       **{k: None if v.get(k) is None else float(v[k]) for k in ("fresh", "surprise")}}
                width = len(self.param_names) if self.param_names else len(rec["params"])
                if (int(k) < 0 or len(rec["params"]) != width or not all(map(math.isfinite, rec["params"]))
                        or any(rec[x] is not None and not (math.isfinite(rec[x]) and rec[x] >= 0)
                               for x in ("loss", "fresh", "surprise"))
                        or rec["samples"] < 0 or (rec["at"] is not None and not 0 <= rec["at"] <= step)):
                    raise ValueError(f"simulation {str(k)[:20]}: {str(v)[:120]}")
                sims[int(k)] = rec
            loss = state.get("loss")
            if loss is not None and (not is_real(loss)
                                     or not math.isfinite(loss)):
                raise ValueError(f"loss {str(loss)[:40]}: expected a finite number")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ConfigError(f"the checkpoint's feedback table does not fit ({type(e).__name__}: {e})") from None
        self.sims = sims
        if loss is not None:
            self.metrics["loss"] = float(loss)
