"""The Slurm tests run against the two-node cluster of scripts/slurm_cluster.sh, which
`make test-slurm` starts and stops (scripts/slurm_tests.sh). Run alone, they start it."""

from __future__ import annotations

import getpass
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


@pytest.fixture(autouse=True)
def no_jobs_left():
    """A test's jobs end with it (a failed test must not leave one competing with the next)."""
    yield
    from tests.slurm.scenarios import sh, wait_until

    sh("scancel", "--user", getpass.getuser())
    wait_until(lambda: not sh("squeue", "-h").stdout.strip(), 60, "the queue to empty")
