"""The campaign's pieces as Parsl apps, for a workflow of your own under your own loaded config.

    import parsl
    from hpcml.ensemble import apps
    parsl.load(my_config)                          # yours: any executors, retries, providers
    points = apps.design("lhs", bounds, 8, seed=0).result()
    futs = [apps.simulation(SimSpec(sim_id=i, params=p, argv=[...]), run_dir=run) for i, p in enumerate(points)]
    ...your own @python_app steps on the futures...
    apps.mark_done(run, futs)                      # tells a streaming trainer the campaign is over

A simulation is an MPI ``bash_app`` with its stream identity (``HPCML_SIM_ID``,
``HPCML_ATTEMPT``) and the exactly-once bookkeeping of :mod:`hpcml.ensemble.attempts`:
each Parsl retry claims the next attempt number on the worker, and every ended attempt
becomes a record in ``run_dir/provenance.jsonl``. The :class:`~hpcml.ensemble.Campaign`
is a convenience built on :func:`simulation_app`.
"""

from __future__ import annotations

import concurrent.futures
import math
import shlex
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcml.ensemble import attempts
from hpcml.ensemble.site import Site, load_site
from hpcml.ensemble.spec import SimSpec, TrainingJob
from hpcml.errors import ConfigError

__all__ = ["SimulationFuture", "design", "mark_done", "provenance", "simulation", "simulation_app", "training"]

def simulation_app(executors: str | list[str] = "all"):
    """The simulation ``bash_app`` itself (what :func:`simulation` and the Campaign submit)."""
    from parsl import bash_app

    return bash_app(attempts.hpcml_sim, executors=executors)


def _launch(site: Site | str | None, launch: str | None, ranks: int) -> tuple[str, dict]:
    if launch is not None:
        return launch.format(ranks=ranks), {}
    s = load_site(site if site is not None else "local")
    return s.sim_prefix(ranks), s.sim_resource_spec(ranks)


def simulation(spec: SimSpec, *, run_dir: str | Path, site: Site | str | None = None, launch: str | None = None,
               env: Mapping[str, str] | None = None, timeout_s: float | None = None, grace_s: float = 10.0,
               executors: str | list[str] = "all"):
    """Submit ``spec`` as an MPI bash_app under the loaded Parsl config; its AppFuture.

    ``launch``: the MPI prefix template (``mpiexec -n {ranks}``), else ``site``'s (default
    ``local``; ``$PARSL_MPI_PREFIX`` and its resource spec under ``MPIExecutor``). ``env``:
    extra environment of every attempt of every simulation in ``run_dir`` (stream endpoints).
    Returns a :class:`SimulationFuture`: it completes when the last attempt has ended and
    its provenance records are written.
    """
    if not isinstance(spec, SimSpec):
        raise ConfigError(f"spec must be a SimSpec, got {type(spec).__name__}")
    if timeout_s is not None and not timeout_s > 0:
        raise ConfigError(f"timeout_s must be > 0 or None, got {timeout_s}")
    run_dir = Path(run_dir).resolve()
    sims_dir = run_dir / "sims"
    if env is not None or not (sims_dir / "attempt.sh").exists():  # None: keep the environment set before
        attempts.prepare(sims_dir, {"HPCML_RUN_DIR": str(run_dir), **(env or {})})
    directory = attempts.sim_dir(run_dir, spec.sim_id)
    directory.mkdir(parents=True, exist_ok=True)
    first = attempts.next_attempt(directory)
    prefix, resources = _launch(site, launch, spec.ranks)
    app_future = simulation_app(executors)(str(directory), spec.sim_id, prefix, spec.command(),
                                           math.ceil(timeout_s) if timeout_s else 0, math.ceil(grace_s),
                                           parsl_resource_specification=resources)
    out = SimulationFuture(spec.sim_id, app_future)

    def record(f) -> None:  # in Parsl's thread, once every retry is over; then `out` completes
        try:
            attempts.record_ended(run_dir, directory, sim_id=spec.sim_id, params=spec.params, argv=spec.command(),
                                  launch=prefix, first=first, recorded={}, final=True, exc=f.exception(),
                                  ok=f.exception() is None)
        finally:
            if f.exception() is not None:
                out.set_exception(f.exception())
            else:
                out.set_result(f.result())

    app_future.add_done_callback(record)
    return out


class SimulationFuture(concurrent.futures.Future):
    """The future of one simulation: completes once its last attempt has ended *and* every
    attempt's provenance record is written, so a dependent app (Parsl waits on any Future)
    or a reader after ``result()`` sees them all. ``app_future`` is Parsl's own."""

    def __init__(self, sim_id: int, app_future) -> None:
        super().__init__()
        self.sim_id, self.app_future = sim_id, app_future


def provenance(run_dir: str | Path, sim_id: int | None = None) -> list[dict]:
    """The provenance records in ``run_dir`` (of one simulation, or all), in the order written."""
    return attempts.read_provenance(Path(run_dir), sim_id)


def mark_done(run_dir: str | Path, futures: Iterable[Any]) -> dict[str, list[int]]:
    """Wait for the simulations' futures (:func:`simulation`'s) and write ``run_dir/sims_done.json`` (which
    completed, which failed): a streaming trainer ends its stream on it."""
    completed, failed = [], []
    for f in futures:
        (failed if f.exception() is not None else completed).append(f.sim_id)
    done = {"completed": sorted(completed), "failed": sorted(failed)}
    attempts.write_json(Path(run_dir) / attempts.SIMS_DONE_FILE, done)
    return done


def training(job: TrainingJob, *, run_dir: str | Path, site: Site | str | None = None,
             executors: str | list[str] = "all"):
    """The training job as a bash_app (its stdout/stderr in ``run_dir/train.out|err``).

    Parsl's retries rerun it after a failure: give ``job.argv`` a resume flag so a rerun
    continues from its checkpoint. For supervision (restarts, the walltime warning,
    cancelling simulations when it fails) use the :class:`~hpcml.ensemble.Campaign`.
    """
    from parsl import bash_app

    s = load_site(site if site is not None else "local")
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    line = s.train_line(job.argv, nodes=job.nodes, ranks=job.ranks)
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in {"HPCML_RUN_DIR": str(run_dir), **job.env}.items())

    def hpcml_train(line: str, env: str, stdout: str = "", stderr: str = "") -> str:
        return f"export {env}; exec {line}" if env else f"exec {line}"

    return bash_app(hpcml_train, executors=executors)(line, env, stdout=str(run_dir / "train.out"),
                                                     stderr=str(run_dir / "train.err"))


def design(kind: str, bounds: Mapping[str, Sequence[float]], n: int, *, seed: int = 0,
           executors: str | list[str] = "all"):
    """:func:`hpcml.ensemble.design.design` as a python_app: its AppFuture of parameter dicts."""
    from parsl import python_app

    from hpcml.ensemble.design import design as make

    return python_app(make, executors=executors)(kind, dict(bounds), n, seed=seed)
