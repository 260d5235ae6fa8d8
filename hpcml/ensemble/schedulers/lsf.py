"""IBM Spectrum LSF with jsrun: ``bsub`` scripts, resource sets, resubmission (Summit, retired)."""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcml.ensemble.rules import Fact, Queue, Source
from hpcml.ensemble.schedulers.base import Resubmitting, first_match

if TYPE_CHECKING:  # pragma: no cover
    from hpcml.ensemble.jobscript import JobSpec
    from hpcml.ensemble.site import Site, SiteRequest

BSUB = Source(url="https://www.ibm.com/docs/en/spectrum-lsf/10.1.0?topic=reference-bsub", read="2026-11-25")


class LSF(Resubmitting):
    name = "lsf"
    suffix = ".lsf"
    workdir_var = "$LS_SUBCWD"
    launcher = "jsrun"
    submit_again = 'HPCML_RESTART_COUNT=$((n + 1)) bsub < "$hpcml_script"'  # bsub passes the environment
    submit_and_wait = "bsub -K < {path}"

    def header(self, spec: JobSpec, queue: Queue | None) -> list[Fact]:
        hours, rest = divmod(math.ceil(spec.walltime_s / 60), 60)  # -W and -wt in minutes
        lines = [
            Fact(text=f"#BSUB -J {spec.name}", why="the job's name in bjobs"),
            Fact(text=f"#BSUB -nnodes {spec.nodes[0]}", why="whole nodes (jsrun places resource sets in them)"),
            Fact(text=f"#BSUB -W {hours}:{rest:02d}", why="the walltime in minutes, rounded up"),
            Fact(text=f"#BSUB -o {spec.name}.%J.out", why="one output file per job id"),
            Fact(text="#BSUB -wa USR1", why="the walltime warning arrives as SIGUSR1", source=BSUB),
            Fact(text=f"#BSUB -wt {max(1, math.ceil(spec.warn_s / 60))}",
                 why="minutes before the walltime that the warning comes", source=BSUB),
        ]
        return lines + self.account_and_queue(spec, queue, "#BSUB -P ")

    def queue_directive(self, name: str, kind: str) -> str:
        return f"#BSUB -q {name}"

    def submit_argv(self, path: Path) -> list[str]:
        return ["bash", "-c", f"bsub < {shlex.quote(str(path))}"]  # the directives are read from stdin only

    def parse_job_id(self, stdout: str) -> str | None:
        """``Job <12345> is submitted to queue <batch>.``"""
        return first_match(stdout, r"Job <(\d+)>")

    def signal_argv(self, job_id: str, signal_name: str | None) -> list[str]:
        return ["bkill", "-s", signal_name, job_id] if signal_name else ["bkill", job_id]

    def nodes(self, environ: Mapping[str, str]) -> tuple[str, ...]:
        """``LSB_MCPU_HOSTS="launch 1 h1 42 h2 42"``: the first host is the launch node, not a compute node."""
        words = environ.get("LSB_MCPU_HOSTS", "").split()
        return tuple(dict.fromkeys(words[2::2]))

    def pin_hosts(self, line: str, hosts: Sequence[str]) -> str:
        return line  # jsrun places by resource sets within the job's nodes

    def provider(self, site: Site, request: SiteRequest, queue: Queue | None, common: dict[str, Any]):
        """One LSF block of ``nodes``; ``account`` is the project (``#BSUB -P``)."""
        from parsl.providers import LSFProvider

        return LSFProvider(project=request.account, queue=queue.name if queue else request.queue,
                           **dict(site.block_options), **common)
