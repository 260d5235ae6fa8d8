"""The Slurm tests run against the two-node cluster of scripts/slurm_cluster.sh, which
`make test-slurm` starts and stops (scripts/slurm_tests.sh). Run alone, they start it."""

from __future__ import annotations

import getpass
import os
import subprocess

import pytest

from tests.slurm.scenarios import ROOT, cluster_up


@pytest.fixture(scope="session", autouse=True)
def cluster():
    if not cluster_up():
        out = subprocess.run(["bash", str(ROOT / "scripts" / "slurm_cluster.sh"), "start"], capture_output=True,
                             text=True, timeout=300)
        if out.returncode != 0:
            pytest.fail(f"the Slurm cluster did not start: {out.stderr[-2000:]}", pytrace=False)
    yield


def _lane_jobs() -> list[str]:
    """The ids of the queued or running jobs of this lane: scripts/slurm_tests.sh runs the walltime
    test beside the others, and each lane cancels only its own (``HPCML_SLURM_ONLY``: job names
    that are this lane's; ``HPCML_SLURM_SPARE``: job names that are the other lane's)."""
    from tests.slurm.scenarios import sh

    only = [n for n in os.environ.get("HPCML_SLURM_ONLY", "").split(",") if n]
    spare = [n for n in os.environ.get("HPCML_SLURM_SPARE", "").split(",") if n]
    rows = [line.split(None, 1) for line in sh("squeue", "-h", "-o", "%i %j").stdout.splitlines() if line.strip()]
    return [i for i, *name in rows if (not only or (name and name[0] in only)) and not (name and name[0] in spare)]


@pytest.fixture(autouse=True)
def no_jobs_left():
    """A test's jobs end with it (a failed test must not leave one competing with the next)."""
    yield
    from tests.slurm.scenarios import sh, wait_until

    if os.environ.get("HPCML_SLURM_ONLY") or os.environ.get("HPCML_SLURM_SPARE"):
        jobs = _lane_jobs()
        if jobs:
            sh("scancel", *jobs)
        wait_until(lambda: not _lane_jobs(), 60, "this lane's jobs to end")
        return
    sh("scancel", "--user", getpass.getuser())
    wait_until(lambda: not sh("squeue", "-h").stdout.strip(), 60, "the queue to empty")
