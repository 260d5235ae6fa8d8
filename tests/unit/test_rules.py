"""Facility rules as data (hpcml.ensemble.rules, site_configs/*): the queue chosen from nodes AND
walltime at every row boundary of every table, the account rule, queues that cannot requeue,
and the scheduler classes' own parsing (job ids, node lists) against what the commands print."""

from __future__ import annotations

import pytest

from hpcml.cli import main
from hpcml.ensemble import jobscript, schedulers
from hpcml.ensemble.rules import Account, Queue, Source, account_for, pick_queue
from hpcml.ensemble.site import list_sites, load_site
from hpcml.errors import ConfigError

SRC = Source(url="https://example.org/queues", read="2026-01-01")


def _clock(seconds: int) -> str:
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _sites_with_tables():
    return [n for n in list_sites() if load_site(n).queues]


@pytest.mark.parametrize("name", _sites_with_tables())
def test_every_row_boundary_of_every_table(name):
    """At each automatic row's corners (min and max nodes, its walltime limit) the chosen row
    holds the job; one second more, or one node past the table, goes elsewhere or is refused."""
    s = load_site(name)
    auto = [q for q in s.queues if q.auto]
    for row in auto:
        for nodes in {row.min_nodes, row.max_nodes or row.min_nodes + 1000}:
            chosen = s.pick_queue(nodes, row.max_walltime)
            assert chosen is not None and chosen.fits(nodes, row.max_walltime_s)
            assert auto.index(chosen) <= auto.index(row)  # an earlier row that holds it wins, never a later one
            over = _clock(row.max_walltime_s + 1)
            holders = [q for q in auto if q.fits(nodes, row.max_walltime_s + 1)]
            if holders:
                assert s.pick_queue(nodes, over) is holders[0]
            else:
                with pytest.raises(ConfigError, match=f"no queue of {name} takes {nodes} node"):
                    s.pick_queue(nodes, over)
        # the named row is taken on request at its limits, and refused past them
        assert s.pick_queue(row.min_nodes, row.max_walltime, row.name).name == row.name
    for row in s.queues:
        assert s.pick_queue(row.min_nodes, row.max_walltime, row.name).name == row.name


# The facilities' tables, pinned: (site, nodes, walltime) -> queue, from the pages in site_configs.
GOLDEN = [
    ("polaris", 1, "01:00:00", "debug"), ("polaris", 2, "01:00:00", "debug"), ("polaris", 3, "00:10:00",
                                                                                "debug-scaling"),
    ("polaris", 10, "01:00:00", "debug-scaling"), ("polaris", 2, "02:00:00", "capacity"),
    ("polaris", 4, "168:00:00", "capacity"), ("polaris", 10, "03:00:00", "prod"), ("polaris", 24, "03:00:00", "prod"),
    ("polaris", 25, "06:00:00", "prod"), ("polaris", 100, "24:00:00", "prod"), ("polaris", 496, "24:00:00", "prod"),
    ("aurora", 1, "01:00:00", "debug"), ("aurora", 2, "01:00:00", "debug"), ("aurora", 3, "01:00:00",
                                                                             "debug-scaling"),
    ("aurora", 256, "01:00:00", "debug-scaling"), ("aurora", 2, "02:00:00", "capacity"),
    ("aurora", 16, "168:00:00", "capacity"), ("aurora", 256, "12:00:00", "prod"), ("aurora", 1025, "18:00:00", "prod"),
    ("aurora", 10624, "24:00:00", "prod"),
    ("frontier", 1, "02:00:00", "batch"), ("frontier", 91, "02:00:00", "batch"), ("frontier", 92, "06:00:00", "batch"),
    ("frontier", 184, "12:00:00", "batch"), ("frontier", 9472, "12:00:00", "batch"),
    ("frontier", 2, "02:00:01", "extended"), ("frontier", 64, "24:00:00", "extended"),
    ("perlmutter", 8, "00:30:00", "regular"), ("perlmutter", 9, "00:30:00", "regular"),  # debug: on request (issue 41)
    ("perlmutter", 2, "48:00:00", "regular"),
    ("summit", 45, "02:00:00", "batch"), ("summit", 46, "06:00:00", "batch"), ("summit", 4608, "24:00:00", "batch"),
    ("slurm-local", 2, "100:00:00", "debug"),
]


@pytest.mark.parametrize("name, nodes, walltime, queue", GOLDEN)
def test_facility_tables(name, nodes, walltime, queue):
    assert load_site(name).pick_queue(nodes, walltime).name == queue


