"""The campaign's pieces as Parsl apps, for a workflow of your own under your own loaded config.

    import parsl
    from hpcml.ensemble import apps
    parsl.load(my_config)                          # yours: any executors, retries, providers
    run = apps.claim("runs/mine")                  # the run directory: refused if it holds a campaign
    points = apps.design("lhs", bounds, 8, seed=0).result()
    train = apps.training(TrainingJob(argv=[...], steps=500, batch=8), run_dir=run.run_dir)
    futs = [apps.simulation(SimSpec(sim_id=i, params=p, argv=[...]), run_dir=run.run_dir) for i, p in enumerate(points)]
    ...your own @python_app steps on the futures...
    apps.mark_done(run.run_dir, futs)              # the end of the campaign: the trainer's stream ends on it

Every entry point claims its run directory first (:mod:`hpcml.ensemble.rundir`), as the
:class:`~hpcml.ensemble.Campaign` does: :func:`claim` explicitly (``resume=True`` continues
the campaign the directory holds), or the first :func:`simulation`, :func:`training` or
:func:`mark_done` of this process (``resume=False``). A directory that holds a campaign is
refused in one line, and the files an earlier run left for the other side
(``endpoints.json``, ``sims_done.json``) are removed and could not be read anyway: they
carry their run. The simulations and the training job get the campaign's contract
(:mod:`hpcml.contract`): a trainer script reads it with ``Contract.from_env()`` (or
``StreamServer.from_campaign``, ``OnlineConfig.from_campaign``, ``train_surrogate``).

A simulation is an MPI ``bash_app`` with its stream identity (``HPCML_SIM_ID``,
``HPCML_ATTEMPT``) and the exactly-once bookkeeping of :mod:`hpcml.ensemble.attempts`:
each Parsl retry claims the next attempt number on the worker, and every ended attempt
becomes a record in ``run_dir/provenance.jsonl``. The :class:`~hpcml.ensemble.Campaign`
is a convenience built on :func:`simulation_app`.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import shlex
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcml.contract import DONE_FILE, ENDPOINTS_FILE, SECRET_FILE, Contract, write_done
from hpcml.ensemble import attempts, ledger, rundir
from hpcml.ensemble.provenance import completed_sims, read_provenance
from hpcml.ensemble.site import Site, load_site
from hpcml.ensemble.spec import SimSpec, TrainingJob
from hpcml.errors import ConfigError
from hpcml.log import get_logger

logger = get_logger(__name__)

__all__ = ["RunHandle", "SimulationFuture", "claim", "design", "mark_done", "provenance", "simulation",
           "simulation_app", "training"]


@dataclass
class RunHandle:
    """This process's claim on a run directory: the campaign, this run, the contract."""

    run_dir: Path
    contract: Contract
    non_streaming: set[int] = field(default_factory=set)
    """Simulations submitted with ``SimSpec(stream=False)``: the trainer does not wait for them."""
    ended: bool = False
    done_before: set[int] | None = None
    """Resumed: the simulations an earlier run completed whose results survive (read once,
    on the first :func:`simulation`): they are not run again."""
    """:func:`mark_done` was called: the next :func:`claim` or :func:`simulation` starts a new run."""

    @property
    def campaign(self) -> str:
        return self.contract.campaign

    @property
    def run(self) -> str:
        return self.contract.run


_runs: dict[Path, RunHandle] = {}


def claim(run_dir: str | Path, *, resume: bool = False, stream: bool = True) -> RunHandle:
    """Claim ``run_dir`` for this workflow (once per process; later calls return the same
    handle). ``resume``: continue the campaign it holds; without it, a directory holding a
    campaign is refused (ConfigError, one line). ``stream``: the training job takes the
    simulations' stream (the secret ``run_dir/stream.key`` is made, the endpoints file named)."""
    from hpcml.stream.routing import new_secret

    path = Path(run_dir).resolve()
    if path in _runs and not _runs[path].ended:
        return _runs[path]
    if path in _runs:  # the run this process had there is over: a new one claims the directory again
        del _runs[path]
        rundir.release(path)
    c = rundir.claim(path, resume=resume, entry="apps")
    streams = {}
    if stream:
        new_secret(path / SECRET_FILE)
        streams = dict(secret_file=str(path / SECRET_FILE), endpoints_file=str(path / ENDPOINTS_FILE),
                       done_file=str(path / DONE_FILE))
    contract = Contract(run_dir=str(path), campaign=c.campaign, run=c.run, resume=resume and c.held,
                        driver_pid=os.getpid(), driver_host=socket.gethostname(), **streams)
    handle = _runs[path] = RunHandle(path, contract)
    attempts.prepare(path / "sims", contract.for_simulations().to_env())
    attempts.clear_cancel(path / "sims")
    rundir.clear_done(path)
    return handle


def _handle(run_dir: str | Path, new_work: bool = False) -> RunHandle:
    """This process's run in ``run_dir`` (claimed on first use); ``new_work`` (a simulation):
    after :func:`mark_done` that run is over, and the directory is claimed again."""
    handle = _runs.get(Path(run_dir).resolve())
    return handle if handle is not None and not (new_work and handle.ended) else claim(run_dir)


def _executors(executors: str | Sequence[str]) -> str | list[str]:
    """Parsl takes "all" or a list of labels: one label given as a string becomes a list."""
    if executors == "all":
        return "all"
    if isinstance(executors, str):
        return [executors]
    labels = list(executors)
    if not labels or not all(isinstance(x, str) and x for x in labels):
        raise ConfigError(f"executors={executors!r}: expected 'all', a label, or a list of labels")
    return labels


