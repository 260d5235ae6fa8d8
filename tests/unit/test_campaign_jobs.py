"""Issue 41: a campaign's jobs fit the facility's per-user limits (hpcml.ensemble.campaign_jobs),
minimum walltimes are checked like maximums, and the corrected site lines are pinned."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import Counter

import pytest

from hpcml.ensemble import campaign_jobs, load_site
from hpcml.ensemble.rules import Queue, Source
from hpcml.errors import ConfigError

SITES = ("polaris", "aurora", "frontier", "perlmutter")


def _within_limits(got: campaign_jobs.CampaignJobs) -> None:
    """Every queue the plan uses holds no more jobs at once than its row allows."""
    per = Counter(j.queue for j in got.jobs)
    for j in got.jobs:
        r = j.row
        if r is None:
            continue
        assert got.running[j.queue] == per[j.queue]
        if r.max_running is not None:
            assert got.running[j.queue] <= r.max_running, (got, j)
        if r.max_queued is not None:
            assert got.queued[j.queue] <= r.max_queued, (got, j)
        assert r.fits(j.nodes, _s(j.walltime)), (j, r)


def _s(walltime: str) -> int:
    h, m, s = (int(x) for x in walltime.split(":"))
    return 3600 * h + 60 * m + s


def _clock(seconds: int) -> str:
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _boundaries(site):
    """(campaign nodes, walltime, queue) at every row's node and walltime boundaries."""
    for row in site.queues:
        hi = row.max_nodes if row.max_nodes is not None else row.min_nodes + 64
        for n in {row.min_nodes, hi}:
            for w in {max(row.min_walltime_s, 60), row.max_walltime_s}:
                for queue in (None, row.name):
                    yield n + 1, _clock(w), queue  # the trainer's node beside n for the simulations


@pytest.mark.parametrize("name", SITES)
def test_every_queue_row_at_its_boundaries_plans_within_the_limits(name):
    site = load_site(name)
    planned = refused = 0
    for nodes, walltime, queue in _boundaries(site):
        try:
            got = campaign_jobs.plan(site, nodes=nodes, walltime=walltime, queue=queue)
        except ConfigError as e:
            assert str(e).startswith(f"no way to run a campaign of {nodes} node(s) for {walltime} on {name}"), e
            refused += 1
            continue
        planned += 1
        _within_limits(got)
        if got.mode == "pilot":
            assert [j.role for j in got.jobs] == ["sims", "trainer"]
            assert [j.nodes for j in got.jobs] == [nodes - 1, 1]
            if got.considered:  # the trainer moved: the pilot's first queues had no room, nor did one job fit
                assert [c.split(":")[0] for c in got.considered] == ["pilot", "one-allocation"]
                assert got.jobs[0].queue != got.jobs[1].queue
        else:
            assert [j.role for j in got.jobs] == ["driver"] and got.jobs[0].nodes == nodes
            assert got.considered and got.considered[0].startswith("pilot:"), got  # only when the pilot did not fit
    assert planned > 0


def test_the_issues_campaigns():
    """Polaris 2 x 2 h and Aurora 2 x 30 min: a pilot's two jobs in a 1-running queue become one
    job; Frontier 64 x 6 h: extended's 1 running and 1 eligible; Perlmutter never picks debug."""
    got = campaign_jobs.plan(load_site("polaris"), nodes=2, walltime="02:00:00")
    assert (got.mode, [(j.role, j.queue) for j in got.jobs]) == ("one-allocation", [("driver", "capacity")])
    assert got.queued == {"capacity": 2}  # the job and the successor it submits (capacity: 2 queued or running)
    assert "2 jobs at once in capacity, which allows 1 running per user" in got.considered[0]
    got = campaign_jobs.plan(load_site("aurora"), nodes=2, walltime="00:30:00")
    assert (got.mode, got.jobs[0].queue, got.queued) == ("one-allocation", "debug", {"debug": 1})  # no chain
    got = campaign_jobs.plan(load_site("frontier"), nodes=64, walltime="06:00:00")
    assert (got.mode, got.jobs[0].queue, got.jobs[0].nodes) == ("one-allocation", "extended", 64)
    got = campaign_jobs.plan(load_site("perlmutter"), nodes=2, walltime="00:30:00")
    assert (got.mode, {j.queue for j in got.jobs}) == ("pilot", {"regular"})
    with pytest.raises(ConfigError, match=r"no way to run a campaign of 64 node\(s\) for 06:00:00 on aurora"):
        campaign_jobs.plan(load_site("aurora"), nodes=64, walltime="06:00:00")