@pytest.mark.parametrize("name, nodes, walltime, words", [
    ("polaris", 11, "03:00:01", "no queue of polaris takes 11 node(s) for 03:00:01: at most 03:00:00 for 11 node(s)"),
    ("polaris", 497, "01:00:00", "no queue of polaris takes 497 node(s) for 01:00:00: no row holds 497 node(s)"),
    ("aurora", 20, "02:00:00", "no queue of aurora takes 20 node(s) for 02:00:00: at most 01:00:00 for 20 node(s)"),
    ("frontier", 65, "06:00:00", "no queue of frontier takes 65 node(s) for 06:00:00: at most 02:00:00"),
    ("frontier", 2, "24:00:01", "at most 24:00:00 for 2 node(s)"),
    ("perlmutter", 2, "48:00:01", "at most 48:00:00 for 2 node(s)"),
    ("slurm-local", 3, "00:10:00", "no row holds 3 node(s) (debug: 1-2 nodes"),
])
def test_no_queue_fits_is_one_line_with_the_limits(name, nodes, walltime, words):
    with pytest.raises(ConfigError) as info:
        load_site(name).pick_queue(nodes, walltime)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert f"; source {load_site(name).queues[0].source.url})" in str(info.value)


def test_a_named_queue_is_checked_against_its_rows():
    polaris = load_site("polaris")
    with pytest.raises(ConfigError, match=r"queue debug of polaris does not take 2 node\(s\) for 02:00:00: "
                                          r"at most 01:00:00 for 2 node\(s\) \(debug: 1-2 nodes, 00:05:00-01:00:00"):
        polaris.pick_queue(2, "02:00:00", "debug")
    assert polaris.pick_queue(5, "50:00:00", "preemptable").name == "preemptable"  # not auto, but asked for
    assert polaris.pick_queue(2, "01:00:00", "my-reservation") is None  # not in the table: the user's own
    frontier = load_site("frontier")
    assert frontier.pick_queue(500, "02:00:00", "debug").kind == "qos"


def test_a_queue_not_in_the_table_is_used_with_a_note(monkeypatch):
    monkeypatch.setenv("HPCML_ACCOUNT", "p1")
    spec = jobscript.job_spec(site="polaris", command=["t"], nodes=2, walltime="01:00:00", queue="R12345")
    assert "#PBS -q R12345" in jobscript.render(spec).splitlines()
    assert spec.notes == ("queue R12345 is not in polaris's table (debug, debug-scaling, prod, capacity, preemptable, "
                          "demand): its limits are not checked",)


def test_queue_rows_validate_themselves():
    with pytest.raises(ConfigError, match="max_queued=1 leaves no place for a resubmitted job: requeue=False"):
        Queue(name="d", max_walltime="01:00:00", max_queued=1, source=SRC)
    with pytest.raises(ConfigError, match="max_nodes=1 must be an integer >= min_nodes=2"):
        Queue(name="d", min_nodes=2, max_nodes=1, max_walltime="01:00:00", source=SRC)
    with pytest.raises(ConfigError, match="kind='part' must be one of partition, qos, queue"):
        Queue(name="d", kind="part", max_walltime="01:00:00", source=SRC)
    with pytest.raises(ConfigError, match="source read='yesterday' must be a date YYYY-MM-DD"):
        Source(url="https://x.org", read="yesterday")
    assert pick_queue("x", (), 5, "01:00:00") is None


# ----------------------------------------------------------------------------- accounts

def test_account_required_names_the_option_and_the_variable():
    rule = Account(required=True, why="the facility says so", source=SRC)
    with pytest.raises(ConfigError) as info:
        account_for("polaris", rule, None, environ={})
    assert str(info.value) == ("site polaris requires an account: pass --account PROJECT or set HPCML_ACCOUNT "
                               "(the facility says so) (https://example.org/queues)")
    assert account_for("polaris", rule, None, environ={"HPCML_ACCOUNT": "p9"}) == "p9"
    assert account_for("polaris", rule, "given", environ={"HPCML_ACCOUNT": "p9"}) == "given"
    assert account_for("perlmutter", Account(required=False, why="default project"), None, environ={}) is None
    with pytest.raises(ConfigError, match="account='a b' must be a project name"):
        account_for("polaris", rule, "a b", environ={})


@pytest.mark.parametrize("name, option", [("polaris", "#PBS -A"), ("aurora", "#PBS -A"),
                                          ("frontier", "#SBATCH --account"), ("summit", "#BSUB -P")])