def simulation_app(executors: str | Sequence[str] = "all"):
    """The simulation ``bash_app`` itself (what :func:`simulation` and the Campaign submit)."""
    from parsl import bash_app

    return bash_app(attempts.hpcml_sim, executors=_executors(executors))


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
    executors = _executors(executors)
    handle = _handle(run_dir, new_work=True)
    run_dir, sims_dir = handle.run_dir, handle.run_dir / "sims"
    if env is not None:  # None: keep the environment set before
        attempts.prepare(sims_dir, {**handle.contract.for_simulations().to_env(), **env})
    rundir.record_spec(run_dir, spec)
    if spec.stream is False:
        handle.non_streaming.add(spec.sim_id)
    if spec.sim_id in _done_before(handle, spec):  # resumed: completed earlier, its results kept
        out = SimulationFuture(spec.sim_id, None)
        out.skipped = True
        out.set_result(0)
        return out
    directory = attempts.sim_dir(run_dir, spec.sim_id)
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
        self.skipped = False
        """Completed in an earlier run of a resumed campaign: not run again (``app_future`` None)."""


def _done_before(handle: RunHandle, spec: SimSpec) -> set[int]:
    """What a resumed run need not run again, as the Campaign decides it: completed earlier,
    and -- if it streams -- every sample of it in the trainer's latest checkpoint."""
    if not handle.contract.resume:
        return set()
    if handle.done_before is None:
        done = set(completed_sims(handle.run_dir))
        streaming = done if handle.contract.streams else set()
        handle.done_before = ledger.kept(handle.run_dir, done, streaming - handle.non_streaming) if done else set()
        if done:
            logger.info("resuming: %d simulation(s) completed earlier and are not run again", len(handle.done_before))
    return handle.done_before


def provenance(run_dir: str | Path, sim_id: int | None = None) -> list[dict]:
    """The provenance records in ``run_dir`` (of one simulation, or all), in the order written."""
    return read_provenance(Path(run_dir), sim_id)


def mark_done(run_dir: str | Path, futures: Iterable[Any]) -> dict[str, list[int]]:
    """Wait for the simulations' futures (:func:`simulation`'s) and write this run's done
    record (``run_dir/sims_done.json``: which completed, which failed, how many samples each
    streamed, which should have streamed and did not): a streaming trainer ends its stream
    on it, and counts what it lacks. It ends the run: simulations submitted after it, or a
    new :func:`claim`, in this process start a new one (refused without ``resume``)."""
    handle = _handle(run_dir)
    completed, failed = [], []
    for f in futures:
        (failed if f.exception() is not None else completed).append(f.sim_id)
    streaming = set(completed) - handle.non_streaming if handle.contract.streams else set()
    record = ledger.done_record(handle.contract, completed, failed, streaming)
    write_done(handle.run_dir / DONE_FILE, record)
    handle.ended = True  # new simulations, or a new claim, in this process start a new run
    return {"completed": list(record.completed), "failed": list(record.failed)}  # plain lists: a workflow's JSON


def training(job: TrainingJob, *, run_dir: str | Path, site: Site | str | None = None,
             executors: str | Sequence[str] = "all"):
    """The training job as a bash_app (its stdout/stderr in ``run_dir/train.out|err``), with
    the campaign's contract in its environment (run directory, campaign, run, stream, done
    record, ``job.steps`` and ``job.batch``; a trainer exits once this workflow's process is gone).

    Parsl's retries rerun it after a failure -- not after exit 78, a mistake a relaunch would
    repeat, which the trainer records (:func:`hpcml.outcome.write_trainer_final`): a retry then
    launches nothing and exits 78 again; give ``job.argv`` nothing special: a rerun
    of a trainer built on :func:`~hpcml.train.online.train_online` resumes from its
    checkpoint when ``resume`` was claimed. For supervision (restarts, the walltime warning,
    cancelling simulations when it fails) use the :class:`~hpcml.ensemble.Campaign`.
    """
    from parsl import bash_app

    executors = _executors(executors)
    s = load_site(site if site is not None else "local")
    handle = _handle(run_dir)
    run_dir = handle.run_dir
    line = s.train_line(job.argv, nodes=job.nodes, ranks=job.ranks)
    # resume always: only this campaign's checkpoint can be in the claimed directory, and a Parsl
    # retry of this app must continue it, not start over and overwrite it
    contract = handle.contract.replace(steps=job.steps, batch=job.batch, resume=True)
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in {**contract.to_env(), **job.env}.items())

    def hpcml_train(line: str, env: str, run_dir: str, run: str, stdout: str = "", stderr: str = "") -> str:
        from hpcml.contract import CONFIG_ERROR
        from hpcml.outcome import trainer_final

        if trainer_final(run_dir, run) is not None:  # a Parsl retry after a deterministic end: launch nothing
            return f"exit {CONFIG_ERROR}"
        return f"export {env}; exec {line}" if env else f"exec {line}"

    return bash_app(hpcml_train, executors=executors)(line, env, str(run_dir), contract.run,
                                                     stdout=str(run_dir / "train.out"),
                                                     stderr=str(run_dir / "train.err"))


def design(kind: str, bounds: Mapping[str, Sequence[float]], n: int, *, seed: int = 0,
           executors: str | Sequence[str] = "all"):
    """:func:`hpcml.ensemble.design.design` as a python_app: its AppFuture of parameter dicts."""
    from parsl import python_app

    from hpcml.ensemble.design import design as make

    return python_app(make, executors=_executors(executors))(kind, dict(bounds), n, seed=seed)

