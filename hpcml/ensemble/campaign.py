"""The Campaign: N MPI simulations through Parsl alongside one MPI training job.

A convenience over the pieces a Parsl user can also drive from an own workflow
(:mod:`hpcml.ensemble.apps`): each simulation is a ``bash_app`` attempt
(:mod:`hpcml.ensemble.attempts`), the training job a supervised process group
(:mod:`hpcml.ensemble.trainer_proc`). The Campaign, not the executor, bounds how many
simulations are in flight, so the limit holds under any executor; retries are Parsl's.

Where it runs decides how (``mode="auto"``):

- **one allocation**: the driver runs inside a batch job of the site's scheduler; the
  training job takes the job's first ``training.nodes`` nodes and the simulations the
  others (Parsl starts its workers here, no second queue wait). Every timeout follows from
  the job's walltime, and the walltime warning (SIGUSR1 or SIGTERM to the driver) stops the
  campaign cleanly: running simulations are cancelled, the trainer saves and stops, and
  :meth:`Campaign.run` returns ``interrupted``; ``run(..., resume=True)`` in the next job
  skips the simulations that completed and the trainer resumes from its checkpoint.
- **pilot**: the driver runs on a login node; Parsl submits a block for the simulations
  and the training job gets its own allocation (``srun`` on Slurm).
- **local**: no scheduler; ``mpiexec`` for everything.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcml.ensemble.site import Site, load_site, shell_join, walltime_seconds
from hpcml.ensemble.spec import CampaignResult, SimSpec, TrainingJob, streaming
from hpcml.errors import ConfigError
from hpcml.log import get_logger
from hpcml.numeric import is_int

if TYPE_CHECKING:  # parsl costs ~0.4 s to import; only run() needs it
    import parsl

    from hpcml.ensemble.members import Members

    from hpcml.ensemble.allocation import Allocation

__all__ = ["Campaign", "CampaignResult", "SimSpec", "TrainingJob"]  # the helpers and file names are internal

logger = get_logger(__name__)


def site_mismatch(site: Site, environ: Mapping[str, str] | None = None) -> str | None:
    """One line when the batch job this driver runs in was made for another site than the
    campaign's (``HPCML_SITE``, written by ``hpcml job``) or is another scheduler's, else None."""
    import os

    from hpcml.env import detect

    environ = os.environ if environ is None else environ
    named, job = environ.get("HPCML_SITE"), detect(environ)
    where = "everything runs on this node" if site.scheduler == "local" else \
        f"its simulations go to {site.scheduler}, not to this job"
    if named and named != site.name:
        return (f"this driver runs in a batch job written for site {named!r} (HPCML_SITE), but the campaign's site is "
                f"{site.name!r}: {where}; pass site={named!r} to use the job's nodes")
    if job.scheduler not in ("none", site.scheduler):
        return (f"this driver runs inside {job.scheduler} job {job.job_id}, but the campaign's site {site.name!r} "
                f"schedules with {site.scheduler}: {where}; pass a {job.scheduler} site of this machine to use the "
                f"job's nodes")
    return None


MODES = ("auto", "allocation", "pilot")


@dataclass(kw_only=True)
class Campaign:
    """Runs simulations through Parsl, with a training job alongside.

    Give either ``site`` (a :class:`~hpcml.ensemble.site.Site` or its name: the Parsl
    Config, launch lines and resource specs all come from it) or ``config`` (a Parsl
    Config or a factory of one) with ``sim_launch`` / ``train_launch`` templates.
    """

    run_dir: Path | str
    site: Site | str | None = None
    site_options: dict[str, Any] = field(default_factory=dict)
    """Pilot mode: passed to ``Site.parsl_config`` (nodes, walltime, account, queue, worker_init)."""
    config: Any = None
    """A ``parsl.Config`` or a zero-argument callable returning one (a Config is used once)."""
    sim_launch: str | None = None
    """Template of a simulation's launch prefix with ``{ranks}`` (default: the site's)."""
    sim_resource_spec: Callable[[int], dict] | None = None
    train_launch: str | None = None
    """Template of the training launch line with ``{ranks}`` and ``{nodes}`` (default: the site's)."""
    max_concurrent: int = 4
    retries: int = 2
    """Only for a Config built from ``site``; an explicit Config carries its own."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of every simulation attempt (e.g. stream endpoints)."""
    sim_timeout_s: float | None = None
    """Kill an attempt after this long (it then counts as failed and may be retried)."""
    cancel_grace_s: float = 10.0
    """Between SIGTERM and SIGKILL when an attempt is timed out or cancelled."""
    progress: bool = True
    progress_every_s: float = 30.0
    """Seconds between progress lines when stderr is not a terminal."""
    poll_s: float = 0.2
    bundle: int = 1
    """Members of ``SimSpec(entry=...)`` run per task, in one process, one after another
    (:mod:`hpcml.ensemble.bundle`): at 10^5 members a launch and six files each cost more
    than the members. Simulations given as ``argv`` are launched one per task, as before."""
    mode: str = "auto"
    """``auto`` (inside a job of the site's scheduler: ``allocation``, else ``pilot``),
    ``allocation`` or ``pilot``."""
    deadline: float | None = None
    """Epoch seconds at which the walltime ends (default: the allocation's, if known)."""
    handle_signals: bool = True
    """SIGUSR1 and SIGTERM to the driver (the walltime warning) stop the campaign cleanly
    (the handlers are installed in the main thread only, for the duration of ``run``)."""
    stream_host: str | None = None
    """The address a streaming trainer's servers bind (the contract's): default, the site's
    stream interface (``hsn0``) on the trainer's node, else loopback."""

    def __post_init__(self) -> None:
        self._trainer_queue: str | None = None
        self.run_dir = Path(self.run_dir).resolve()
        if not isinstance(self.max_concurrent, int) or self.max_concurrent < 1:
            raise ConfigError(f"max_concurrent must be an int >= 1, got {self.max_concurrent!r}")
        if not is_int(self.bundle) or self.bundle < 1:
            raise ConfigError(f"bundle must be an int >= 1 (members a task), got {self.bundle!r}")
        if not isinstance(self.retries, int) or self.retries < 0:
            raise ConfigError(f"retries must be an int >= 0, got {self.retries!r}")
        if self.sim_timeout_s is not None and not self.sim_timeout_s > 0:
            raise ConfigError(f"sim_timeout_s must be > 0 or None, got {self.sim_timeout_s}")
        for name in ("cancel_grace_s", "poll_s", "progress_every_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.site is None and self.config is None:
            raise ConfigError("Campaign needs site= (a Site or its name) or config= (a parsl.Config)")
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r} must be one of {', '.join(MODES)}")
        bad = [k for k, v in self.env.items()
               if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(k)) or not isinstance(v, str)]
        if bad:
            raise ConfigError(f"env names must be shell identifiers with str values, got {bad}")
        if self.site is not None:
            self.site = load_site(self.site)
        if "walltime" in self.site_options:
            walltime_seconds(self.site_options["walltime"])

    # --- launch lines ---------------------------------------------------------------------

    def sim_prefix(self, ranks: int) -> str:
        if self.sim_launch is not None:
            return self.sim_launch.format(ranks=ranks)
        return self.site.sim_prefix(ranks) if self.site is not None else f"mpiexec -n {ranks}"

    def resource_spec(self, ranks: int) -> dict:
        if self.sim_resource_spec is not None:
            return dict(self.sim_resource_spec(ranks))
        return self.site.sim_resource_spec(ranks) if self.site is not None else {}

    def train_line(self, job: TrainingJob, hosts: Sequence[str] = (), *, allocate: bool = False) -> str:
        """The training job's command line: pinned to ``hosts`` of the running job (one
        allocation), or getting an allocation of its own (``allocate``: pilot mode)."""
        if self.train_launch is not None:
            ranks = job.ranks if job.ranks is not None else job.nodes
            return shell_join(self.train_launch.format(ranks=ranks, nodes=job.nodes), job.argv)
        if self.site is None:
            return shell_join(f"mpiexec -n {job.ranks or job.nodes}", job.argv)
        line = self.site.train_line(job.argv, nodes=job.nodes, ranks=job.ranks, hosts=hosts)
        if not allocate or self.site.scheduler == "local":
            return line
        from hpcml.ensemble.jobscript import allocate_line

        opts = self.site_options
        return allocate_line(self.site, line, walltime=opts.get("walltime") or "01:00:00", account=opts.get("account"),
                             queue=self._trainer_queue or opts.get("queue"), nodes=job.nodes, run_dir=self.run_dir,
                             argv=job.argv, ranks=job.ranks)

    def plan_pilot(self, training: TrainingJob | None) -> None:
        """Pilot mode, before anything is submitted: the simulations' block and the trainer's
        allocation checked against the queues' per-user limits (:mod:`hpcml.ensemble.campaign_jobs`);
        the trainer goes to another queue with room when its own has none, and a campaign whose
        two jobs fit nowhere is refused in one line that says how to run it as one allocation."""
        if self.site is None or self.config is not None or training is None or self.site.scheduler == "local" \
                or self.train_launch is not None:
            return
        from hpcml.ensemble import campaign_jobs

        opts = self.site_options
        nodes, walltime = int(opts.get("nodes") or 1), opts.get("walltime") or "01:00:00"
        total = nodes + training.nodes
        try:
            got = campaign_jobs.plan(self.site, nodes=total, walltime=walltime, train_nodes=training.nodes,
                                     queue=opts.get("queue"), mode="pilot")
        except ConfigError as e:
            raise ConfigError(f"{e} -- run it as one allocation instead: hpcml job --site {self.site.name} --nodes "
                              f"{total} --walltime {walltime} --driver -- python <this driver>") from None
        self._trainer_queue = got.jobs[1].queue if got.jobs[1].queue != got.jobs[0].queue else None
        logger.info("%s", got.explain())

    def train_ranks(self, job: TrainingJob) -> int:
        """The ranks the training job's launch line asks for."""
        if job.ranks is not None:
            return job.ranks
        return self.site.train_ranks(job.nodes) if self.site is not None and self.train_launch is None else job.nodes

    def allocation(self) -> Allocation | None:
        """The batch job this driver runs in, when it runs the campaign (``mode``)."""
        if self.site is not None and (why := site_mismatch(self.site)):
            logger.warning(why)
        if self.site is None or self.mode == "pilot":
            return None
        from hpcml.ensemble import allocation

        found = allocation.current(self.site)
        if found is None and self.mode == "allocation":
            raise ConfigError(f"mode='allocation' but this process is not in a {self.site.scheduler} job of site "
                              f"{self.site.name}: run the driver inside the job (hpcml job --driver)")
        return found

    def make_config(self, sims: Sequence[SimSpec], sim_nodes: Sequence[str] = ()) -> parsl.Config:
        from hpcml.ensemble.parsl_build import resolve_config

        options = {k: v for k, v in self.site_options.items() if v is not None}
        return resolve_config(self.config, self.run_dir, lambda: self.site.parsl_config(
            run_dir=str(self.run_dir), max_concurrent_sims=self.max_concurrent, sim_ranks=_max_ranks(sims),
            retries=self.retries, sim_nodes=tuple(sim_nodes), **options))

    # --- the run --------------------------------------------------------------------------

    def run(self, sims: Sequence[SimSpec | Members] | Members, *, training: TrainingJob | None = None,
            ready_file: Path | str | None = None,
            ready_timeout_s: float | None = None, train_timeout_s: float | None = None,
            resume: bool = False, kept: Collection[int] | Callable[[], Collection[int]] | None = None
            ) -> CampaignResult:
        """Start ``training``, wait for its stream endpoints (``ready_file``), run every
        simulation, write the done record, wait for the trainer to exit.

        ``sims``: :class:`SimSpec` s, or :class:`~hpcml.ensemble.members.Members` (many
        bundled members of one function, described rather than listed: the driver holds a
        few bytes a member), or a list mixing both.

        The run directory holds one campaign (``campaign_id.json``, written on first use):
        one that holds this campaign's simulations or training job already is refused
        unless ``resume``, and one that holds another campaign is refused even then
        (:mod:`hpcml.ensemble.rundir`). A streaming training job (``TrainingJob(stream=True)``,
        or a ``ready_file``) gets the campaign's contract (:mod:`hpcml.contract`): the
        stream's secret (``run_dir/stream.key``, made here), endpoints file (``ready_file``,
        default ``run_dir/endpoints.json``), done record, steps and batch.
        ``resume``: simulations that completed in an earlier run in this run directory
        (their provenance says ``ok``) are not run again if their results are kept -- every
        sample of a streaming one in the trainer's latest checkpoint, the files of the
        others; ``kept`` (ids, or a callable called once the directory is known to hold
        this campaign) overrides that rule. A simulation that finished after the trainer's
        last save runs again, and its samples come again.
        With a walltime the campaign stops itself ``SAVE_MARGIN_S`` before it if no warning
        came; ``ready_timeout_s`` defaults to 300 s locally, ``train_timeout_s`` to none.
        Raises :class:`~hpcml.errors.LaunchError` if the trainer fails, exits before the
        simulations are done (the remaining ones are cancelled first) or lacks samples of
        completed simulations (the message names them), or if a streaming simulation
        completes without streaming -- the error carries the run's :class:`CampaignResult` as
        ``.result``; returns an ``interrupted`` result after a walltime warning. No
        simulations: see :meth:`train`.
        """
        from hpcml.ensemble.members import Members, Specs

        specs = Specs([sims] if isinstance(sims, Members) else list(sims))
        specs.check_unique()
        if not len(specs) and training is None:
            raise ConfigError("nothing to run: give simulations, a training job (training=) or both")
        _check_waits(training, ready_file, ready_timeout_s, train_timeout_s)
        if streaming(training, ready_file):
            check_stream_ranks(specs.streaming_ids(), self.train_ranks(training))
        from hpcml.ensemble.runner import Run

        return Run(self, specs, training, Path(ready_file) if ready_file is not None else None,
                   ready_timeout_s=ready_timeout_s, train_timeout_s=train_timeout_s, resume=resume,
                   kept=kept if kept is None or callable(kept) else set(kept)).execute()

    def run_adaptive(self, simulation: Callable[[int, dict[str, float]], SimSpec], sampler, *, budget: int,
                     wave: int, training: TrainingJob | None = None, wave_trigger: float = 0.5,
                     target: tuple[str, float] | None = None,
                     ready_file: Path | str | None = None, ready_timeout_s: float | None = None,
                     train_timeout_s: float | None = None, resume: bool = False,
                     sims: Sequence[SimSpec] = ()) -> CampaignResult:
        """:meth:`run`, with the simulations proposed in waves while training goes on (active
        learning, docs/active-learning.md): ``budget`` simulations in waves of ``wave``, each
        wave asked of ``sampler`` (:mod:`hpcml.ensemble.sampling`) with the trainer's latest
        feedback once ``wave_trigger`` of the previous wave has ended; ``simulation(sim_id,
        params)`` builds each one's :class:`SimSpec`. Every wave is recorded before it runs
        (``run_dir/waves.jsonl``): ``resume`` runs the recorded waves' simulations as
        :meth:`run` does (what completed and was kept is not run again) and proposes on from
        the sampler's recorded state. The run directory's identity is the plan (budget, wave
        size, the sampler's initial state); each simulation's spec is pinned by its id.
        ``target=("val_rel_l2", 0.05)``: no wave is proposed once the trainer's feedback
        reports that metric at or below the value (recorded: a resume proposes none either);
        the simulations already proposed finish, then the campaign ends. ``sims``: simulations
        of a fixed design run besides the waves, from the start (held-out simulations to
        validate on, say), with ids from ``budget`` up: part of the plan, run once as
        :meth:`run` runs them."""
        from types import SimpleNamespace

        from hpcml.ensemble.members import Specs
        from hpcml.ensemble.runner import Run
        from hpcml.ensemble.waves import Waves

        waves = Waves(simulation, sampler, budget=budget, size=wave, trigger=wave_trigger, target=target)
        _check_waits(training, ready_file, ready_timeout_s, train_timeout_s)
        sims = list(sims)
        _check_unique(sims)
        low = sorted(s.sim_id for s in sims if s.sim_id < budget)
        if low:
            raise ConfigError(f"fixed simulation id(s) {low[:5]} of run_adaptive's sims collide with the waves' ids 0 "
                              f"to {budget - 1}: expected ids >= budget={budget}")
        if streaming(training, ready_file):
            ranks = self.train_ranks(training)
            if wave < ranks:
                raise ConfigError(f"waves of {wave} for a streaming training job of {ranks} ranks: a wave must give "
                                  f"every trainer rank a simulation (each rank needs a batch to step); use wave >= "
                                  f"{ranks}")
            check_stream_ranks([SimpleNamespace(sim_id=i) for i in range(budget)]
                               + [s for s in sims if s.stream is not False], ranks)
        return Run(self, Specs(sims), training, Path(ready_file) if ready_file is not None else None,
                   ready_timeout_s=ready_timeout_s, train_timeout_s=train_timeout_s, resume=resume,
                   waves=waves).execute()

    def train(self, training: TrainingJob, *, train_timeout_s: float | None = None,
              resume: bool = False) -> CampaignResult:
        """Run the training job alone (offline: from files the simulations wrote in an
        earlier :meth:`run` of this campaign, or elsewhere): no simulation, so Parsl is not
        loaded and no block submitted; in one allocation it may take every node. Its record
        is ``run_dir/training.json`` (``campaign.json`` keeps the simulations'). The same
        as ``run([], training=training)``."""
        return self.run([], training=training, train_timeout_s=train_timeout_s, resume=resume)

    def run_offline(self, sims: Sequence[SimSpec | Members] | Members, training: TrainingJob, *,
                    resume: bool = False) -> CampaignResult:
        """Offline training in one call: the simulations write their files (:meth:`run`), then,
        unless that was interrupted, the training job trains from them alone (:meth:`train`).
        One result: the simulations' outcomes with the trainer's."""
        result = self.run(sims, resume=resume)
        if result.interrupted:
            return result
        trained = self.train(training, resume=resume)
        return dataclasses.replace(result, training_returncode=trained.training_returncode, run_id=trained.run_id,
                                   interrupted=trained.interrupted, samples=trained.samples)


