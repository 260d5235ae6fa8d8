"""The small pieces of the scheduler path: the stop flag, the running job's nodes (PBS and
LSF faked by their variables and node files, which cannot exist here), the campaign's modes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hpcml import stop
from hpcml.ensemble import Campaign, attempt_text, attempts, load_site
from hpcml.ensemble.allocation import Allocation, current
from hpcml.errors import ConfigError


def test_stop_flag_records_the_first_signal_and_ignores_late_ones():
    code = textwrap.dedent("""
        import os, signal, time
        from hpcml import stop
        stop.install()
        assert stop.requested() is None
        os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.05)
        print(stop.requested())
        stop.finished()
        os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.05)   # ignored: the run is over
        print("alive")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.split()) == (0, ["SIGUSR1", "alive"]), out.stderr


def test_stop_request_and_clear_in_process():
    stop.clear()
    stop.request("test")
    stop.request("later")
    assert stop.requested() == "test"
    stop.clear()
    assert stop.requested() is None


def test_allocation_of_a_pbs_job_from_its_node_file(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x1\nx1\nx2\nx3\n")  # PBS repeats a node per slot
    alloc = current(load_site("polaris"), {"PBS_JOBID": "7.polaris", "PBS_NODEFILE": str(nodefile),
                                            "HPCML_JOB_DEADLINE": "1795400000"})
    assert alloc == Allocation(scheduler="pbs", job_id="7.polaris", nodes=("x1", "x2", "x3"), deadline=1795400000.0)
    assert alloc.split(1) == (("x1",), ("x2", "x3"))
    with pytest.raises(ConfigError, match=r"job 7.polaris has 3 node\(s\) \(x1, x2, x3\); the training job takes 3"):
        alloc.split(3)


def test_allocation_of_an_lsf_job_skips_the_launch_node():
    alloc = current(load_site("summit"), {"LSB_JOBID": "5", "LSB_MCPU_HOSTS": "batch1 1 h1 42 h2 42"})
    assert (alloc.nodes, alloc.deadline) == (("h1", "h2"), None)


def test_no_allocation_outside_a_job_of_the_sites_scheduler():
    assert current(load_site("polaris"), {}) is None
    assert current(load_site("polaris"), {"SLURM_JOB_ID": "3"}) is None  # another scheduler's job
    assert current(load_site("local"), {"SLURM_JOB_ID": "3"}) is None


def test_campaign_allocation_mode_outside_a_job_is_one_line(tmp_path, monkeypatch):
    for var in [v for v in os.environ if v.startswith(("SLURM_", "PBS_", "LSB_"))]:
        monkeypatch.delenv(var)
    c = Campaign(run_dir=tmp_path, site="frontier", mode="allocation", progress=False)
    with pytest.raises(ConfigError, match=r"^mode='allocation' but this process is not in a slurm job of site "
                                          r"frontier: run the driver inside the job \(hpcml job --driver\)$"):
        c.allocation()
    with pytest.raises(ConfigError, match="mode='both' must be one of auto, allocation, pilot"):
        Campaign(run_dir=tmp_path, site="frontier", mode="both")
    assert Campaign(run_dir=tmp_path, site="frontier", mode="pilot").allocation() is None


def test_pilot_trainer_on_pbs_is_signalled_and_stopped_through_the_scheduler(tmp_path, monkeypatch):
    """A pilot campaign's trainer on PBS is a batch job its `qsub -W block=true` client waits
    for: the walltime warning and a stop go to the job (qsig, qdel), not to the client --
    whose death would leave the job running. Only qsub/qsig/qdel are faked (no PBS here)."""
    from hpcml.ensemble.spec import TrainingJob
    from hpcml.ensemble.trainer_proc import TrainerProcess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"qsub": f"echo 42.pbs01\nwhile [ ! -e {tmp_path}/gone ]; do sleep 0.05; done\n",
                       "qsig": f"echo \"$@\" >> {tmp_path}/qsig.log\n",
                       "qdel": f"echo \"$@\" >> {tmp_path}/qdel.log; touch {tmp_path}/gone\n"}.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    tp = TrainerProcess(TrainingJob(argv=["t"]), line=lambda job: f"qsub -V -W block=true {tmp_path}/train.pbs",
                        run_dir=tmp_path, env={}, grace_s=5)
    tp.start()
    deadline = time.monotonic() + 10
    while tp.batch_job() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tp.batch_job() == ("pbs", "42.pbs01")
    tp.signal(signal.SIGUSR1)
    assert (tmp_path / "qsig.log").read_text().split() == ["-s", "USR1", "42.pbs01"] and tp.running
    tp.stop()
    assert (tmp_path / "qdel.log").read_text().split() == ["42.pbs01"] and not tp.running


