"""The simulations of an adaptive campaign, wave by wave, recorded so that a resumed driver
runs the same ones (issue 25).

A :class:`WavePlan` asks its :class:`~hpcml.ensemble.sampling.Sampler` for the next wave
(from the trainer's feedback), numbers its simulations after the ones before, and appends
one line to ``run_dir/waves.jsonl`` -- the wave's simulation ids and parameters, the
sampler's state after it, the feedback step it saw -- flushed to disk before the wave is
handed out. A driver started again on the same run directory reads the file back: every
recorded wave is the same simulations with the same ids (so what completed is not run
again and what did not is run as recorded), and the sampler continues from its recorded
state, so the next wave is what the first driver would have proposed from that feedback.
A last line torn by a crash never reached a simulation and is dropped.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hpcml import safeio
from hpcml.ensemble.sampling import Feedback, Sampler, SimStats
from hpcml.ensemble.spec import SimSpec
from hpcml.errors import ConfigError
from hpcml.log import get_logger
from hpcml.numeric import is_int, is_real

logger = get_logger(__name__)

WAVES_FILE = "waves.jsonl"
MAX_BYTES = 256 << 20
"""The record is refused above this size before it is parsed (a million simulations of ten
parameters is ~200 MB)."""


@dataclass(frozen=True)
class FeedbackRecord:
    """The trainer's ``feedback.json``, checked."""

    step: int
    sims: dict[str, SimStats]
    metrics: dict[str, float]
    """Run-wide figures: ``loss`` (the latest training loss), ``val_rel_l2`` where the trainer
    validates periodically (``OnlineConfig.val_every``), ``val_step``."""


def read_feedback(path, *, campaign: str | None = None, run: str | None = None,
                  max_bytes: int = 64 << 20) -> tuple[int, dict[str, SimStats]]:
    """The trainer's ``feedback.json`` (:mod:`hpcml.train.feedback`): ``(step, {sim: SimStats})``,
    ``(0, {})`` while there is none (:func:`read_feedback_record` has its metrics too)."""
    rec = read_feedback_record(path, campaign=campaign, run=run, max_bytes=max_bytes)
    return rec.step, rec.sims


def read_feedback_record(path, *, campaign: str | None = None, run: str | None = None,
                         max_bytes: int = 64 << 20) -> FeedbackRecord:
    """Untrusted input: size-bounded before parsing, every field checked; another campaign's
    or run's file is refused naming both (ConfigError)."""
    rec = safeio.read_json(path, max_bytes)
    if rec is None:
        return FeedbackRecord(0, {}, {})
    for name, want in (("campaign", campaign), ("run", run)):
        if want is not None and rec.get(name) != want:
            raise ConfigError(f"{path}: written for {name} {rec.get(name)!r}, this is {want!r}")
    names, sims, step = rec.get("params"), rec.get("sims"), rec.get("step")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or not isinstance(sims, dict) \
            or not is_int(step) or step < 0:
        raise ConfigError(f"{path}: expected {{'step': int, 'params': [names], 'sims': {{...}}}}")
    metrics = rec.get("metrics", {})
    if not isinstance(metrics, dict) or not all(isinstance(k, str) and isinstance(v, (int, float))
                                                and not isinstance(v, bool) for k, v in metrics.items()):
        raise ConfigError(f"{path}: metrics must map names to numbers, got {str(metrics)[:80]}")
    out = {}
    for sim, r in sims.items():
        try:
            vals = r["params"]
            if not isinstance(vals, list) or len(vals) != len(names):
                raise ValueError(f"{len(vals) if isinstance(vals, list) else vals!r} parameters for {len(names)} names")
            loss = r["loss"]
            out[str(sim)] = SimStats(params={n: float(v) for n, v in zip(names, vals)},
                                     loss=float("nan") if loss is None else float(loss),
                                     samples=int(r["samples"]), age=0 if r["age"] is None else int(r["age"]),
                                     **{k: None if r.get(k) is None else float(r[k]) for k in ("fresh", "surprise")})
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{path}: simulation {str(sim)[:40]!r}: {type(e).__name__}: {e}") from None
    return FeedbackRecord(step, out, {k: float(v) for k, v in metrics.items()})


