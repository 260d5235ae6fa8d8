"""What every batch system does for a job, in one interface; one subclass per scheduler.

Layered as Parsl layers its providers: a :class:`Scheduler` knows its directives, how a
script is submitted and its job id read, the allocation's nodes and deadline, how the
walltime warning arrives, how a job that is not finished comes back (requeue or
resubmission), and its launcher (srun, PALS mpiexec, jsrun, Hydra). A site names one and
adds facts (:mod:`hpcml.ensemble.rules`). Nothing here imports Parsl at module level.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from hpcml import safeio
from hpcml.ensemble.rules import Fact, Queue
from hpcml.errors import ConfigError, LaunchError

if TYPE_CHECKING:  # pragma: no cover
    from parsl.providers.base import ExecutionProvider

    from hpcml.ensemble.jobscript import JobSpec
    from hpcml.ensemble.site import Site, SiteRequest

#: Seconds a submission command may take before it counts as failed.
SUBMIT_TIMEOUT_S = 120


class SubmitError(LaunchError):
    """A submission failed; the command, its exit code and both outputs are kept."""

    def __init__(self, argv: Sequence[str], returncode: int | None, stdout: str, stderr: str, why: str = ""):
        self.argv, self.returncode, self.stdout, self.stderr = list(argv), returncode, stdout, stderr
        said = why or (stderr.strip() or stdout.strip() or "no output").splitlines()[-1]
        super().__init__(f"{shlex.join(self.argv)} failed ({returncode}): {said}")

    def details(self) -> str:
        """Everything the scheduler said, for a log or the user's terminal."""
        return (f"command: {shlex.join(self.argv)}\nexit code: {self.returncode}\n"
                f"stdout:\n{self.stdout.rstrip()}\nstderr:\n{self.stderr.rstrip()}")