def _fake_srun(tmp_path, monkeypatch):
    """An `srun` that logs its options and runs the command after them (no Slurm here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!/bin/bash\necho \"$@\" >> {tmp_path}/srun.log\n"
                                  "while [[ $# -gt 0 && $1 == -* ]]; do shift; done\nexec \"$@\"\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    for var in [v for v in os.environ if v.startswith(("SLURM_", "PBS_", "LSB_", "HPCML_JOB"))]:
        monkeypatch.delenv(var)
    return tmp_path / "srun.log"


def _no_parsl(monkeypatch) -> None:
    import parsl

    def refuse(*a, **k):
        raise AssertionError("a training-only run must not build or load a Parsl config")

    monkeypatch.setattr(Campaign, "make_config", refuse)
    monkeypatch.setattr(parsl, "load", refuse)


def test_training_alone_in_pilot_mode_loads_no_parsl_and_submits_no_block(tmp_path, monkeypatch):
    """Offline training (Campaign.train) from a login node: the trainer gets its own
    allocation and no simulation block is ever built, let alone submitted."""
    import json

    from hpcml.ensemble.spec import TrainingJob

    log = _fake_srun(tmp_path, monkeypatch)
    _no_parsl(monkeypatch)
    run_dir = tmp_path / "run"
    c = Campaign(run_dir=run_dir, site="slurm-local", mode="pilot", site_options={"walltime": "00:10:00"},
                 progress=False)
    res = c.train(TrainingJob(argv=[sys.executable, "-c", "print('trained')"], nodes=1))
    assert (res.status, res.total, res.training_returncode, res.completed) == ("ok", 0, 0, [])
    assert log.read_text().split()[:5] == ["--time=00:10:00", "--signal=USR1@60", "--partition=debug", "-N1", "-n2"]
    assert (run_dir / "train.out").read_text() == "trained\n"
    assert sorted(p.name for p in run_dir.iterdir()) == ["campaign_id.json", "train.err", "train.out",
                                                        "trainer.lease", "training.json"]  # no parsl/, no sims/
    assert json.loads((run_dir / "training.json").read_text())["status"] == "ok"


def test_training_alone_in_one_allocation_takes_every_node(tmp_path, monkeypatch):
    """Inside a one-node job, offline training takes the node: none is kept for simulations."""
    from hpcml.ensemble.spec import TrainingJob

    log = _fake_srun(tmp_path, monkeypatch)
    _no_parsl(monkeypatch)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n1")
    monkeypatch.setenv("HPCML_JOB_DEADLINE", str(int(time.time()) + 3600))
    assert Allocation(scheduler="slurm", job_id="77", nodes=("n1",), deadline=None).split(1, sims=False) == (
        ("n1",), ())
    c = Campaign(run_dir=tmp_path / "run", site="slurm-local", mode="allocation", progress=False)
    res = c.train(TrainingJob(argv=[sys.executable, "-c", "pass"], nodes=1))
    assert (res.status, res.training_returncode) == ("ok", 0)
    assert log.read_text().split()[:3] == ["--nodelist=n1", "-N1", "-n2"]


def test_a_failed_simulation_names_its_attempt_err_file(tmp_path):
    from parsl.app.errors import BashExitFailure

    d = attempts.sim_dir(tmp_path, 3)
    d.mkdir(parents=True)
    for k in (0, 1):  # two attempts (one retry), both failed
        (d / f"attempt_{k}.start").write_text(json.dumps({"start": 1.0, "host": "n1"}))
        (d / f"attempt_{k}.end").write_text(json.dumps({"returncode": 2, "end": 3.0, "reason": ""}))
        (d / f"attempt_{k}.err").write_text(f"reading mesh\n\nValueError: kappa {k} out of range\n")
    exc = BashExitFailure("hpcml_sim", 2)
    assert attempt_text.describe(exc) == "exit code 2"
    recorded: dict[int, dict] = {}
    n = attempts.record_ended(tmp_path, d, sim_id=3, params={"kappa": 1.0}, argv=["sim"], launch="", first=0,
                              recorded=recorded, final=True, exc=exc)
    assert n == 2 and [r["status"] for r in recorded.values()] == ["failed", "failed"]
    # what the runner logs: "simulation 3 failed after 2 attempt(s): <describe(exc)>"
    assert attempt_text.describe(exc) == (f"exit code 2 (see {d / 'attempt_1.err'}: reading mesh / "
                                      f"ValueError: kappa 1 out of range)")
    attempts.record_ended(tmp_path, d, sim_id=3, params={}, argv=[], launch="", first=0, recorded=recorded,
                          final=True, exc=exc)  # recorded again (a cancellation sweep): the note stays one
    assert attempt_text.describe(exc).count("attempt_1.err") == 1


def test_the_trainers_exit_says_why_it_was_not_relaunched(tmp_path):
    """A trainer that exits 78 (a mistake, or training that diverged) is never relaunched: the
    line says so instead of 'none left', which read as if the restarts had been spent."""
    from hpcml.contract import CONFIG_ERROR, INCOMPLETE
    from hpcml.ensemble.spec import TrainingJob
    from hpcml.ensemble.trainer_proc import TrainerProcess

    tp = TrainerProcess(TrainingJob(argv=["t"], max_restarts=2), line=lambda job: "true", run_dir=tmp_path, env={},
                        grace_s=5)
    (tmp_path / "train.err").write_text("train_surrogate: error: training diverged: ...\n")
    said = {}
    for code in (CONFIG_ERROR, INCOMPLETE, 9):
        tp.returncode = code
        said[code] = tp.message(f"exited with code {code}")
    assert "; 0 of 2 restart(s) used, none made: a relaunch would repeat it (see " in said[CONFIG_ERROR]
    assert said[CONFIG_ERROR].endswith("train.err): train_surrogate: error: training diverged: ...")
    assert "; 0 of 2 restart(s) used, none made: it trained, samples are what is missing (see " in said[INCOMPLETE]
    assert "; 0 of 2 restart(s) used, none left (see " in said[9]
