"""A hyperparameter search whose trials are parallel training jobs, run through Parsl on a
Site as a campaign's simulations are (:mod:`hpcml.ensemble.apps`): each (trial, rung) is an
MPI job of its own layout (``mpiexec``/``srun``, Parsl's retries, the attempts' provenance,
killed with its driver), and its decisions come from :mod:`hpcml.ensemble.asha`.

    search = Search(config=SearchConfig(method="asha", space={"lr": [1e-4, 3e-4, 1e-3, 3e-3]},
                                        min_steps=8, max_steps=72, eta=3, metric="val_loss"),
                    argv=["python", "train.py", "--lr", "{lr}", "--steps", "{steps}",
                          "--run-dir", "{trial_dir}", "--ckpt-dir", "{trial_dir}/ckpt", "--auto-resume"],
                    run_dir="runs/search", site="local", ranks=2, max_concurrent=2)
    result = search.run()            # search.run(resume=True) after a driver kill or walltime

The trial's program: trains to ``--steps`` (``{steps}``: the rung's), continues from its own
checkpoint when run again with more steps (a promotion, a retry, a requeue), and appends its
metrics as JSON lines with ``step`` to ``{trial_dir}/metrics.jsonl`` -- ``metric`` at the
rung's last step is its score. ``llm_pretrain.py`` (``--val-data``) and any
:class:`~hpcml.train.loop.TrainLoop` with a run directory do. Every finished (trial, rung)
is a line of ``run_dir/search.jsonl``; a rerun with ``resume=True`` rebuilds the state from
it and runs only what is left; ``search_result.json`` is the outcome.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpcml import safeio, stop
from hpcml.ensemble import apps, attempt_text, attempts
from hpcml.ensemble.asha import Asha, SearchConfig, configurations
from hpcml.ensemble.parsl_build import executor_label, resolve_config
from hpcml.ensemble.site import Site, load_site
from hpcml.ensemble.spec import SimSpec
from hpcml.env import NOT_FINISHED
from hpcml.errors import ConfigError, HpcmlError
from hpcml.log import get_logger
from hpcml.numeric import is_int, is_real

logger = get_logger(__name__)

RECORD, DEFINITION, RESULT = "search.jsonl", "search.json", "search_result.json"
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_MAX_LINE = 1 << 16  # a metrics or record line longer than this is not one of ours


class SearchError(HpcmlError, RuntimeError):
    """The search ended without every trial done: a trial's program failed, or wrote no score."""


class SearchInterrupted(HpcmlError, RuntimeError):
    """The walltime warning (SIGUSR1) or SIGTERM stopped the search: its running trials were
    ended and what finished is recorded. Exit with ``exit_code`` (75: ``hpcml job --driver``
    requeues the job) and run it again with ``resume=True``."""

    exit_code = NOT_FINISHED


