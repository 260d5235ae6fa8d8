"""The outer batch job a user would otherwise write by hand, for any site: ``hpcml job``.

One script per scheduler (Slurm, PBS Pro, LSF) with the same run protocol:

- directives: nodes (a range ``1-2`` on Slurm, so a requeued job restarts on the nodes that
  are left), walltime, account, queue, the site's own lines; the job is rerunnable;
- the site's modules and environment, this Python environment, ``HPCML_JOB_DEADLINE``
  (epoch seconds of the walltime's end: every timeout inside follows from it);
- the command, under the site's training launch line (or as is with ``driver``: a
  campaign driver launches its own steps);
- the walltime warning arrives as SIGUSR1 (``--signal=B:USR1@S`` on Slurm, ``-wa/-wt`` on
  LSF, a timer on PBS, which sends none) and is forwarded to the command, which saves
  and exits with :data:`NOT_FINISHED` (75, EX_TEMPFAIL);
- on exit 75 the job requeues itself (``scontrol requeue``; on PBS and LSF it submits its
  own script again, counting) and the next run resumes from ``latest``.
"""

from __future__ import annotations

import math
import re
import shlex
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpcml.ensemble.site import Site, check_count, environment_lines, load_site, walltime_seconds, warning_seconds
from hpcml.env import NOT_FINISHED
from hpcml.errors import ConfigError, LaunchError

#: Script file suffix per scheduler.
SUFFIX = {"slurm": ".sbatch", "pbs": ".pbs", "lsf": ".lsf"}

_NODES = re.compile(r"(\d+)(?:-(\d+))?")


def parse_nodes(value: object) -> tuple[int, int]:
    """``2`` or ``"2"`` -> (2, 2); ``"1-2"`` -> (1, 2): a node count or a Slurm node range."""
    if isinstance(value, int) and not isinstance(value, bool):
        return check_count("nodes", value), value
    m = _NODES.fullmatch(value) if isinstance(value, str) else None
    lo, hi = (int(m[1]), int(m[2] or m[1])) if m else (0, 0)
    if not m or lo < 1 or hi < lo:
        raise ConfigError(f"nodes={value!r} must be a count N >= 1 or a range MIN-MAX with 1 <= MIN <= MAX")
    return lo, hi


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """One batch job. ``repr()`` names everything the script depends on."""

    site: Site
    command: tuple[str, ...]
    """The program and its arguments (a training script, or a campaign driver with ``driver``)."""
    nodes: tuple[int, int]
    """(min, max) nodes; min < max only on Slurm: the job restarts on fewer after losing one."""
    walltime: str
    account: str | None = None
    queue: str | None = None
    name: str = "hpcml"
    driver: bool = False
    """Run ``command`` as is on the job's first node: it launches its own steps (a Campaign)."""
    ranks: int | None = None
    """Training ranks (default: one per device of every node); not with a node range."""
    warn_s: int | None = None
    """Seconds before the walltime that SIGUSR1 arrives (default :func:`warning_seconds`)."""
    requeue: bool = True
    max_requeues: int = 10
    workdir: str | None = None
    """Where the job runs (default: where it was submitted)."""
    script_path: str | None = None
    """Where this script is saved: PBS resubmits it from there (it has no requeue of its own)."""

    def __post_init__(self) -> None:
        if isinstance(self.command, str) or not self.command or not all(isinstance(a, str) for a in self.command):
            raise ConfigError(f"command={self.command!r} must be a non-empty list of strings (after --)")
        object.__setattr__(self, "command", tuple(self.command))
        lo, hi = parse_nodes(f"{self.nodes[0]}-{self.nodes[1]}" if isinstance(self.nodes, tuple) else self.nodes)
        object.__setattr__(self, "nodes", (lo, hi))
        if self.site.scheduler == "local":
            raise ConfigError(f"site {self.site.name} has no batch system: run the command directly, or pick a "
                              f"batch site (hpcml job --site slurm-local)")
        if lo != hi and self.site.scheduler != "slurm":
            raise ConfigError(f"nodes={lo}-{hi}: a node range needs Slurm; {self.site.name} ({self.site.scheduler}) "
                              f"takes a fixed count")
        if self.ranks is not None:
            check_count("ranks", self.ranks)
            if lo != hi:
                raise ConfigError(f"ranks={self.ranks} with nodes={lo}-{hi}: the rank count follows the nodes "
                                  f"({self.site.train_ranks_per_node} per node)")
        total = walltime_seconds(self.walltime)
        warn = self.warn_s if self.warn_s is not None else warning_seconds(self.walltime)
        if isinstance(warn, bool) or not isinstance(warn, int) or not 0 < warn < total:
            raise ConfigError(f"warn_s={warn!r} must be an integer of seconds in 1..{total - 1} (walltime "
                              f"{self.walltime})")
        object.__setattr__(self, "warn_s", warn)
        check_count("max_requeues", self.max_requeues, minimum=0)
        self.launch_line("SLURM_NNODES")  # ranks that do not fit the nodes fail here, not in the job
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.name):
            raise ConfigError(f"name={self.name!r} must be 1-64 letters, digits, '_', '.' or '-'")

    @property
    def walltime_s(self) -> int:
        return walltime_seconds(self.walltime)

    def launch_line(self, nodes_var: str) -> str:
        """The command under the site's launch line; node count from ``nodes_var`` when it varies."""
        if self.driver:
            return shlex.join(self.command)
        lo, hi = self.nodes
        if lo == hi:
            return self.site.train_line(self.command, nodes=lo, ranks=self.ranks)
        per = self.site.train_ranks_per_node
        line = self.site.train_launch.format(nodes=f"${nodes_var}", ranks=f"$(({per} * {nodes_var}))",
                                             ranks_per_node=per)
        return f"{line} {shlex.join(self.command)}"