class Scheduler:
    """A batch system. Subclasses fill the class attributes and the methods that differ."""

    name: ClassVar[str] = ""
    suffix: ClassVar[str] = ".sh"
    """Script file suffix."""
    workdir_var: ClassVar[str] = "$PWD"
    """Where the job was submitted from."""
    nodes_var: ClassVar[str] = ""
    """Variable holding the job's node count at run time (a node range needs one)."""
    launcher: ClassVar[str] = "mpiexec"
    """The MPI launcher of this scheduler's jobs: its head word in a launch line."""
    node_range: ClassVar[bool] = False
    """A job may ask for a range of nodes (``--nodes 1-2``) and start on what is left after a loss."""
    queue_kinds: ClassVar[tuple[str, ...]] = ("queue",)
    """What a queue row may select on this scheduler."""
    resubmits: ClassVar[bool] = False
    """A job not finished submits its own script again (no requeue for users): it needs its path."""
    sends_warning: ClassVar[bool] = True
    """The scheduler signals the job before its walltime (PBS does not: a timer does)."""

    # -- the script ---------------------------------------------------------------------------
    def header(self, spec: JobSpec, queue: Queue | None) -> list[Fact]:
        """The directives: name, nodes, walltime, output, warning, requeue, account, queue."""
        raise NotImplementedError

    def queue_directive(self, name: str, kind: str) -> str:
        raise NotImplementedError

    def account_and_queue(self, spec: JobSpec, queue: Queue | None, account_directive: str) -> list[Fact]:
        """The account line (``#PBS -A``, ``#BSUB -P``...) when there is one, then the queue line."""
        rule = spec.site.account
        account = [Fact(text=f"{account_directive}{spec.account}", why=rule.why if rule else "the allocation charged",
                        source=rule.source if rule else None)] if spec.account else []
        return account + self.queue_fact(spec, queue)

    def queue_fact(self, spec: JobSpec, queue: Queue | None) -> list[Fact]:
        """The queue line: the table's row, or a name the user gave that the table lacks."""
        if queue is not None:
            return [Fact(text=self.queue_directive(queue.name, queue.kind), why=f"chosen for {spec.nodes[1]} node(s) "
                         f"and {spec.walltime}: {queue.limits()}", source=queue.source)]
        if spec.queue:
            kind = spec.site.queues[0].kind if spec.site.queues else self.queue_kinds[0]
            return [Fact(text=self.queue_directive(spec.queue, kind), why="named by --queue; not in the site's "
                         "table, so its limits are not checked")]
        return []

    def requeue_block(self, spec: JobSpec, script: str) -> str:
        """Shell run after the command when it exits :data:`~hpcml.env.NOT_FINISHED`."""
        raise NotImplementedError

    def workdir(self, spec: JobSpec) -> str:
        return spec.workdir or self.workdir_var

    def script_path(self, spec: JobSpec) -> str:
        return spec.script_path or f"{self.workdir(spec)}/{spec.name}{self.suffix}"

    # -- submission ---------------------------------------------------------------------------
    def submit_argv(self, path: Path) -> list[str]:
        raise NotImplementedError

    def parse_job_id(self, stdout: str) -> str | None:
        """The job id in the submission's output; None when there is none."""
        raise NotImplementedError

    def submit(self, path: Path, site: str) -> str:
        """Submit the script at ``path``; its job id, or :class:`SubmitError` with all that was said."""
        argv = self.submit_argv(path)
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=SUBMIT_TIMEOUT_S)
        except FileNotFoundError:
            raise LaunchError(f"{argv[0]} not found: submit {path} on a login node of {site}") from None
        except subprocess.TimeoutExpired as e:
            raise SubmitError(argv, None, _text(e.stdout), _text(e.stderr),
                              f"no answer in {SUBMIT_TIMEOUT_S} s") from None
        if out.returncode != 0:
            raise SubmitError(argv, out.returncode, out.stdout, out.stderr)
        job_id = self.parse_job_id(out.stdout)
        if not job_id:
            raise SubmitError(argv, out.returncode, out.stdout, out.stderr, "no job id in its output")
        return job_id

    # -- inside the allocation ------------------------------------------------------------------
    def nodes(self, environ: Mapping[str, str]) -> tuple[str, ...]:
        """The job's compute nodes, in order."""
        return ()

    def deadline(self, job_id: str, environ: Mapping[str, str]) -> float | None:
        """Epoch seconds of the walltime's end when the scheduler can say (beyond HPCML_JOB_DEADLINE)."""
        return None

    def narrow_nodes(self, nodes: Sequence[str], run_dir: Path) -> list[str]:
        """Shell lines that make a worker see only ``nodes`` of the job (Parsl's MPIExecutor
        reads the job's node list from the scheduler's variables)."""
        return []

    # -- launch lines -------------------------------------------------------------------------
    def pin_hosts(self, line: str, hosts: Sequence[str]) -> str:
        """``line`` restricted to ``hosts`` of the job."""
        if not hosts:
            return line
        head, _, rest = line.partition(" ")
        if head != "mpiexec":
            return line
        return f"mpiexec --hosts {','.join(hosts)} {rest}".rstrip()

    def allocate_line(self, site: Site, line: str, *, walltime: str, account: str | None, queue: str | None,
                      nodes: int, run_dir: Path, argv: Sequence[str], ranks: int | None) -> str:
        """A training launch line that gets its own allocation from a login node (pilot mode)."""
        raise ConfigError(f"site {site.name} ({self.name}) has no batch system to allocate a training job from")

    # -- Parsl ---------------------------------------------------------------------------------
    def provider(self, site: Site, request: SiteRequest, queue: Queue | None, common: dict[str, Any]
                 ) -> ExecutionProvider:
        """Parsl's provider of one block (pilot mode)."""
        raise ConfigError(f"site {site.name} ({self.name}) submits no blocks")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Resubmitting(Scheduler):
    """A scheduler without a requeue for users (PBS; LSF's ``-Q`` knows no limit): a job that
    is not finished submits its own script again, counting. ``HPCML_JOB_SCRIPT`` overrides
    where the script is (the default: where ``hpcml job --script`` wrote it)."""

    resubmits = True
    submit_again: ClassVar[str] = ""
    """The shell command that submits ``$hpcml_script`` again with ``HPCML_RESTART_COUNT`` one higher."""
    submit_and_wait: ClassVar[str] = ""
    """The shell command that submits the script ``{path}`` and returns its job's exit status."""

    def requeue_block(self, spec: JobSpec, script: str) -> str:
        from hpcml.env import NOT_FINISHED

        return RESUBMIT.format(nf=NOT_FINISHED, max=spec.max_requeues, script=script, submit=self.submit_again)

    def allocate_line(self, site: Site, line: str, *, walltime: str, account: str | None, queue: str | None,
                      nodes: int, run_dir: Path, argv: Sequence[str], ranks: int | None) -> str:
        """The training job as a batch script of its own, submitted and waited for."""
        from hpcml.ensemble.jobscript import JobSpec, render

        spec = JobSpec(site=site, command=tuple(argv), nodes=(nodes, nodes), walltime=walltime, account=account,
                       queue=queue, ranks=ranks, name="hpcml-train", requeue=False, workdir=str(run_dir))
        path = Path(run_dir) / f"train{self.suffix}"
        safeio.replace(path, render(spec), mode=0o755)
        return self.submit_and_wait.format(path=shlex.quote(str(path)))

    def signal_argv(self, job_id: str, signal_name: str | None) -> list[str]:
        """The command that sends ``signal_name`` (``USR1``) to a submitted job, or with None cancels it."""
        raise NotImplementedError


RESUBMIT = """\
if [ "$rc" -eq {nf} ]; then
    n=${{HPCML_RESTART_COUNT:-0}} hpcml_script=${{HPCML_JOB_SCRIPT:-{script}}}
    if [ "$n" -lt {max} ]; then
        echo "hpcml-job: not finished (exit {nf}): resubmitting $hpcml_script" >&2
        {submit} && exit 0
    else
        echo "hpcml-job: not finished after {max} resubmissions: giving up" >&2
    fi
fi
"""


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")  # type: ignore[return-value]


def first_match(text: str, pattern: str) -> str | None:
    """The first match of ``pattern``'s group 1 in ``text``, or None."""
    m = re.search(pattern, text)
    return m[1] if m else None


def epoch(text: str, fmt: str) -> float | None:
    try:
        return time.mktime(time.strptime(text.strip(), fmt))
    except ValueError:
        return None