def _max_ranks(sims: Sequence[SimSpec]) -> int:
    """The most ranks one simulation takes (a run's Specs know it without making every spec)."""
    return sims.max_ranks() if hasattr(sims, "max_ranks") else max((s.ranks for s in sims), default=1)


def _check_unique(sims: Sequence[SimSpec]) -> None:
    ids = [s.sim_id for s in sims]
    if len(set(ids)) != len(ids):
        dup = sorted(i for i, n in Counter(ids).items() if n > 1)
        raise ConfigError(f"sim_id values must be unique, repeated: {dup}")


def _check_waits(training: TrainingJob | None, ready_file, ready_timeout_s, train_timeout_s) -> None:
    for name, v in (("ready_timeout_s", ready_timeout_s), ("train_timeout_s", train_timeout_s)):
        if v is not None and not v > 0:
            raise ConfigError(f"{name} must be > 0 or None, got {v}")
    if ready_file is not None and training is None:
        raise ConfigError(f"ready_file {ready_file} given without a training job to write it")


def check_stream_ranks(sims: Sequence[SimSpec] | Sequence[int], ranks: int) -> None:
    """Refuse a streaming campaign in which a trainer rank would get no simulation (it would
    wait for data that never comes): each simulation streams to the rank ``route`` names.
    ``sims``: the streaming simulations, or their ids."""
    n = f"{len(sims)} simulation{'s' if len(sims) != 1 else ''}"
    if len(sims) < ranks:
        raise ConfigError(f"{n} for {ranks} trainer ranks: each trainer rank needs at least one "
                          f"simulation; use <= {max(len(sims), 1)} trainer ranks or more simulations"
                          if len(sims) else f"no simulations for a streaming training job of {ranks} ranks: give "
                          f"simulations, or TrainingJob(stream=False) to train from files (Campaign.train)")
    from hpcml.stream.routing import route

    fed: set[int] = set()
    for s in sims:
        fed.add(route(s if isinstance(s, int) else s.sim_id, ranks))
        if len(fed) == ranks:
            return
    idle = sorted(set(range(ranks)) - fed)
    raise ConfigError(f"{n} for {ranks} trainer ranks leave rank(s) {idle} without data "
                      f"(each simulation streams to the rank hpcml.stream.route(sim_id, {ranks}) names): use "
                      f"fewer trainer ranks or more simulations")