# ----------------------------------------------------------------------------- rendering

def _header(spec: JobSpec) -> list[str]:
    s, (lo, hi) = spec.site, spec.nodes
    queue = s.queue_for(hi, spec.queue)
    if s.scheduler == "slurm":
        lines = [f"#SBATCH --job-name={spec.name}", f"#SBATCH --nodes={lo}" + (f"-{hi}" if hi != lo else ""),
                 f"#SBATCH --time={spec.walltime}", "#SBATCH --exclusive",
                 f"#SBATCH --signal=B:USR1@{spec.warn_s}", f"#SBATCH --output={spec.name}-%j.out",
                 "#SBATCH --open-mode=append"]
        lines += ["#SBATCH --requeue"] if spec.requeue else ["#SBATCH --no-requeue"]
        lines += [f"#SBATCH --account={spec.account}"] if spec.account else []
        lines += [f"#SBATCH --{s.queue_kind}={queue}"] if queue else []
    elif s.scheduler == "pbs":
        select = f"select={lo}" + (f":{s.select_options}" if s.select_options else "")
        lines = [f"#PBS -N {spec.name}", f"#PBS -l {select}", f"#PBS -l walltime={spec.walltime}",
                 f"#PBS -r {'y' if spec.requeue else 'n'}", "#PBS -j oe"]  # output: NAME.o<job id>, one per job
        lines += [f"#PBS -A {spec.account}"] if spec.account else []
        lines += [f"#PBS -q {queue}"] if queue else []
    else:  # lsf: -W and -wt in minutes
        hours, rest = divmod(math.ceil(spec.walltime_s / 60), 60)
        lines = [f"#BSUB -J {spec.name}", f"#BSUB -nnodes {lo}", f"#BSUB -W {hours}:{rest:02d}",
                 f"#BSUB -o {spec.name}.%J.out", "#BSUB -wa USR1", f"#BSUB -wt {max(1, math.ceil(spec.warn_s / 60))}"]
        lines += [f"#BSUB -P {spec.account}"] if spec.account else []
        lines += [f"#BSUB -q {queue}"] if queue else []
    return lines + list(s.job_directives)


_RUN = """\
# Run. The walltime warning arrives here as SIGUSR1 and goes on to the job, which saves a
# checkpoint and exits {nf} ("not finished"); the job is then requeued and resumes.
{launch} &
hpcml_pid=$!
trap 'echo "hpcml-job: walltime warning: the job saves and stops" >&2; kill -USR1 "$hpcml_pid" 2>/dev/null' USR1
{timer}while :; do
    wait "$hpcml_pid"; rc=$?
    kill -0 "$hpcml_pid" 2>/dev/null || break  # wait ended by the trap: the job still runs
done
{untimer}"""