class WavePlan:
    """``budget`` simulations in waves of ``size`` (the last one smaller), proposed by ``sampler``."""

    def __init__(self, run_dir: str | os.PathLike, sampler: Sampler, *, budget: int, size: int) -> None:
        self._check(sampler, budget, size)
        self.path = Path(run_dir) / WAVES_FILE
        self.sampler, self.budget, self.size = sampler, budget, size
        self.ended: str | None = None
        """Why no wave follows (a target reached), once :meth:`end` recorded it."""
        self._initial = sampler.state_dict()
        self.waves: list[dict] = self._read()
        if self.waves:
            try:
                self.sampler.load_state_dict(self.waves[-1]["sampler"])
            except (ConfigError, TypeError, KeyError) as e:
                raise ConfigError(f"{self.path}, line {len(self.waves)}: the sampler's state is not one it can take "
                                  f"({e})") from None
            logger.info("%d wave(s), %d simulation(s) recorded in %s: continuing from them", len(self.waves),
                        self.proposed, self.path)

    @staticmethod
    def _check(sampler: Sampler, budget: int, size: int) -> None:
        for name, v in (("budget", budget), ("size", size)):
            if not is_int(v) or v < 1:
                raise ConfigError(f"WavePlan {name}={v!r}: expected an integer >= 1")
        if not isinstance(sampler, Sampler):
            raise ConfigError(f"WavePlan sampler={sampler!r}: expected a Sampler (propose, state_dict, "
                              f"load_state_dict)")
        capacity = getattr(sampler, "capacity", None)
        if isinstance(capacity, int) and budget > capacity:
            raise ConfigError(f"WavePlan budget={budget}: the sampler has {capacity} points")

    @property
    def proposed(self) -> int:
        return sum(len(w["ids"]) for w in self.waves)

    @property
    def done(self) -> bool:
        """Every simulation of the budget proposed, or the plan ended early."""
        return self.ended is not None or self.proposed >= self.budget

    def end(self, reason: str) -> None:
        """No more waves (recorded: a resumed driver proposes none either)."""
        self._append({"end": str(reason), "proposed": self.proposed})
        self.ended = str(reason)
        logger.info("no more waves after %d simulation(s): %s", self.proposed, reason)

    @property
    def n_waves(self) -> int:
        return math.ceil(self.budget / self.size)

    def simulations(self) -> list[tuple[int, dict[str, float]]]:
        """Every recorded simulation: ``(sim_id, params)``, in order."""
        return [(i, dict(p)) for w in self.waves for i, p in zip(w["ids"], w["params"])]

    def next_wave(self, feedback: Feedback, feedback_step: int = 0,
                  check: Callable[[int, dict[str, float]], object] | None = None) -> list[tuple[int, dict[str, float]]]:
        """Propose, record and return the next wave (empty once the budget is proposed).
        ``check(sim_id, params)`` runs on each before anything is recorded: one that raises
        leaves no wave behind, and the sampler where it was."""
        n = min(self.size, self.budget - self.proposed)
        if n <= 0 or self.ended is not None:
            return []
        before = self.sampler.state_dict()
        try:
            return self._record(n, self.sampler.propose(n, feedback), feedback, feedback_step, check)
        except BaseException:
            self.sampler.load_state_dict(before)  # a wave not recorded was never proposed
            raise

    def _record(self, n: int, params: list, feedback: Feedback, feedback_step: int, check) -> list[tuple[int, dict]]:
        if len(params) != n or not all(isinstance(p, Mapping) for p in params):
            raise ConfigError(f"the sampler proposed {len(params)} parameter sets for a wave of {n}: expected {n} "
                              f"dicts of parameter values")
        bad = [p for p in params if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in p.values())]
        if bad:
            raise ConfigError(f"the sampler proposed {bad[0]}: every parameter must be a finite number")
        first = self.proposed
        if check is not None:
            for i, p in enumerate(params):
                check(first + i, {str(k): float(v) for k, v in p.items()})
        wave = {"wave": len(self.waves), "ids": list(range(first, first + n)),
                "params": [{str(k): float(v) for k, v in p.items()} for p in params],
                "sampler": self.sampler.state_dict(), "feedback_step": int(feedback_step),
                "feedback_sims": len(feedback)}
        try:
            line = json.dumps(wave, allow_nan=False) + "\n"
        except (TypeError, ValueError) as e:
            raise ConfigError(f"wave {wave['wave']} cannot be recorded as JSON ({e}): a sampler's state_dict() and "
                              f"proposals must be plain numbers, strings, lists and dicts") from None
        self._append(line)
        self.waves.append(wave)
        logger.info("wave %d: simulations %d-%d proposed (feedback of %d simulations, step %d)", wave["wave"], first,
                    first + n - 1, len(feedback), feedback_step)
        return [(i, dict(p)) for i, p in zip(wave["ids"], wave["params"])]

    def _append(self, line: str | dict) -> None:
        """One line, on disk before anything it decides happens."""
        if isinstance(line, dict):
            line = json.dumps(line) + "\n"
        safeio.append(self.path, line, fsync=True, lines=True)

    def _check_recorded(self, w: dict, line: int, first: int) -> None:
        """A recorded wave is input (the group may write the run directory): no more simulations
        than the plan allows, and parameters the sampler could have proposed -- finite, its
        names, inside its bounds -- or it is refused, naming the file and line, before anything runs."""
        where = f"{self.path}, line {line}"
        if len(w["ids"]) > self.size or first + len(w["ids"]) > self.budget:
            raise ConfigError(f"{where}: wave {w['wave']} of {len(w['ids'])} simulations from id {first}: this plan "
                              f"runs waves of at most {self.size} and {self.budget} simulations in all")
        counted = _counters_past(w["sampler"], self._initial, drawn=first + len(w["ids"]), waves=w["wave"] + 1)
        if counted:
            raise ConfigError(f"{where}: the sampler's state says {counted}: more than this plan drew (a sampler "
                              f"counts at most the simulations and waves proposed since its start)")
        bounds = sampler_bounds(self.sampler)
        for sim, p in zip(w["ids"], w["params"]):
            bad = next((k for k, v in p.items() if isinstance(v, bool) or not math.isfinite(v)), None)
            if bad is not None:
                raise ConfigError(f"{where}: simulation {sim} has {bad}={p[bad]!r}: expected a finite number")
            if bounds is None:
                continue
            if set(p) != set(bounds):
                raise ConfigError(f"{where}: simulation {sim} has parameters {sorted(p)[:8]}, the sampler's are "
                                  f"{sorted(bounds)}")
            out = next((k for k, v in p.items() if not _inside(v, *bounds[k])), None)
            if out is not None:
                raise ConfigError(f"{where}: simulation {sim} has {out}={p[out]!r}, outside the sampler's bounds "
                                  f"{tuple(bounds[out])}")

    def _read(self) -> list[dict]:
        data = safeio.read_bytes(self.path, MAX_BYTES, "a wave record of this library")
        if data is None:
            return []
        lines = data.split(b"\n")
        complete, torn = lines[:-1], lines[-1]
        if torn:  # cut off, so that the next wave starts a line of its own
            logger.warning("%s: its last line is incomplete (a crash while it was written): dropped", self.path)
            fd = safeio.open_fd(self.path, os.O_RDWR)
            try:
                os.ftruncate(fd, len(data) - len(torn))
                os.fsync(fd)
            finally:
                os.close(fd)
        waves: list[dict] = []
        first = 0  # the id the next recorded wave starts at
        for n, raw in enumerate(complete, 1):
            w = safeio.parse_json(raw, f"{self.path}, line {n}")  # not JSON, too deep, 1e999: refused, saying which
            try:
                if isinstance(w, dict) and "end" in w and n == len(complete) and w.get("proposed") == first:
                    self.ended = str(w["end"])  # the plan ended there (a target reached)
                    break
                ok = (isinstance(w, dict) and w.get("wave") == len(waves) and isinstance(w.get("ids"), list)
                      and w["ids"] == list(range(first, first + len(w["ids"])))
                      and isinstance(w.get("params"), list) and len(w["params"]) == len(w["ids"])
                      and all(isinstance(p, dict) and all(isinstance(v, (int, float)) for v in p.values())
                              for p in w["params"]) and isinstance(w.get("sampler"), dict))
            except (ValueError, TypeError, KeyError):
                ok = False
            if not ok:
                raise ConfigError(f"{self.path}, line {n}: not the next wave of this record (wave {len(waves)}, "
                                  f"simulations numbered on from {first})")
            self._check_recorded(w, n, first)
            waves.append(w)
            first += len(w["ids"])
        return waves


