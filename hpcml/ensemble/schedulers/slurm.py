"""Slurm: ``sbatch`` scripts, ``srun`` steps, ``scontrol requeue`` (Frontier, Perlmutter, slurm-local)."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcml import env
from hpcml.ensemble.rules import Fact, Queue, Source
from hpcml.ensemble.schedulers.base import Scheduler, epoch
from hpcml.ensemble.checks import warning_seconds

if TYPE_CHECKING:  # pragma: no cover
    from hpcml.ensemble.jobscript import JobSpec
    from hpcml.ensemble.site import Site, SiteRequest

SBATCH = Source(url="https://slurm.schedmd.com/sbatch.html", read="2026-11-25")
SRUN = Source(url="https://slurm.schedmd.com/srun.html", read="2026-11-25")

_REQUEUE = """\
if [ "$rc" -eq {nf} ]; then
    if [ "${{SLURM_RESTART_COUNT:-0}}" -lt {max} ]; then
        echo "hpcml-job: not finished (exit {nf}): requeueing job $SLURM_JOB_ID" >&2
        scontrol requeue "$SLURM_JOB_ID" && exit 0
    else
        echo "hpcml-job: not finished after {max} requeues: giving up" >&2
    fi
fi
"""


class Slurm(Scheduler):
    name = "slurm"
    suffix = ".sbatch"
    workdir_var = "$SLURM_SUBMIT_DIR"
    nodes_var = "SLURM_NNODES"
    launcher = "srun"
    node_range = True
    queue_kinds = ("partition", "qos")

    def header(self, spec: JobSpec, queue: Queue | None) -> list[Fact]:
        lo, hi = spec.nodes
        lines = [
            Fact(text=f"#SBATCH --job-name={spec.name}", why="the job's name in squeue and its output file"),
            Fact(text=f"#SBATCH --nodes={lo}" + (f"-{hi}" if hi != lo else ""),
                 why="a range restarts a requeued job on the nodes left after losing one" if hi != lo
                 else "whole nodes: one training rank per device", source=SBATCH),
            Fact(text=f"#SBATCH --time={spec.walltime}", why="the walltime; every timeout inside follows from it"),
            Fact(text="#SBATCH --exclusive", why="whole nodes: the ranks and the simulations' steps use every core"),
            Fact(text=f"#SBATCH --signal=B:USR1@{spec.warn_s}",
                 why=f"SIGUSR1 to the batch shell {spec.warn_s} s before the walltime: the job saves and exits 75",
                 source=SBATCH),
            Fact(text=f"#SBATCH --output={spec.name}-%j.out", why="one output file per job id"),
            Fact(text="#SBATCH --open-mode=append", why="a requeued job appends to its output instead of erasing it",
                 source=SBATCH),
        ]
        if spec.requeue:
            lines.append(Fact(text="#SBATCH --requeue", why="Slurm may requeue the job after a node failure, and "
                              "the job itself on exit 75 where its queue allows", source=SBATCH))
        else:
            lines.append(Fact(text="#SBATCH --no-requeue", why="asked for (--no-requeue)"))
        return lines + self.account_and_queue(spec, queue, "#SBATCH --account=")

    def queue_directive(self, name: str, kind: str) -> str:
        return f"#SBATCH --{kind}={name}"

    def requeue_block(self, spec: JobSpec, script: str) -> str:
        from hpcml.env import NOT_FINISHED

        return _REQUEUE.format(nf=NOT_FINISHED, max=spec.max_requeues)

    def submit_argv(self, path: Path) -> list[str]:
        return ["sbatch", "--parsable", str(path)]

    def parse_job_id(self, stdout: str) -> str | None:
        """``--parsable`` prints ``ID`` or ``ID;cluster``."""
        lines = stdout.strip().splitlines()
        job_id = lines[-1].split(";")[0].strip() if lines else ""
        return job_id if job_id.isdigit() else None

    def nodes(self, environ: Mapping[str, str]) -> tuple[str, ...]:
        return tuple(env.expand_hostlist(environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", "")))

    def deadline(self, job_id: str, environ: Mapping[str, str]) -> float | None:
        """The job's end as ``squeue`` reports it (Slurm before 23.02 exports no SLURM_JOB_END_TIME)."""
        try:
            out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True,
                                 timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return epoch(out.stdout, "%Y-%m-%dT%H:%M:%S")

    def narrow_nodes(self, nodes: Sequence[str], run_dir: Path) -> list[str]:
        names = ",".join(nodes)
        return [f"export SLURM_NODELIST={names} SLURM_JOB_NODELIST={names}"]

    def pin_hosts(self, line: str, hosts: Sequence[str]) -> str:
        head, _, rest = line.partition(" ")
        if not hosts or head != "srun":
            return super().pin_hosts(line, hosts)
        return f"srun --nodelist={','.join(hosts)} {rest}".rstrip()

    def allocate_line(self, site: Site, line: str, *, walltime: str, account: str | None, queue: str | None,
                      nodes: int, run_dir: Path, argv: Sequence[str], ranks: int | None) -> str:
        """``srun`` with the job's own options; the warning goes to the ranks, which save and exit 75."""
        row = site.pick_queue(nodes, walltime, queue)
        opts = [f"--time={walltime}", f"--signal=USR1@{warning_seconds(walltime)}"]
        opts += [f"--account={account}"] if account else []
        opts += [f"--{row.kind}={row.name}"] if row is not None else [f"--partition={queue}"] if queue else []
        head, _, rest = line.partition(" ")
        return f"{head} {' '.join(opts)} {rest}"

    def provider(self, site: Site, request: SiteRequest, queue: Queue | None, common: dict[str, Any]):
        """One exclusive block with the site's directives (``--constraint=gpu``). No
        ``cores_per_node``: it adds ``--cpus-per-task``, which every srun step inherits (Parsl #3006)."""
        from parsl.providers import SlurmProvider

        where: dict[str, Any] = {}
        if queue is not None:
            where[queue.kind] = queue.name
        elif request.queue:
            where["partition"] = request.queue
        return SlurmProvider(account=request.account, exclusive=True,
                             scheduler_options="\n".join(d.text for d in site.job_directives),
                             **where, **dict(site.block_options), **common)