def test_the_trainer_moves_to_a_queue_with_room():
    src = Source(url="https://example.org/queues", read="2026-11-28")
    site = dataclasses.replace(load_site("polaris"), queues=(
        Queue(name="one", min_nodes=1, max_nodes=8, max_walltime="04:00:00", max_running=1, max_queued=1,
              requeue=False, source=src),
        Queue(name="other", min_nodes=1, max_nodes=1, max_walltime="04:00:00", source=src)))
    got = campaign_jobs.plan(site, nodes=9, walltime="02:00:00", mode="pilot")  # one job of 9 fits nowhere
    assert [(j.role, j.queue) for j in got.jobs] == [("sims", "one"), ("trainer", "other")]
    assert got.running == {"one": 1, "other": 1}
    got = campaign_jobs.plan(site, nodes=4, walltime="02:00:00")  # auto: one job of 4 in "one" first
    assert got.mode == "one-allocation" and got.jobs[0].queue == "one"


def test_bad_plans_are_one_line():
    site = load_site("polaris")
    with pytest.raises(ConfigError, match="nodes=1 leaves no node for the simulations beside train_nodes=1"):
        campaign_jobs.plan(site, nodes=1, walltime="01:00:00")
    with pytest.raises(ConfigError, match="mode='both' must be one of auto, pilot, one-allocation"):
        campaign_jobs.plan(site, nodes=2, walltime="01:00:00", mode="both")


@pytest.mark.parametrize("name", ["polaris", "aurora"])
def test_alcf_minimum_walltime_refused_one_minute_under(name):
    """ALCF: every queue's minimum is 5 minutes (docs.alcf.anl.gov, the queue tables)."""
    from hpcml.ensemble.jobscript import job_spec

    site = load_site(name)
    assert {q.min_walltime for q in site.queues} == {"00:05:00"}
    for q in site.queues:
        nodes = q.min_nodes
        with pytest.raises(ConfigError, match=rf"queue {q.name} of {name} does not take {nodes} node\(s\) for "
                                              rf"00:04:00: at least 00:05:00"):
            site.pick_queue(nodes, "00:04:00", q.name)
        assert site.pick_queue(nodes, "00:05:00", q.name).name == q.name
    with pytest.raises(ConfigError, match=r"no queue of .* takes 1 node\(s\) for 00:04:59: at least 00:05:00"):
        job_spec(site=name, command=["python", "t.py"], nodes=1, walltime="00:04:59", account="P")


def test_corrected_queue_rows_are_pinned():
    p = {q.name: q for q in load_site("polaris").queues if q.name != "prod"}
    assert (p["capacity"].max_running, p["capacity"].max_queued) == (1, 2)
    assert (p["debug-scaling"].max_running, p["debug-scaling"].max_queued, p["debug-scaling"].requeue) == (1, 1, False)
    a = {q.name: q for q in load_site("aurora").queues if q.name != "prod"}
    assert (a["debug"].max_running, a["debug"].max_queued) == (1, 1)
    assert (a["capacity"].max_running, a["capacity"].max_queued) == (2, 5)
    f = {q.name: q for q in load_site("frontier").queues if q.name != "batch"}
    assert (f["extended"].max_running, f["extended"].max_queued) == (1, 2)
    d = next(q for q in load_site("perlmutter").queues if q.name == "debug")
    assert (d.auto, d.requeue, d.max_running, d.max_queued) == (False, False, 2, 5)
    assert "job chaining" in d.note


def test_perlmutter_debug_gets_no_requeue_chain():
    from hpcml.ensemble.jobscript import job_spec, render

    spec = job_spec(site="perlmutter", command=["python", "t.py"], nodes=2, walltime="00:30:00", queue="debug")
    assert not spec.requeue_allowed and "scontrol requeue" not in render(spec)  # no chain on exit 75
    assert any("cannot requeue" in n for n in spec.notes)
    auto = job_spec(site="perlmutter", command=["python", "t.py"], nodes=2, walltime="00:30:00")
    assert auto.queue_row.name == "regular" and "--qos=regular" in render(auto) and "scontrol requeue" in render(auto)


def test_queue_limits_validated():
    src = Source(url="https://example.org/q", read="2026-11-28")
    with pytest.raises(ConfigError, match="max_running=3 is over max_queued=2"):
        Queue(name="q", max_walltime="01:00:00", max_running=3, max_queued=2, source=src)
    with pytest.raises(ConfigError, match="min_walltime=02:00:00 is over max_walltime=01:00:00"):
        Queue(name="q", max_walltime="01:00:00", min_walltime="02:00:00", source=src)
    with pytest.raises(ConfigError, match="max_queued=1 leaves no place for a resubmitted job"):
        Queue(name="q", max_walltime="01:00:00", max_queued=1, source=src)


