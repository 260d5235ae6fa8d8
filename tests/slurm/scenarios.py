"""Jobs on the real two-node Slurm cluster (scripts/slurm_cluster.sh), as a user submits them.

Shared by tests/slurm and benchmarks/slurm_overhead.py: submit with ``hpcml job``, watch a
job's state and its run directory, take a node away, read what the runs wrote.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
BIN = Path(PY).parent
LLM = str(ROOT / "workflows" / "llm_pretrain.py")
HEAT = str(ROOT / "workflows" / "heat_surrogate.py")
STATE = Path(os.environ.get("HPCML_SLURM_DIR", "/tmp/hpcml-slurm"))
#: The environment of a user's shell pointed at the cluster; no launcher variables of ours leak in.
ENV = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPI_LOCAL", "SLURM_", "OMPI_", "PYTEST"))}
ENV["SLURM_CONF"] = str(STATE / "slurm.conf")
ENV["PATH"] = f"{BIN}{os.pathsep}{ENV.get('PATH', '')}"


def sh(*cmd: str, timeout: float = 120, cwd: Path | None = None, check: bool = False) -> subprocess.CompletedProcess:
    out = subprocess.run(list(cmd), capture_output=True, text=True, env=ENV, timeout=timeout, cwd=cwd or ROOT)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd[:3])} ... exited {out.returncode}: {out.stderr[-2000:]}")
    return out


def cluster_up() -> bool:
    return sh("bash", str(ROOT / "scripts" / "slurm_cluster.sh"), "status").returncode == 0


def submit(workdir: Path, name: str, *, nodes: str, walltime: str, cmd: Sequence[str], driver: bool = False,
           warn: int | None = None, ranks: int | None = None) -> str:
    """``hpcml job --submit`` from ``workdir``; the job id."""
    workdir.mkdir(parents=True, exist_ok=True)
    args = [str(BIN / "hpcml"), "job", "--site", "slurm-local", "--nodes", nodes, "--walltime", walltime,
            "--name", name, "--script", str(workdir / f"{name}.sbatch"), "--submit"]
    args += ["--driver"] if driver else []
    args += ["--warn", str(warn)] if warn is not None else []
    args += ["--ranks", str(ranks)] if ranks is not None else []
    out = sh(*args, "--", *cmd, cwd=workdir, check=True)
    job_id = out.stdout.strip().splitlines()[0]
    assert job_id.isdigit(), out.stdout
    return job_id


def job(job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict (JobState, Restarts, NodeList, ExitCode, ...)."""
    out = sh("scontrol", "show", "job", "-o", job_id).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def wait_done(job_id: str, timeout_s: float = 300) -> dict[str, str]:
    """Until the job has ended for good (not pending, running or requeued); its record."""
    return wait_until(lambda: (j := job(job_id)).get("JobState") in
                      ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY") and j,
                      timeout_s, f"job {job_id} to end")


def metrics(run_dir: Path) -> list[dict]:
    """Every record of ``metrics.jsonl``, across the jobs of a requeued run (appended)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def segments(records: list[dict]) -> list[list[dict]]:
    """The runs of a requeued job: a new one starts after a step that stopped on a signal
    (``stop``: it saved there), or where the step goes back (a run that died resumed from
    an earlier checkpoint)."""
    out: list[list[dict]] = []
    for r in records:
        if not out or out[-1][-1].get("stop") or r["step"] <= out[-1][-1]["step"]:
            out.append([])
        out[-1].append(r)
    return out


def final_losses(records: list[dict]) -> dict[int, float]:
    """The loss of each step as the run that finished computed it (the last record of a step)."""
    return {r["step"]: r["loss"] for r in records}


def reference_losses(n: int, *args: str, timeout: float = 600) -> list[float]:
    """An uninterrupted run of llm_pretrain under plain mpiexec: the losses to compare with."""
    out = subprocess.run(["mpiexec", "-n", str(n), PY, LLM, *args, "--no-progress"], capture_output=True, text=True,
                         env={k: v for k, v in ENV.items() if k != "SLURM_CONF"}, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["losses"]


def node_state(node: str) -> str:
    return sh("sinfo", "-h", "-n", node, "-o", "%t").stdout.strip()


def set_node(node: str, state: str, reason: str = "hpcml-test") -> None:
    extra = [f"reason={reason}"] if state == "down" else []
    sh("scontrol", "update", f"nodename={node}", f"state={state}", *extra, check=True)


def kill_tasks_on(node: str, job_id: str) -> list[int]:
    """SIGKILL every task of ``job_id`` on ``node``, as a node that dies takes its processes
    (no signal to save on, no goodbye to the peers); the pids killed."""
    killed = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            environ = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in environ and f"SLURMD_NODENAME={node}".encode() in environ \
                and b"SLURM_STEP_ID=0" in environ:
            try:
                os.kill(int(d.name), 9)
                killed.append(int(d.name))
            except ProcessLookupError:
                pass
    return killed


def node_loss(workdir: Path, *, steps: int = 16, every: int = 4, fail_after: int = 6,
              layout: Sequence[str] = ("--tp", "2")) -> dict:
    """A 2-node training job (``--nodes 1-2``, requeue) loses node n2 after ``fail_after``
    steps: its ranks die (SIGKILL) and the node goes DOWN; Slurm requeues the job on n1
    alone; it resumes from the latest checkpoint on the layout that fits and finishes.

    Returns what happened: the job's restarts, the steps lost (done but not checkpointed),
    seconds from the failure to the first step after it, the layouts of both runs, and the
    losses of every step as the finishing run computed them.
    """
    ck, run = workdir / "ck", workdir / "run"
    cmd = [PY, LLM, *layout, "--steps", str(steps), "--seed", "0", "--no-progress", "--ckpt-dir", str(ck),
           "--ckpt-every", str(every), "--auto-resume", "--run-dir", str(run)]
    job_id = submit(workdir, "nodeloss", nodes="1-2", walltime="00:15:00", cmd=cmd)
    try:
        wait_until(lambda: len(metrics(run)) >= fail_after, 240, f"{fail_after} steps of job {job_id}")
        t_fail = time.time()
        killed = kill_tasks_on("n2", job_id)
        set_node("n2", "down")
        assert killed, f"no task of job {job_id} found on n2"
        record = wait_done(job_id, 300)
    finally:
        if node_state("n2").startswith(("down", "drain")):
            set_node("n2", "resume")
    records = metrics(run)
    parts = segments(records)
    out_file = workdir / f"nodeloss-{job_id}.out"
    layouts = [json.loads(line)["layout"] for line in out_file.read_text().splitlines() if line.startswith('{"layout"')]
    before, after = parts[0], parts[-1]
    return {"job_id": job_id, "state": record.get("JobState"), "restarts": int(record.get("Restarts", 0)),
            "runs": len(parts), "last_step_before": before[-1]["step"], "resumed_at": after[0]["step"],
            "steps_lost": before[-1]["step"] - (after[0]["step"] - 1), "checkpoint_every": every,
            "recovery_s": after[0]["time"] - t_fail, "layouts": layouts, "losses": final_losses(records),
            "nodes_after": record.get("NodeList")}
