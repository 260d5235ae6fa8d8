"""`hpcml job`: the outer batch script of every site, against golden copies, and its run
protocol (walltime warning -> exit 75 -> requeue). Slurm runs it for real in tests/slurm;
here PBS's protocol runs with only what cannot exist on this machine faked: the PBS
environment and its `qsub`.

Regenerate the golden scripts after a deliberate change: HPCML_REGEN_GOLDEN=1 pytest tests/unit/test_jobscript.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcml.cli import main
from hpcml.ensemble import jobscript
from hpcml.ensemble.jobscript import JobSpec, job_spec, render
from hpcml.ensemble.site import load_site
from hpcml.errors import ConfigError

GOLDEN = Path(__file__).parent / "golden" / "jobs"
BATCH = ["aurora", "frontier", "perlmutter", "polaris", "slurm-local", "summit"]
TRAIN = ["python", "train.py", "--tag", "a b"]
DRIVER = ["python", "workflows/heat_surrogate.py", "--site", "SITE", "--resume"]


@pytest.fixture(autouse=True)
def _account(monkeypatch):
    """Sites that require an account get it from $HPCML_ACCOUNT unless a test says otherwise."""
    monkeypatch.setenv("HPCML_ACCOUNT", "proj42")


def _normal(text: str) -> str:
    return text.replace(sys.prefix, "<venv>")


def _scripts(name: str) -> str:
    train = render(job_spec(site=name, command=TRAIN, nodes=2, walltime="02:00:00", account="proj42"))
    driver = render(job_spec(site=name, command=[a.replace("SITE", name) for a in DRIVER],
                             nodes=2 if name == "slurm-local" else 3,
                             walltime="00:30:00", driver=True, name="campaign"))
    return _normal(f"# ---- training job, 2 nodes\n{train}\n# ---- campaign driver\n{driver}")


@pytest.mark.parametrize("name", BATCH)
def test_golden_scripts(name):
    path = GOLDEN / f"{name}.txt"
    text = _scripts(name)
    if os.environ.get("HPCML_REGEN_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name}: the script changed; regenerate with HPCML_REGEN_GOLDEN=1 if meant"


@pytest.mark.parametrize("name", BATCH)
def test_scripts_are_valid_bash_with_the_protocol(name, tmp_path):
    spec = job_spec(site=name, command=TRAIN, nodes=2, walltime="01:00:00")
    text = render(spec)
    (tmp_path / "job").write_text(text)
    subprocess.run(["bash", "-n", str(tmp_path / "job")], check=True)
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert "trap 'echo \"hpcml-job: walltime warning: the job saves and stops\" >&2; kill -USR1 \"$hpcml_pid\"" \
           " 2>/dev/null' USR1" in lines
    assert 'export HPCML_SITE=%s HPCML_JOB_DEADLINE=$(( $(date +%%s) + 3600 ))' % name in lines
    assert lines[-1] == 'exit "$rc"'
    # Aurora's debug queue (1 job per user) cannot take a resubmitted job: no chain is written
    assert ('[ "$rc" -eq 75 ]' in text) == (name != "aurora") == spec.requeue_allowed


def test_slurm_node_range_follows_the_nodes_it_gets():
    text = render(job_spec(site="frontier", command=["python", "t.py"], nodes="1-4", walltime="01:00:00"))
    assert "#SBATCH --nodes=1-4" in text.splitlines() and "#SBATCH --requeue" in text.splitlines()
    assert "srun -N$SLURM_NNODES -n$((8 * SLURM_NNODES)) -c7 --gpus-per-task=1 --gpu-bind=closest " \
           "--network=disable_rdzv_get python t.py &" \
        in text.splitlines()


@pytest.mark.parametrize("kwargs, message", [
    (dict(site="polaris", nodes="1-2"), "nodes=1-2: a node range needs Slurm; polaris (pbs) takes a fixed count"),
    (dict(site="local"), "site local has no batch system"),
    (dict(nodes="0"), "nodes='0' must be a count N >= 1 or a range MIN-MAX"),
    (dict(nodes="3-2"), "nodes='3-2' must be a count N >= 1 or a range MIN-MAX"),
    (dict(walltime="1:00"), "walltime='1:00' must be HH:MM:SS"),
    (dict(warn_s=3600), "warn_s=3600 must be an integer of seconds in 1..3599"),
    (dict(ranks=17), "ranks=17 > 16 devices on nodes=2 of frontier"),
    (dict(nodes="1-2", ranks=8), "ranks=8 with nodes=1-2: the rank count follows the nodes"),
    (dict(name="my job"), "name='my job' must be 1-64 letters"),
    (dict(command=[]), "command=() must be a non-empty list of strings"),
])
def test_bad_jobs_are_one_line_errors(kwargs, message):
    args = {"site": "frontier", "command": ["t.py"], "nodes": 2, "walltime": "01:00:00", **kwargs}
    with pytest.raises(ConfigError) as info:
        job_spec(**args)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_cli_prints_or_writes_the_script(tmp_path, capsys):
    assert main(["job", "--site", "perlmutter", "--nodes", "2", "--walltime", "00:30:00", "--account", "m123_g",
                 "--", "python", "t.py"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash\n") and "#SBATCH --account=m123_g" in out and "#SBATCH --qos=regular" in out
    path = tmp_path / "job.sbatch"
    assert main(["job", "--site", "frontier", "--nodes", "1", "--walltime", "00:30:00", "--script", str(path),
                 "--", "python", "t.py"]) == 0
    assert path.read_text().startswith("#!/bin/bash\n") and os.access(path, os.X_OK)
    assert main(["job", "--site", "frontier", "--nodes", "1", "--walltime", "00:30:00"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "hpcml: error: hpcml job needs the command after --, e.g. hpcml job ... -- python train.py")


def _fake(bin_dir: Path, name: str, body: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text("#!/bin/bash\n" + body)
    (bin_dir / name).chmod(0o755)


def test_pbs_protocol_timer_warns_and_resubmits(tmp_path):
    """On PBS no signal comes before the walltime: the script's timer sends it; the job
    saves, exits 75, and the script submits itself again with the restart count."""
    bin_dir = tmp_path / "bin"
    _fake(bin_dir, "qsub", f"echo \"$@\" >> {tmp_path}/qsub.log\necho 12.fake\n")
    job = tmp_path / "job.py"
    job.write_text("import signal, sys, time\n"
                   "signal.signal(signal.SIGUSR1, lambda *a: (print('saved', flush=True), sys.exit(75)))\n"
                   "time.sleep(60)\nsys.exit(0)\n")
    # a queue not in the table: ALCF's are 5 minutes at least, and this job lasts one
    spec = JobSpec(site=load_site("polaris"), command=(sys.executable, str(job)), nodes=(1, 1), walltime="00:01:00",
                   warn_s=58, driver=True, script_path=str(tmp_path / "job.pbs"), queue="testq")
    script = tmp_path / "job.pbs"
    script.write_text(render(spec).replace("module ", ": module "))  # no modules on this machine
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PBS_O_WORKDIR": str(tmp_path),
           "PBS_JOBID": "11.fake", "PBS_NODEFILE": str(tmp_path / "nodes")}
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["saved", "12.fake"]  # the job's line, then the id of the job that continues
    assert "hpcml-job: walltime warning: the job saves and stops" in out.stderr
    assert (tmp_path / "qsub.log").read_text().split() == ["-v", "HPCML_RESTART_COUNT=1", str(script)]
    env["HPCML_RESTART_COUNT"] = "10"  # the tenth resubmission: no more
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 75 and "not finished after 10 resubmissions: giving up" in out.stderr


def test_lsf_protocol_warns_and_resubmits_with_a_limit(tmp_path):
    """LSF sends the warning itself (-wa USR1 -wt); on 75 the script submits itself again,
    counting, up to --max-requeues (bsub -Q would requeue without a limit)."""
    bin_dir = tmp_path / "bin"
    _fake(bin_dir, "bsub", f"echo \"count=$HPCML_RESTART_COUNT $(head -c 11)\" >> {tmp_path}/bsub.log\n"
                           "echo 'Job <13> is submitted to queue <batch>.'\n")
    job = tmp_path / "job.py"
    job.write_text("import os, signal, sys, time\n"
                   "signal.signal(signal.SIGUSR1, lambda *a: sys.exit(75))\n"
                   "os.kill(os.getppid(), signal.SIGUSR1)\n"  # as LSF's -wa does to the batch script
                   "time.sleep(30)\n")
    spec = JobSpec(site=load_site("summit"), command=(sys.executable, str(job)), nodes=(1, 1), walltime="00:10:00",
                   driver=True, max_requeues=2, script_path=str(tmp_path / "job.lsf"))
    text = render(spec)
    assert "#BSUB -wa USR1" in text.splitlines() and "#BSUB -wt 1" in text.splitlines() and "-Q" not in text
    script = tmp_path / "job.lsf"
    script.write_text(text.replace("module ", ": module "))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LS_SUBCWD": str(tmp_path), "LSB_JOBID": "12"}
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 0 and "resubmitting" in out.stderr, out.stderr
    assert (tmp_path / "bsub.log").read_text().split() == ["count=1", "#!/bin/bash"]  # the script, on stdin
    env["HPCML_RESTART_COUNT"] = "2"
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 75 and "not finished after 2 resubmissions: giving up" in out.stderr


def test_a_printed_pbs_script_says_where_to_save_it(capsys):
    assert main(["job", "--site", "polaris", "--nodes", "1", "--walltime", "00:30:00", "--", "python", "t.py"]) == 0
    captured = capsys.readouterr()
    assert 'hpcml_script=${HPCML_JOB_SCRIPT:-"$PBS_O_WORKDIR"/hpcml.pbs}' in captured.out
    assert captured.err.strip() == ("hpcml job: save it as hpcml.pbs in the directory you submit from: on exit 75 it "
                                    "submits itself again from there (or set HPCML_JOB_SCRIPT, or use --script)")


def test_short_walltimes_get_a_warning_that_fits():
    assert job_spec(site="frontier", command=["t"], nodes=1, walltime="00:01:00").warn_s == 30
    assert job_spec(site="frontier", command=["t"], nodes=1, walltime="00:30:00").warn_s == 180
    assert job_spec(site="frontier", command=["t"], nodes=1, walltime="12:00:00").warn_s == 600


def test_submit_without_the_scheduler_is_one_line(tmp_path):
    spec = job_spec(site="polaris", command=["t.py"], nodes=1, walltime="00:10:00")
    env_path = os.environ["PATH"]
    os.environ["PATH"] = str(tmp_path)  # no qsub here
    try:
        with pytest.raises(Exception) as info:
            jobscript.submit(spec, tmp_path / "job.pbs")
    finally:
        os.environ["PATH"] = env_path
    assert str(info.value) == f"qsub not found: submit {tmp_path / 'job.pbs'} on a login node of polaris"


def test_site_pages_show_the_scripts_the_code_writes():
    """docs/sites/<site>.md's job scripts are generated (scripts/site_docs.py): never stale."""
    out = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[2] / "scripts" / "site_docs.py"),
                          "--check"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