def sampler_bounds(sampler) -> dict[str, tuple[float, float]] | None:
    """The parameter bounds of ``sampler`` (hpcml's samplers say them), or None."""
    bounds = getattr(sampler, "bounds", None)
    if bounds is None:
        bounds = getattr(getattr(sampler, "cube", None), "bounds", None)
    return {str(k): (float(v[0]), float(v[1])) for k, v in bounds.items()} if isinstance(bounds, Mapping) else None


def _counters_past(state, initial, *, drawn: int, waves: int, path: str = "") -> str | None:
    """The first of a recorded sampler state's counters (``drawn``, ``wave``, nested states
    too) past what the plan proposed since the sampler's ``initial`` state, as ``path=value``."""
    if not isinstance(state, Mapping):
        return None
    initial = initial if isinstance(initial, Mapping) else {}
    for k, v in state.items():
        start = initial.get(k)
        start = start if type(start) is int else 0
        if k in ("drawn", "wave") and type(v) is int and v > start + (drawn if k == "drawn" else waves):
            return f"{path}{k}={v}"
        if isinstance(v, Mapping) and (found := _counters_past(v, initial.get(k), drawn=drawn, waves=waves,
                                                               path=f"{path}{k}.")):
            return found
    return None


def _inside(v: float, lo: float, hi: float) -> bool:
    slack = 1e-9 * max(abs(lo), abs(hi), 1.0)  # a bound mapped back from the unit cube
    return lo - slack <= v <= hi + slack


