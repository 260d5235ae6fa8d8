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
import stat
from collections.abc import Mapping
from pathlib import Path

from hpcml.ensemble.sampling import Feedback, Sampler
from hpcml.errors import ConfigError
from hpcml.log import get_logger

logger = get_logger(__name__)

WAVES_FILE = "waves.jsonl"
MAX_BYTES = 256 << 20
"""The record is refused above this size before it is parsed (a million simulations of ten
parameters is ~200 MB)."""


class WavePlan:
    """``budget`` simulations in waves of ``size`` (the last one smaller), proposed by ``sampler``."""

    def __init__(self, run_dir: str | os.PathLike, sampler: Sampler, *, budget: int, size: int) -> None:
        for name, v in (("budget", budget), ("size", size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"WavePlan {name}={v!r}: expected an integer >= 1")
        if not isinstance(sampler, Sampler):
            raise ConfigError(f"WavePlan sampler={sampler!r}: expected a Sampler (propose, state_dict, "
                              f"load_state_dict)")
        self.path = Path(run_dir) / WAVES_FILE
        self.sampler, self.budget, self.size = sampler, budget, size
        self.waves: list[dict] = self._read()
        if self.waves:
            self.sampler.load_state_dict(self.waves[-1]["sampler"])
            logger.info("%d wave(s), %d simulation(s) recorded in %s: continuing from them", len(self.waves),
                        self.proposed, self.path)

    @property
    def proposed(self) -> int:
        return sum(len(w["ids"]) for w in self.waves)

    @property
    def done(self) -> bool:
        """Every simulation of the budget proposed."""
        return self.proposed >= self.budget

    @property
    def n_waves(self) -> int:
        return math.ceil(self.budget / self.size)

    def simulations(self) -> list[tuple[int, dict[str, float]]]:
        """Every recorded simulation: ``(sim_id, params)``, in order."""
        return [(i, dict(p)) for w in self.waves for i, p in zip(w["ids"], w["params"])]

    def next_wave(self, feedback: Feedback, feedback_step: int = 0) -> list[tuple[int, dict[str, float]]]:
        """Propose, record and return the next wave (empty once the budget is proposed)."""
        n = min(self.size, self.budget - self.proposed)
        if n <= 0:
            return []
        before = self.sampler.state_dict()
        try:
            return self._record(n, self.sampler.propose(n, feedback), feedback, feedback_step)
        except BaseException:
            self.sampler.load_state_dict(before)  # a wave not recorded was never proposed
            raise

    def _record(self, n: int, params: list, feedback: Feedback, feedback_step: int) -> list[tuple[int, dict]]:
        if len(params) != n or not all(isinstance(p, Mapping) for p in params):
            raise ConfigError(f"the sampler proposed {len(params)} parameter sets for a wave of {n}: expected {n} "
                              f"dicts of parameter values")
        first = self.proposed
        wave = {"wave": len(self.waves), "ids": list(range(first, first + n)),
                "params": [{str(k): float(v) for k, v in p.items()} for p in params],
                "sampler": self.sampler.state_dict(), "feedback_step": int(feedback_step),
                "feedback_sims": len(feedback)}
        try:
            line = json.dumps(wave, allow_nan=False) + "\n"
        except (TypeError, ValueError) as e:
            raise ConfigError(f"wave {wave['wave']} cannot be recorded as JSON ({e}): a sampler's state_dict() and "
                              f"proposals must be plain numbers, strings, lists and dicts") from None
        with open(self.path, "a") as f:  # appended and on disk before any simulation of it starts
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.waves.append(wave)
        logger.info("wave %d: simulations %d-%d proposed (feedback of %d simulations, step %d)", wave["wave"], first,
                    first + n - 1, len(feedback), feedback_step)
        return [(i, dict(p)) for i, p in zip(wave["ids"], wave["params"])]

    def _read(self) -> list[dict]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise ConfigError(f"{self.path}: {e.strerror}; expected a regular file") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ConfigError(f"{self.path}: not a regular file")
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            raise ConfigError(f"{self.path}: larger than {MAX_BYTES} bytes: not a wave record of this library")
        lines = data.split(b"\n")
        complete, torn = lines[:-1], lines[-1]
        if torn:
            logger.warning("%s: its last line is incomplete (a crash while it was written): dropped", self.path)
        waves: list[dict] = []
        for n, raw in enumerate(complete, 1):
            try:
                w = json.loads(raw)
                ok = (isinstance(w, dict) and w.get("wave") == len(waves) and isinstance(w.get("ids"), list)
                      and w["ids"] == list(range(sum(len(x["ids"]) for x in waves),
                                                 sum(len(x["ids"]) for x in waves) + len(w["ids"])))
                      and isinstance(w.get("params"), list) and len(w["params"]) == len(w["ids"])
                      and all(isinstance(p, dict) and all(isinstance(v, (int, float)) for v in p.values())
                              for p in w["params"]) and isinstance(w.get("sampler"), dict))
            except (ValueError, TypeError, KeyError):
                ok = False
            if not ok:
                raise ConfigError(f"{self.path}, line {n}: not the next wave of this record (wave {len(waves)}, "
                                  f"simulations numbered on from {sum(len(x['ids']) for x in waves)})")
            waves.append(w)
        return waves