_REQUEUE_SLURM = """\
if [ "$rc" -eq {nf} ]; then
    if [ "${{SLURM_RESTART_COUNT:-0}}" -lt {max} ]; then
        echo "hpcml-job: not finished (exit {nf}): requeueing job $SLURM_JOB_ID" >&2
        scontrol requeue "$SLURM_JOB_ID" && exit 0
    else
        echo "hpcml-job: not finished after {max} requeues: giving up" >&2
    fi
fi
"""
# PBS has no requeue for users, and LSF's `bsub -Q` knows no limit: submit this script again,
# counting. HPCML_JOB_SCRIPT overrides where it is (the default: as `hpcml job --script` wrote it).
_RESUBMIT = """\
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
_SUBMIT_AGAIN = {"pbs": 'qsub -v HPCML_RESTART_COUNT=$((n + 1)) "$hpcml_script"',
                 "lsf": 'HPCML_RESTART_COUNT=$((n + 1)) bsub < "$hpcml_script"'}  # bsub passes the environment


def render(spec: JobSpec) -> str:
    """The whole batch script of ``spec``."""
    s = spec.site
    workdir = spec.workdir or {"slurm": "$SLURM_SUBMIT_DIR", "pbs": "$PBS_O_WORKDIR", "lsf": "$LS_SUBCWD"}[s.scheduler]
    script = spec.script_path or f"{workdir}/{spec.name}{SUFFIX[s.scheduler]}"
    timer = untimer = ""
    if s.scheduler == "pbs":  # PBS sends no warning: a timer does, warn_s before the end
        timer = (f"(sleep {spec.walltime_s - spec.warn_s} && kill -USR1 $$) &  # the walltime warning\n"
                 "hpcml_timer=$!\n")
        untimer = 'kill "$hpcml_timer" 2>/dev/null\n'
    lines = ["#!/bin/bash", *_header(spec), "",
             f"# Written by `hpcml job --site {s.name}`: the site's environment, then the run.",
             f"cd {_quote_path(workdir)}", *environment_lines(s),
             f'export HPCML_SITE={s.name} HPCML_JOB_DEADLINE=$(( $(date +%s) + {spec.walltime_s} ))']
    body = _RUN.format(nf=NOT_FINISHED, launch=spec.launch_line("SLURM_NNODES"), timer=timer, untimer=untimer)
    requeue = ""
    if spec.requeue and s.scheduler == "slurm":
        requeue = _REQUEUE_SLURM.format(nf=NOT_FINISHED, max=spec.max_requeues)
    elif spec.requeue:
        requeue = _RESUBMIT.format(nf=NOT_FINISHED, max=spec.max_requeues, script=_quote_path(script),
                                   submit=_SUBMIT_AGAIN[s.scheduler])
    return "\n".join(lines) + "\n" + body + requeue + 'exit "$rc"\n'


def _quote_path(path: str) -> str:
    """Shell-quote ``path`` but let a leading ``$VAR`` expand."""
    m = re.fullmatch(r"(\$\w+)(/.*)?", path)
    if m:
        return f'"{m[1]}"' + (shlex.quote(m[2]) if m[2] else "")
    return shlex.quote(path)


# ----------------------------------------------------------------------------- submitting

def submit(spec: JobSpec, path: str | Path) -> str:
    """Write the script to ``path`` and submit it; the job id."""
    path = Path(path).resolve()
    if spec.script_path is None and spec.site.scheduler in ("pbs", "lsf"):
        spec = JobSpec(**{**spec.__dict__, "script_path": str(path)})
    path.write_text(render(spec))
    path.chmod(0o755)
    cmd = {"slurm": ["sbatch", "--parsable", str(path)], "pbs": ["qsub", str(path)],
           "lsf": ["bash", "-c", f"bsub < {shlex.quote(str(path))}"]}[spec.site.scheduler]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise LaunchError(f"{cmd[0]} not found: submit {path} on a login node of {spec.site.name}") from None
    if out.returncode != 0:
        said = (out.stderr.strip() or out.stdout.strip() or "no output").splitlines()[-1]
        raise LaunchError(f"{' '.join(cmd[:2])} failed ({out.returncode}): {said}")
    text = out.stdout.strip()
    m = re.search(r"Job <(\d+)>", text) if spec.site.scheduler == "lsf" else None
    return m[1] if m else text.split(";")[0].splitlines()[-1]


def allocate_line(site: Site, line: str, *, walltime: str, account: str | None, queue: str | None, nodes: int,
                  run_dir: Path, argv: Sequence[str], ranks: int | None) -> str:
    """A training launch line that gets its own allocation from a login node (pilot mode):
    ``srun`` with the job's options on Slurm; elsewhere the training job as a batch script
    submitted and waited for (``qsub -W block=true``, ``bsub -K``), whose exit status it returns."""
    if site.scheduler == "slurm":  # the warning goes to the ranks themselves: they save and exit 75
        queue = site.queue_for(nodes, queue)
        opts = [f"--time={walltime}", f"--signal=USR1@{warning_seconds(walltime)}"] + \
            ([f"--account={account}"] if account else []) + ([f"--{site.queue_kind}={queue}"] if queue else [])
        head, _, rest = line.partition(" ")
        return f"{head} {' '.join(opts)} {rest}"
    spec = JobSpec(site=site, command=tuple(argv), nodes=(nodes, nodes), walltime=walltime, account=account,
                   queue=queue, ranks=ranks, name="hpcml-train", requeue=False, workdir=str(run_dir))
    path = run_dir / f"train{SUFFIX[site.scheduler]}"
    path.write_text(render(spec))
    quoted = shlex.quote(str(path))
    # -V: the trainer needs the campaign's environment (done file, stream); bsub passes it anyway
    return f"qsub -V -W block=true {quoted}" if site.scheduler == "pbs" else f"bsub -K < {quoted}"


def job_spec(*, site: str | Site, command: Sequence[str], nodes: int | str, walltime: str, **options) -> JobSpec:
    """A :class:`JobSpec` from a site name and plain values (what ``hpcml job`` calls)."""
    return JobSpec(site=load_site(site), command=tuple(command), nodes=parse_nodes(nodes), walltime=walltime,
                   **options)