def rank_idle(running: list[int], ranks: int) -> bool:
    """Whether a streaming trainer rank has no running simulation routed to it: it cannot step
    (every rank needs a batch), so the others' simulations may be blocked on a full buffer and
    the wave would never end -- the next wave must come now."""
    from hpcml.stream.routing import route

    return len({route(i, ranks) for i in running}) < ranks


class Waves:
    """An adaptive campaign's simulations for :class:`~hpcml.ensemble.runner.Run`: ``make(sim_id,
    params) -> SimSpec`` builds each one the :class:`WavePlan` proposes; the next wave is
    proposed once ``trigger`` of the last one has ended (or nothing runs). The plan is opened
    (its record read) only once the run directory is claimed."""

    def __init__(self, make: Callable[[int, dict[str, float]], SimSpec], sampler: Sampler, *, budget: int, size: int,
                 trigger: float = 0.5, target: tuple[str, float] | None = None) -> None:
        if not callable(make):
            raise ConfigError(f"simulation={make!r}: expected a function (sim_id, params) -> SimSpec")
        if not is_real(trigger) or not 0 < trigger <= 1:
            raise ConfigError(f"wave_trigger={trigger!r}: expected the fraction in (0, 1] of a wave that must end "
                              f"before the next is proposed")
        WavePlan._check(sampler, budget, size)
        if target is not None and not (isinstance(target, tuple) and len(target) == 2 and isinstance(target[0], str)
                                       and is_real(target[1])):
            raise ConfigError(f"target={target!r}: expected (metric name, value), e.g. ('val_rel_l2', 0.05)")
        self.make, self.sampler, self.budget, self.size, self.trigger = make, sampler, budget, size, trigger
        self.target = target
        self.definition = {"budget": budget, "wave": size, "sampler": sampler.state_dict()}
        self.plan: WavePlan | None = None

    def open(self, run_dir: Path) -> list[SimSpec]:
        """Read the record; the simulations of the waves proposed before (a resumed campaign)."""
        self.plan = WavePlan(run_dir, self.sampler, budget=self.budget, size=self.size)
        return [self._spec(i, p) for i, p in self.plan.simulations()]

    def last_ids(self) -> list[int]:
        """The simulation ids of the last wave proposed (none yet: [])."""
        return list(self.plan.waves[-1]["ids"]) if self.plan is not None and self.plan.waves else []

    def due(self, ended: int, *, running: bool, idle: Callable[[], bool] = lambda: False) -> bool:
        """Whether the next wave is due, with ``ended`` of the last wave's simulations ended:
        none proposed yet, nothing runs, ``trigger`` of it has ended, or a trainer rank has no
        running simulation (``idle()``, asked last: it looks at every simulation in flight)."""
        last = self.last_ids()
        return not last or not running or ended >= self.trigger * len(last) or idle()

    def propose(self, contract) -> list[SimSpec]:
        """The next wave, from the trainer's feedback file (none yet, or unreadable: no feedback)."""
        rec = FeedbackRecord(0, {}, {})
        if contract is not None:
            try:
                rec = read_feedback_record(contract.feedback_file, campaign=contract.campaign)
            except ConfigError as e:
                logger.warning("the trainer's feedback is unusable (%s): this wave takes no feedback", e)
        step, feedback = rec.step, rec.sims
        if self.target is not None and self.plan.waves:
            name, bound = self.target
            value = rec.metrics.get(name)
            if value is not None and math.isfinite(value) and value <= bound:
                self.plan.end(f"{name} {value:.4g} <= {bound:g} at training step {step}")
                return []
        specs: dict[int, SimSpec] = {}
        check = lambda i, p: specs.__setitem__(i, self._spec(i, p))  # noqa: E731 -- built before it is recorded
        try:
            wave = self.plan.next_wave(feedback, feedback_step=step, check=check)
        except ConfigError as e:
            if not feedback:
                raise
            logger.warning("the sampler cannot use the trainer's feedback (%s): this wave takes none", e)
            specs.clear()
            wave = self.plan.next_wave({}, feedback_step=step, check=check)
        return [specs[i] for i, _ in wave]

    def report(self, run_dir: Path, contract) -> Path | None:
        """``run_dir/waves.png``: where the sampler went, coloured by wave and by loss."""
        from hpcml.ensemble.wave_report import write_wave_report

        if self.plan is None:
            return None
        try:
            _, feedback = read_feedback(contract.feedback_file, campaign=contract.campaign)
        except ConfigError:
            feedback = {}
        log = getattr(self.sampler, "log", None) or getattr(getattr(self.sampler, "cube", None), "log", frozenset())
        return write_wave_report(run_dir, self.plan.waves, feedback, frozenset(log))

    def _spec(self, sim_id: int, params: dict[str, float]) -> SimSpec:
        spec = self.make(sim_id, dict(params))
        if not isinstance(spec, SimSpec) or spec.sim_id != sim_id or dict(spec.params) != dict(params):
            raise ConfigError(f"simulation({sim_id}, {params}) returned {spec!r}: expected a SimSpec with sim_id="
                              f"{sim_id} and those params")
        return spec