def test_hpcml_job_without_account_is_refused(name, option, monkeypatch, capsys):
    monkeypatch.delenv("HPCML_ACCOUNT", raising=False)
    assert main(["job", "--site", name, "--nodes", "1", "--walltime", "00:30:00", "--", "python", "t.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hpcml: error: site {name} requires an account: pass --account PROJECT or set "
                          "HPCML_ACCOUNT") and "\n" not in err
    monkeypatch.setenv("HPCML_ACCOUNT", "envproj")
    assert main(["job", "--site", name, "--nodes", "1", "--walltime", "00:30:00", "--", "python", "t.py"]) == 0
    assert f"{option}{'=' if '--' in option else ' '}envproj" in capsys.readouterr().out.splitlines()


# ----------------------------------------------------------------------------- requeue

@pytest.mark.parametrize("name, nodes, queue", [("aurora", 1, None), ("aurora", 3, None), ("polaris", 3, None),
                                                ("frontier", 1, "debug")])
def test_queues_that_cannot_requeue_say_so_and_write_no_chain(name, nodes, queue, monkeypatch, capsys):
    monkeypatch.setenv("HPCML_ACCOUNT", "p1")
    args = ["job", "--site", name, "--nodes", str(nodes), "--walltime", "00:30:00"]
    args += ["--queue", queue] if queue else []
    assert main([*args, "--", "python", "t.py"]) == 0
    out, err = capsys.readouterr()
    assert "scontrol requeue" not in out and "qsub -v HPCML_RESTART_COUNT" not in out
    assert "it is not requeued" in out
    row = load_site(name).pick_queue(nodes, "00:30:00", queue)
    assert err.strip() == (f"hpcml job: note: queue {row.name} cannot requeue this job: {row.note}; on exit 75 (not "
                           "finished) submit the script again once it has ended, or choose a queue without that limit")


def test_requeue_chain_where_the_queue_allows(monkeypatch, capsys):
    monkeypatch.setenv("HPCML_ACCOUNT", "p1")
    assert main(["job", "--site", "aurora", "--nodes", "2", "--walltime", "02:00:00", "--", "python", "t.py"]) == 0
    out = capsys.readouterr().out
    assert "#PBS -q capacity" in out and 'qsub -v HPCML_RESTART_COUNT=$((n + 1)) "$hpcml_script"' in out


# ----------------------------------------------------------------------------- explain

def test_explain_gives_every_line_a_reason_and_the_sources(monkeypatch, capsys):
    monkeypatch.setenv("HPCML_ACCOUNT", "p1")
    args = ["job", "--site", "polaris", "--nodes", "2", "--walltime", "02:00:00", "--", "python", "t.py"]
    assert main(args) == 0
    script = capsys.readouterr().out
    assert main([*args[:1], "--explain", *args[1:]]) == 0
    explained = capsys.readouterr().out
    lines = explained.splitlines()
    kept = [ln for ln in lines if not ln.startswith("    ^ ")]
    assert "\n".join(kept) + "\n" == script  # the script itself, in order, nothing left out
    whys = [ln for ln in lines if ln.startswith("    ^ why: ")]
    assert len(whys) == len(jobscript.facts(jobscript.job_spec(site="polaris", command=["python", "t.py"], nodes=2,
                                                                walltime="02:00:00")))
    text = explained
    assert ("#PBS -q capacity\n    ^ why: chosen for 2 node(s) and 02:00:00: capacity: 1-4 nodes, 00:05:00-168:00:00, "
            "1 running, 2 queued or running per user\n    ^ source: https://docs.alcf.anl.gov/polaris/running-jobs/ "
            "(read 2026-02-17)") in text
    assert ("export NCCL_NET='AWS Libfabric'\n    ^ why: use the aws-ofi-nccl plugin (ALCF: 2-3x for some "
            "communication workloads)\n    ^ source: https://docs.alcf.anl.gov/polaris/applications-and-libraries/"
            "libraries/nccl/ (read 2025-01-21)") in text
    assert "export HPCML_GPU_MAP=3,2,1,0\n    ^ why: GPU i sits on NUMA domain 3-i" in text


# ----------------------------------------------------------------------------- the sites' facts

def test_collective_plugins_and_binding_on_every_gpu_site(monkeypatch):
    monkeypatch.setenv("HPCML_ACCOUNT", "p1")
    text = {n: jobscript.render(jobscript.job_spec(site=n, command=["python", "t.py"], nodes=2, walltime="01:00:00"))
            for n in ("frontier", "polaris", "perlmutter", "aurora")}
    assert "module load rccl-net-plugin craype-accel-amd-gfx90a" in text["frontier"]
    assert "#SBATCH --network=disable_rdzv_get" not in text["frontier"]  # on the training step only (issue 41)
    assert " --network=disable_rdzv_get python t.py &" in text["frontier"]
    assert "export MIOPEN_USER_DB_PATH=/tmp/hpcml-miopen" in text["frontier"]
    assert "export NCCL_NET='AWS Libfabric'" in text["polaris"] and "/soft/libraries/aws-ofi-nccl/" in text["polaris"]
    assert "module load nccl-plugin" in text["perlmutter"]
    for var in ("CCL_PROCESS_LAUNCHER=pmix", "CCL_ATL_TRANSPORT=mpi", "CCL_KVS_MODE=mpi",
                "FI_MR_CACHE_MONITOR=userfaultfd", "TMPDIR=/tmp"):
        assert f"export {var}" in text["aurora"].splitlines()
    for name in ("polaris", "perlmutter"):  # A100 i on NUMA domain 3-i
        assert "export HPCML_GPU_MAP=3,2,1,0" in text[name].splitlines()
    for name in ("frontier", "aurora"):  # one device per rank by the launcher (closest GCD) or tiles in order
        assert "HPCML_GPU_MAP" not in text[name]


def test_perlmutter_steps_ask_for_gpu_nodes_in_batch_and_pilot(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCML_ACCOUNT", "m1_g")
    s = load_site("perlmutter")
    batch = jobscript.render(jobscript.job_spec(site=s, command=["python", "t.py"], nodes=2, walltime="01:00:00"))
    assert "#SBATCH --constraint=gpu" in batch.splitlines()
    assert "srun -C gpu -N2 -n8 -c32 --cpu-bind=cores --gpus-per-node=4 --gpu-bind=none python t.py &" in batch
    line = s.train_line(["python", "t.py"], nodes=1)
    pilot = jobscript.allocate_line(s, line, walltime="01:00:00", account=None, queue=None, nodes=1,
                                    run_dir=tmp_path, argv=["python", "t.py"], ranks=None)
    assert pilot == ("srun --time=01:00:00 --signal=USR1@360 --account=m1_g --qos=regular -C gpu -N1 -n4 -c32 "
                     "--cpu-bind=cores --gpus-per-node=4 --gpu-bind=none python t.py")


def test_retired_summit_says_so(monkeypatch, capsys):
    monkeypatch.setenv("HPCML_ACCOUNT", "p1")
    assert main(["job", "--site", "summit", "--nodes", "1", "--walltime", "01:00:00", "--", "python", "t.py"]) == 0
    err = capsys.readouterr().err
    assert "hpcml job: note: site summit is retired (decommissioned on 2024-11-15 (OLCF)" in err


# ----------------------------------------------------------------------------- scheduler classes

@pytest.mark.parametrize("scheduler, stdout, job_id", [
    ("slurm", "12345\n", "12345"), ("slurm", "12345;frontier\n", "12345"), ("slurm", "sbatch: queued\n", None),
    ("pbs", "4242.polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov\n", "4242.polaris-pbs-01.hsn.cm.polaris.alcf.anl.gov"),
    ("pbs", "qsub: would exceed queue generic's per-user limit\n", None),
    ("lsf", "Job <13> is submitted to queue <batch>.\n", "13"), ("lsf", "Request aborted by esub.\n", None),
])
def test_job_ids_as_the_commands_print_them(scheduler, stdout, job_id):
    assert schedulers.get(scheduler).parse_job_id(stdout) == job_id


def test_a_failed_submission_keeps_everything_the_scheduler_said(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "qsub").write_text("#!/bin/bash\necho 'checking limits'\n"
                                  "echo 'qsub: Account_Name is required to be set.' >&2\necho 'second line' >&2\n"
                                  "exit 38\n")
    (bin_dir / "qsub").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("HPCML_ACCOUNT", "p1")
    spec = jobscript.job_spec(site="polaris", command=["t.py"], nodes=1, walltime="00:10:00")
    with pytest.raises(schedulers.SubmitError) as info:
        jobscript.submit(spec, tmp_path / "job.pbs")
    e = info.value
    assert (e.returncode, e.stdout, e.stderr) == (38, "checking limits\n", "qsub: Account_Name is required to be set."
                                                  "\nsecond line\n")
    assert e.argv == ["qsub", str(tmp_path / "job.pbs")]
    assert str(e) == f"qsub {tmp_path / 'job.pbs'} failed (38): second line"
    rc = main(["job", "--site", "polaris", "--nodes", "1", "--walltime", "00:10:00", "--submit", "--script",
               str(tmp_path / "j.pbs"), "--", "t.py"])
    err = capsys.readouterr().err
    assert rc == 2 and "exit code: 38" in err and "qsub: Account_Name is required to be set." in err \
        and "stdout:\nchecking limits" in err


def test_node_lists_from_each_scheduler(tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("x1\nx1\nx2\n")
    assert schedulers.get("pbs").nodes({"PBS_NODEFILE": str(nodefile)}) == ("x1", "x2")
    assert schedulers.get("slurm").nodes({"SLURM_JOB_NODELIST": "nid[001-002,010]"}) == ("nid001", "nid002", "nid010")
    assert schedulers.get("lsf").nodes({"LSB_MCPU_HOSTS": "batch1 1 h1 42 h2 42"}) == ("h1", "h2")
    assert schedulers.get("local").nodes({}) == ()
    with pytest.raises(ConfigError, match="scheduler 'sge' is not one of slurm, pbs, lsf, local"):
        schedulers.get("sge")