@dataclass(kw_only=True)
class Search:
    """``argv``: the trial's program (without the MPI prefix) with ``{steps}``,
    ``{trial_dir}``, ``{trial}`` and ``{<name>}`` of each hyperparameter in ``config.space``.
    ``ranks``: each trial's MPI ranks, or ``"{name}"`` of a hyperparameter of whole numbers (a
    search over layouts: ``space={"ranks": [2, 4], "tp": [1, 2]}``, ``argv=[..., "--tp", "{tp}"]``);
    ``max_concurrent``: trials at once. ``site``: where
    (its Parsl config and launch line); ``parsl_config``: a Config (or a callable making one)
    instead of the site's. ``site_options``: pilot mode (nodes, walltime, account, queue)."""

    config: SearchConfig
    argv: Sequence[str]
    run_dir: str | Path
    site: Site | str = "local"
    ranks: int | str = 2
    max_concurrent: int = 2
    retries: int = 2
    timeout_s: float | None = None
    parsl_config: Any = None
    site_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.config, SearchConfig):
            raise ConfigError(f"config must be a SearchConfig, got {type(self.config).__name__}")
        if isinstance(self.argv, str) or not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ConfigError(f"argv must be a non-empty list of strings, got {self.argv!r}")
        known = {"steps", "trial_dir", "trial", *self.config.space}
        used = {m for a in self.argv for m in _PLACEHOLDER.findall(a)}
        if used - known:
            raise ConfigError(f"argv names {{{'}, {'.join(sorted(used - known))}}}: the placeholders are {{steps}}, "
                              f"{{trial_dir}}, {{trial}} and the space's {sorted(self.config.space)}")
        if "steps" not in used:
            raise ConfigError("argv has no {steps}: each rung trains the trial to its own number of steps")
        ranked = _PLACEHOLDER.fullmatch(self.ranks) if isinstance(self.ranks, str) else None
        if ranked and ranked.group(1) not in self.config.space:
            raise ConfigError(f"ranks={self.ranks!r}: the space has no {ranked.group(1)!r} (it has "
                              f"{sorted(self.config.space)})")
        for name in ("max_concurrent",) if ranked else ("ranks", "max_concurrent"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r}: expected an int >= 1"
                                  + (" or '{name}' of a hyperparameter" if name == "ranks" else ""))
        if not is_int(self.retries) or self.retries < 0:
            raise ConfigError(f"retries={self.retries!r}: expected an int >= 0")
        if self.timeout_s is not None and not (is_real(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"timeout_s={self.timeout_s!r}: expected seconds > 0 or None")
        if self.parsl_config is None:
            self.site = load_site(self.site)  # an unknown site is refused before the run directory is touched
        self.run_dir = Path(self.run_dir).resolve()
        self.trials = configurations(self.config)
        if ranked:
            odd = sorted({repr(t[ranked.group(1)]) for t in self.trials
                          if not is_int(t[ranked.group(1)]) or t[ranked.group(1)] < 1})
            if odd:
                raise ConfigError(f"ranks={self.ranks!r}: its values {', '.join(odd)} are not whole numbers >= 1")
        self.restarted: list[int] = []
        """Trials whose program went back to step 1 at a promotion (it did not resume)."""

    # -- what a trial runs -----------------------------------------------------------------
    def trial_dir(self, trial: int) -> Path:
        return self.run_dir / "trials" / f"trial_{trial:04d}"

    def command(self, trial: int, rung: int) -> list[str]:
        values = {**{k: _text(v) for k, v in self.trials[trial].items()}, "steps": str(self.config.rungs[rung]),
                  "trial_dir": str(self.trial_dir(trial)), "trial": str(trial)}
        return [_PLACEHOLDER.sub(lambda m: values[m.group(1)], a) for a in self.argv]

    def spec(self, trial: int, rung: int) -> SimSpec:
        params = {**self.trials[trial], "trial": trial, "rung": rung, "steps": self.config.rungs[rung]}
        return SimSpec(sim_id=trial * len(self.config.rungs) + rung, params=params, argv=self.command(trial, rung),
                       ranks=self.trial_ranks(trial), stream=False, identity_args=False)

    def trial_ranks(self, trial: int) -> int:
        """The MPI ranks of ``trial``'s jobs (its own where ``ranks`` names a hyperparameter)."""
        if isinstance(self.ranks, str):
            return int(self.trials[trial][self.ranks[1:-1]])
        return self.ranks

    def score(self, trial: int, rung: int) -> float:
        """The trial's ``metric`` at the rung's last step, from its metrics.jsonl (untrusted:
        bounded lines, no link out of the run directory); SearchError when there is none."""
        steps, path = self.config.rungs[rung], self.trial_dir(trial) / "metrics.jsonl"
        found, furthest = None, 0
        for line in safeio.iter_lines(path, _MAX_LINE, root=self.run_dir):
            try:
                rec = safeio.parse_json(line, str(path), constants=True)  # a diverged loss is NaN
            except safeio.FileRefused:
                continue  # a torn line of a killed attempt
            if not isinstance(rec, dict) or not is_int(rec.get("step")):
                continue
            if rec["step"] == 1 and furthest >= self.config.rungs[0] and trial not in self.restarted:
                self.restarted.append(trial)  # back to step 1 after a finished rung: no checkpoint resumed
                logger.warning("trial %d went back to step 1 after %d steps: its program did not continue from its "
                               "checkpoint (save at the end of each rung and resume, e.g. llm_pretrain.py "
                               "--ckpt-every %d --auto-resume), so its promotions retrain from scratch",
                               trial, furthest, self.config.rungs[0])
            furthest = max(furthest, rec["step"])
            if rec["step"] == steps and is_real(rec.get(self.config.metric)):
                found = float(rec[self.config.metric])
        if found is None:
            raise SearchError(f"trial {trial} ({self.trials[trial]}) ended rung {rung} without a "
                              f"{self.config.metric!r} at step {steps} in {path}: its program must write that "
                              f"metric there (e.g. llm_pretrain.py --run-dir {{trial_dir}} --val-data FILE)")
        return found

    # -- the run -----------------------------------------------------------------------------
    def run(self, *, resume: bool = False) -> SearchResult:
        """Run the search to its end (or the rest of it, ``resume``); its result, also in
        ``run_dir/search_result.json``. SearchError when a trial failed (after the others)."""
        t0 = time.monotonic()
        stop.install()  # the walltime warning: before anything is started
        apps.claim(self.run_dir, resume=resume, stream=False)
        self._check_definition()
        state = Asha(self.config, len(self.trials))
        for rec in self._recorded():
            (state.fail(rec["trial"], rec["rung"], rec["why"]) if rec["status"] == "failed"
             else state.report(rec["trial"], rec["rung"], rec["score"]))
        resumed = sum(len(r) for r in state.scores)
        cfg = self._parsl_config()
        import parsl

        try:
            parsl.load(cfg)
        except Exception as e:
            raise ConfigError(f"parsl.load failed ({type(e).__name__}: {e}); a config already loaded in this "
                              f"process: parsl.dfk().cleanup() and parsl.clear() first") from e
        try:
            self._loop(state, executor_label(cfg))
        finally:
            try:
                parsl.dfk().cleanup()
            finally:
                parsl.clear()
        result = self._result(state, resumed, time.monotonic() - t0)
        safeio.write_json(self.run_dir / RESULT, asdict(result), root=self.run_dir)
        if state.failed:
            named = "; ".join(f"trial {t}: {why}" for t, why in sorted(state.failed.items())[:3])
            raise SearchError(f"{len(state.failed)} of {len(self.trials)} trials failed: {named} "
                              f"(all in {self.run_dir / RECORD})")
        return result

    def _loop(self, state: Asha, label: str) -> None:
        running: dict[concurrent.futures.Future, tuple[int, int]] = {}
        try:
            while True:
                while len(running) < self.max_concurrent and (job := state.next_job()) is not None:
                    state.start(*job)
                    self._make_trial_dir(job[0])
                    running[apps.simulation(self.spec(*job), run_dir=self.run_dir, site=self.site,
                                            timeout_s=self.timeout_s, executors=[label])] = job
                    logger.info("trial %d rung %d (%d steps) started: %s", *job, self.config.rungs[job[1]],
                                self.trials[job[0]])
                if not running:
                    return
                done, _ = concurrent.futures.wait(running, timeout=0.5,
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
                for f in done:
                    self._ended(state, *running.pop(f), f)
                if (why := stop.requested()) is not None:
                    raise SearchInterrupted(f"stopped by {why}: {len(running)} running trial(s) ended, every finished "
                                            f"job recorded in {self.run_dir / RECORD}; run again with resume=True")
        except BaseException:
            if running:  # the attempts' wrappers end their trial on CANCEL within a second
                logger.warning("cancelling %d running trial(s)", len(running))
                (self.run_dir / "sims" / attempts.CANCEL_FILE).touch()
                concurrent.futures.wait(running, timeout=30)
            raise

    def _make_trial_dir(self, trial: int) -> None:
        """The trial's directory, inside the run directory: a link planted on the way (the
        group may write the run directory) would send its checkpoints anywhere."""
        for path in (self.run_dir / "trials", self.trial_dir(trial)):
            if path.is_symlink():
                raise ConfigError(f"{path} is a symbolic link, not a directory of the search: refused")
            path.mkdir(exist_ok=True)

    def _ended(self, state: Asha, trial: int, rung: int, f: concurrent.futures.Future) -> None:
        if f.exception() is not None:
            why = attempt_text.describe(f.exception())[:500]
            state.fail(trial, rung, why)
            self._record({"trial": trial, "rung": rung, "status": "failed", "why": why})
            logger.warning("trial %d rung %d failed: %s", trial, rung, why)
            return
        score = self.score(trial, rung)
        state.report(trial, rung, score)
        self._record({"trial": trial, "rung": rung, "status": "ok", "score": None if math.isnan(score) else score,
                      "steps": self.config.rungs[rung]})
        logger.info("trial %d rung %d: %s = %.6g", trial, rung, self.config.metric, score)

    # -- the record --------------------------------------------------------------------------
    def _record(self, rec: dict) -> None:
        safeio.append(self.run_dir / RECORD, json.dumps(rec) + "\n", root=self.run_dir, lines=True, fsync=True)

    def _recorded(self) -> list[dict]:
        """The finished (trial, rung)s of earlier runs, each checked (a record is a file the
        group can write); a torn last line is a job that did not finish."""
        out, rungs = [], len(self.config.rungs)
        path = self.run_dir / RECORD
        for line in safeio.iter_lines(path, _MAX_LINE, root=self.run_dir):
            if not line.endswith(b"\n"):
                continue
            rec = safeio.parse_json(line, str(path))
            ok = (isinstance(rec, dict) and is_int(rec.get("trial")) and 0 <= rec["trial"] < len(self.trials)
                  and is_int(rec.get("rung")) and 0 <= rec["rung"] < rungs and rec.get("status") in ("ok", "failed"))
            if ok and rec["status"] == "ok":
                ok = rec.get("score") is None or is_real(rec["score"])
                if ok:
                    rec["score"] = math.nan if rec.get("score") is None else float(rec["score"])
            elif ok:
                ok = isinstance(rec.get("why"), str)
            if not ok:
                raise ConfigError(f"{path}: record {line[:200]!r} is not a search record of this search "
                                  f"({len(self.trials)} trials, {rungs} rungs)")
            out.append(rec)
        return out

    def _check_definition(self) -> None:
        now = json.loads(json.dumps({"config": {**asdict(self.config), "space": dict(self.config.space)},
                                     "argv": list(self.argv), "ranks": self.ranks}))
        path = self.run_dir / DEFINITION
        before = safeio.read_json(path, 1 << 20, root=self.run_dir, error=ConfigError, required=False)
        if before is None:
            safeio.write_json(path, now, root=self.run_dir)
        elif before != now:
            changed = sorted(k for k in set(now["config"]) | set(before.get("config", {}))
                             if now["config"].get(k) != before.get("config", {}).get(k))
            changed += [k for k in ("argv", "ranks") if now[k] != before.get(k)]
            raise ConfigError(f"{self.run_dir} holds a search defined otherwise ({', '.join(changed)} differ): "
                              f"resume it unchanged, or use a new run directory")

    def _parsl_config(self):
        return resolve_config(self.parsl_config, self.run_dir, lambda: self.site.parsl_config(
            run_dir=str(self.run_dir), max_concurrent_sims=self.max_concurrent,
            sim_ranks=max(self.trial_ranks(t) for t in range(len(self.trials))),
            retries=self.retries, **self.site_options))

    def _result(self, state: Asha, resumed: int, wall_s: float) -> SearchResult:
        best = state.best()
        rungs = self.config.rungs
        trials = [{"trial": t, "params": self.trials[t],
                   "scores": {str(rungs[r]): _json_score(state.scores[r][t]) for r in range(len(rungs))
                              if t in state.scores[r]},
                   **({"failed": state.failed[t]} if t in state.failed else {})} for t in range(len(self.trials))]
        grid = len(self.trials) * rungs[-1]
        used = state.trial_steps()
        return SearchResult(
            best_trial=None if best is None else best[0],
            best_params=None if best is None else self.trials[best[0]],
            best_score=None if best is None else _json_score(state.scores[best[1]][best[0]]),
            best_steps=None if best is None else rungs[best[1]], trials=trials, trial_steps=used, grid_steps=grid,
            saved_fraction=round(1 - used / grid, 4), resumed_jobs=resumed, restarted=sorted(self.restarted),
            wall_s=round(wall_s, 2))


@dataclass(kw_only=True)
class SearchResult:
    """``trial_steps``: steps trained in all, each promotion continuing its trial;
    ``grid_steps``: every trial to ``max_steps``; ``restarted``: trials whose program did not
    continue from its checkpoint (their promotions cost more than ``trial_steps`` says)."""

    best_trial: int | None
    best_params: dict | None
    best_score: float | None
    best_steps: int | None
    trials: list[dict]
    trial_steps: int
    grid_steps: int
    saved_fraction: float
    resumed_jobs: int
    restarted: list[int]
    wall_s: float


def _text(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _json_score(score: float) -> float | None:
    return None if math.isnan(score) else score


__all__ = ["Search", "SearchError", "SearchInterrupted", "SearchResult"]