def test_cli_campaign_jobs_json_and_exit_2():
    cmd = [sys.executable, "-m", "hpcml.cli", "job", "--site", "frontier", "--nodes", "64", "--walltime",
           "06:00:00", "--driver", "--campaign-jobs", "--json", "--", "python", "drive.py"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["mode"] == "one-allocation" and d["max_running_at_once"] == 1
    assert d["jobs"] == [{"role": "driver", "queue": "extended", "nodes": 64, "walltime": "06:00:00",
                          "limits": {"running": 1, "queued": 2}}]
    assert d["limits"] == {"running": 1, "queued": 2}
    cmd[cmd.index("frontier")] = "aurora"
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == "" and len(out.stderr.strip().splitlines()) == 1
    assert out.stderr.startswith("hpcml: error: no way to run a campaign of 64 node(s) for 06:00:00 on aurora")


def test_a_pilot_campaign_that_fits_nowhere_is_refused_before_anything_is_submitted(tmp_path):
    from hpcml.ensemble import Campaign
    from hpcml.ensemble.spec import TrainingJob

    c = Campaign(run_dir=tmp_path / "run", site="polaris", mode="pilot",
                 site_options={"nodes": 1, "walltime": "02:00:00", "account": "P"})
    with pytest.raises(ConfigError, match=r"2 jobs at once in capacity, which allows 1 running per user.* run it as "
                                          r"one allocation instead: hpcml job --site polaris --nodes 2 --walltime "
                                          r"02:00:00 --driver"):
        c.plan_pilot(TrainingJob(argv=["python", "t.py"], nodes=1))
    ok = Campaign(run_dir=tmp_path / "run2", site="aurora", mode="pilot",
                  site_options={"nodes": 1, "walltime": "02:00:00", "account": "P"})
    ok.plan_pilot(TrainingJob(argv=["python", "t.py"], nodes=1))  # capacity: 2 running per user
    assert ok._trainer_queue is None


def test_frontier_mpi_simulations_carry_no_rccl_only_network_setting(tmp_path):
    """OLCF: --network=disable_rdzv_get "may negatively impact MPI performance"; it is for the
    RCCL plugin's alt_read rendezvous, so it goes on the training step alone."""
    from hpcml.ensemble.block_preview import render_batch_script
    from hpcml.ensemble.jobscript import job_spec, render

    site = load_site("frontier")
    assert site.sim_prefix(112) == "env -u NCCL_SOCKET_IFNAME -u FI_CXI_RDZV_PROTO $PARSL_MPI_PREFIX"
    block = render_batch_script(site.parsl_config(run_dir=str(tmp_path), nodes=2, walltime="02:00:00",
                                                  account="P")).text
    assert "disable_rdzv_get" not in block and "#SBATCH" in block
    driver = render(job_spec(site="frontier", command=["python", "d.py"], nodes=3, walltime="02:00:00", account="P",
                             driver=True))
    assert "disable_rdzv_get" not in driver  # a campaign's job: its simulations share it
    assert site.train_line(["python", "t.py"], nodes=2).endswith("--network=disable_rdzv_get python t.py")


def test_stale_site_prose_fails_the_docs_check():
    """Issue 41: hand-written statements of the site pages are checked against the site data."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("site_docs", root / "scripts" / "site_docs.py")
    docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(docs)
    for name in ("polaris", "frontier", "aurora", "perlmutter"):
        assert docs.prose_problems(name, (root / "docs" / "sites" / f"{name}.md").read_text()) == []
    assert docs.install_problems() == []
    polaris = (root / "docs" / "sites" / "polaris.md").read_text()
    stale = polaris.replace("binds GPU\n", "binds `local_rank % 4`, GPU\n")
    assert any("local_rank % N" in p for p in docs.prose_problems("polaris", stale))
    frontier = (root / "docs" / "sites" / "frontier.md").read_text()
    stale = frontier.replace('"env -u NCCL_SOCKET_IFNAME -u FI_CXI_RDZV_PROTO $PARSL_MPI_PREFIX"',
                             '"$PARSL_MPI_PREFIX"')
    assert any("sim_prefix" in p for p in docs.prose_problems("frontier", stale))
    aurora = (root / "docs" / "sites" / "aurora.md").read_text()
    stale = aurora.replace("\nmodule load frameworks\n", "\nmodule load frameworks cray-hdf5-parallel\n", 1)
    assert stale != aurora and any("module load frameworks cray-hdf5-parallel" in p
                                   for p in docs.prose_problems("aurora", stale))
    stale = aurora.replace("`capacity`, then `prod`", "then `prod`")
    assert any("default-queue sentence" in p for p in docs.prose_problems("aurora", stale))


def test_an_unverified_site_line_is_tried_with_a_warning_and_explained():
    """Issue 41: NERSC documents nccl-plugin only as a Shifter module; the script tries the
    ordinary module and warns in one line, and --explain says what to check on the first login."""
    from hpcml.ensemble.jobscript import explain, job_spec, render
    from hpcml.ensemble.rules import Fact

    spec = job_spec(site="perlmutter", command=["python", "t.py"], nodes=2, walltime="01:00:00")
    line = next(ln for ln in render(spec).splitlines() if "nccl-plugin" in ln)
    assert line.startswith("module load nccl-plugin || echo ") and line.endswith(">&2")
    out = subprocess.run(["bash", "-c", line.replace("module load nccl-plugin", "false", 1)], capture_output=True,
                         text=True, timeout=10)
    assert out.stderr.strip() == ("hpcml-job: module load nccl-plugin failed, a line not on the facility pages: "
                                  "module avail nccl; without a plugin module NCCL falls back to TCP sockets between "
                                  "nodes")
    assert "    ^ unverified: check on the first login: module avail nccl" in explain(spec)
    assert Fact(text="module load x", why="y").script == "module load x"
    with pytest.raises(ConfigError, match="must be one line saying how to check it"):
        Fact(text="a\nb", why="y", unverified="check it")


def test_corrected_site_lines_are_pinned_with_their_sources():
    """Issue 41: each corrected line, and the page it comes from."""
    alcf_queues = {"polaris": "https://docs.alcf.anl.gov/polaris/running-jobs/",
                   "aurora": "https://docs.alcf.anl.gov/aurora/running-jobs-aurora/"}
    for name, url in alcf_queues.items():
        assert {q.source.url for q in load_site(name).queues} == {url}
    aurora = load_site("aurora")
    assert [m.text for m in aurora.modules] == ["module load frameworks"]
    assert aurora.modules[0].source.url == "https://docs.alcf.anl.gov/aurora/data-science/frameworks/pytorch/"
    frontier = load_site("frontier")
    pin = frontier.modules[0]
    assert pin.text == "module load PrgEnv-gnu/8.7.0 cpe/26.03 cray-mpich cray-hdf5-parallel cray-python rocm/7.1.1"
    assert (pin.source.url, pin.source.read) == ("https://docs.olcf.ornl.gov/software/analytics/pytorch_frontier.html",
                                                 "2026-11-28")
    assert frontier.job_directives == () and "--network=disable_rdzv_get" in frontier.train_launch
    ext = next(q for q in frontier.queues if q.name == "extended")
    assert ext.source.url == "https://docs.olcf.ornl.gov/systems/frontier_user_guide.html"
    perl = load_site("perlmutter")
    assert "--gpus-per-node=4 --gpu-bind=none" in perl.train_launch and "--gpus-per-task" not in perl.train_launch
    nccl = next(m for m in perl.modules if "nccl" in m.text)
    assert nccl.unverified.startswith("module avail nccl")


@pytest.mark.parametrize("name", SITES)
def test_collective_library_settings_stay_off_mpi_simulations(name):
    """Issue 41: NCCL/RCCL/oneCCL variables and their libfabric plugin's settings are training's;
    an MPI simulation's launch unsets every one of them, the training launch keeps them."""
    site = load_site(name)
    coll = [v.name for v in site.environment if v.training_only]
    assert coll, name
    assert all(v.name.startswith(("NCCL_", "CCL_", "FI_")) for v in site.environment if v.training_only)
    prefix = site.sim_prefix(16)
    assert prefix.startswith("env ") and prefix.endswith("$PARSL_MPI_PREFIX")
    assert all(f"-u {n}" in prefix.split(" $")[0] for n in coll)
    assert "env -u" not in site.train_line(["python", "t.py"], nodes=2)
    out = subprocess.run(["bash", "-c", prefix.replace("$PARSL_MPI_PREFIX", "") + " env"], capture_output=True,
                         text=True, timeout=10, env={"PATH": "/usr/bin:/bin", **{n: "x" for n in coll}})
    assert out.returncode == 0 and not any(line.split("=")[0] in coll for line in out.stdout.splitlines())


def test_explain_of_a_campaign_job_says_what_it_holds_against_the_limits():
    cmd = [sys.executable, "-m", "hpcml.cli", "job", "--site", "polaris", "--nodes", "2", "--walltime", "02:00:00",
           "--account", "P", "--driver", "--explain", "--", "python", "drive.py"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    tail = out.stdout.strip().splitlines()[-2:]
    assert tail == ["campaign jobs: one-allocation -- the trainer and the simulations share one job, within "
                    "capacity's per-user limits",
                    "  driver: 2 node(s) x 02:00:00 in capacity (capacity: 1-4 nodes, 00:05:00-168:00:00, 1 running, "
                    "2 queued or running per user)"]
