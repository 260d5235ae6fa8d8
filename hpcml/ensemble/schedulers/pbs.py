"""PBS Pro with PALS: ``qsub`` scripts, PALS ``mpiexec``, resubmission instead of requeue (Polaris, Aurora)."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcml import safeio
from hpcml.ensemble.rules import Fact, Queue, Source
from hpcml.ensemble.schedulers.base import Resubmitting, first_match

if TYPE_CHECKING:  # pragma: no cover
    from hpcml.ensemble.jobscript import JobSpec
    from hpcml.ensemble.site import Site, SiteRequest

QUEUE_RERUN = Source(url="https://docs.alcf.anl.gov/polaris/running-jobs/", read="2026-02-17")

class PBS(Resubmitting):
    name = "pbs"
    suffix = ".pbs"
    workdir_var = "$PBS_O_WORKDIR"
    nodes_var = ""
    launcher = "mpiexec"
    sends_warning = False
    submit_again = 'qsub -v HPCML_RESTART_COUNT=$((n + 1)) "$hpcml_script"'
    # -V: the trainer needs the campaign's environment; -W block=true: qsub returns its exit status
    submit_and_wait = "qsub -V -W block=true {path}"

    def header(self, spec: JobSpec, queue: Queue | None) -> list[Fact]:
        lo = spec.nodes[0]
        select = f"select={lo}" + (f":{spec.site.select_options}" if spec.site.select_options else "")
        lines = [
            Fact(text=f"#PBS -N {spec.name}", why="the job's name in qstat and its output file"),
            Fact(text=f"#PBS -l {select}", why="whole nodes, one chunk each", source=spec.site.select_source),
            Fact(text=f"#PBS -l walltime={spec.walltime}", why="the walltime; every timeout inside follows from it"),
            Fact(text=f"#PBS -r {'y' if spec.requeue else 'n'}",
                 why="rerunnable: PBS may rerun it after a node failure or preemption" if spec.requeue
                 else "asked for (--no-requeue)", source=QUEUE_RERUN),
            Fact(text="#PBS -j oe", why="output and errors in one file, NAME.o<job id>"),
        ]
        return lines + self.account_and_queue(spec, queue, "#PBS -A ")

    def queue_directive(self, name: str, kind: str) -> str:
        return f"#PBS -q {name}"

    def submit_argv(self, path: Path) -> list[str]:
        return ["qsub", str(path)]

    def parse_job_id(self, stdout: str) -> str | None:
        """``qsub`` prints ``123456.polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov`` on a line of its own."""
        return first_match(stdout, r"(?m)^\s*(\d+(?:\[\d*\])?(?:\.[\w.-]+)?)\s*$")

    def signal_argv(self, job_id: str, signal_name: str | None) -> list[str]:
        return ["qsig", "-s", signal_name, job_id] if signal_name else ["qdel", job_id]

    def nodes(self, environ: Mapping[str, str]) -> tuple[str, ...]:
        path = environ.get("PBS_NODEFILE")
        if not path:
            return ()
        with open(path) as f:  # one line per chunk (MPI rank slot): each node once, in order
            return tuple(dict.fromkeys(line.strip() for line in f if line.strip()))

    def narrow_nodes(self, nodes: Sequence[str], run_dir: Path) -> list[str]:
        nodefile = Path(run_dir) / "sim_nodes"
        nodefile.parent.mkdir(parents=True, exist_ok=True)
        safeio.replace(nodefile, "".join(f"{n}\n" for n in nodes))
        return [f"export PBS_NODEFILE={shlex.quote(str(nodefile))}"]

    def provider(self, site: Site, request: SiteRequest, queue: Queue | None, common: dict[str, Any]):
        """One PBS block; ``account`` and ``queue`` go on the ``qsub`` line, the site's
        directives in the block's script."""
        from parsl.providers import PBSProProvider

        return PBSProProvider(account=request.account, queue=queue.name if queue else request.queue,
                              select_options=site.select_options,
                              scheduler_options="\n".join(d.text for d in site.job_directives),
                              **dict(site.block_options), **common)

