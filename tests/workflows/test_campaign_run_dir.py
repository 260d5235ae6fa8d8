"""A run directory holds one campaign: refused to another, continued by its own (training
alone too), and the heat workflow keeps the same rules and exits non-zero with the reason.
Real Parsl, real `mpiexec -n 2` simulations (test_campaign.py's tiny mpi4py script).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpcml.ensemble.campaign import Campaign, SimSpec, TrainingJob
from hpcml.errors import ConfigError, LaunchError
from tests.workflows.test_campaign import TRAINER, _config, _provenance, _sim

# --- the run directory holds one campaign -------------------------------------------------------

def _recorder(tmp_path: Path, fail_first: bool = False) -> TrainingJob:
    """A training job that appends what the Campaign told it to trained.jsonl (and, with
    ``fail_first``, fails its first launch)."""
    code = textwrap.dedent(f"""
        import json, os, sys
        rec = {{k: os.environ.get(k) for k in ("HPCML_CAMPAIGN_ID", "HPCML_RESUME")}}
        open(os.path.join(os.environ["HPCML_RUN_DIR"], "trained.jsonl"), "a").write(json.dumps(rec) + "\\n")
        marker = os.path.join({str(tmp_path)!r}, "failed_once")
        if {fail_first!r} and not os.path.exists(marker):
            open(marker, "w").close()
            sys.exit(3)
    """)
    return TrainingJob(argv=[sys.executable, "-c", code], ranks=1, max_restarts=1 if fail_first else 0)


def _trained(run_dir: Path) -> list[tuple[str, str]]:
    return [(r["HPCML_CAMPAIGN_ID"], r["HPCML_RESUME"]) for r in
            map(json.loads, (run_dir / "trained.jsonl").read_text().splitlines())]


def test_a_run_directory_holds_one_campaign_and_refuses_another(tmp_path):
    """A reused run directory is never handed to another campaign: running again needs
    resume=True, and resume=True with other simulations is refused; nothing is touched."""
    run_dir = tmp_path / "run"
    c = Campaign(run_dir=run_dir, config=lambda: _config(tmp_path, retries=0), progress=False)
    sims = [_sim(tmp_path, 0), _sim(tmp_path, 1)]
    first = c.run(sims)
    cid = json.loads((run_dir / "campaign_id.json").read_text())["campaign_id"]
    assert first.campaign_id == cid and cid.startswith("run-") and first.ok
    assert [r["result"]["campaign"] for r in _provenance(run_dir)] == [cid, cid]  # the simulations have it too
    kept = {n: (run_dir / n).read_bytes() for n in ("provenance.jsonl", "campaign.json", "sims_done.json")}
    with pytest.raises(ConfigError) as e:
        c.run(sims)
    assert str(e.value).startswith(f"run directory {run_dir} holds campaign {cid} (started ")
    assert str(e.value).endswith("): resume it (resume=True) or use a new directory")
    other = [sims[0], SimSpec(sim_id=1, params={"alpha": 9.0}, argv=sims[1].argv)]
    with pytest.raises(ConfigError, match=rf"^run directory {run_dir} holds campaign {cid}, defined with other "
                                          r"simulations \(2 simulations, digest \w{16}; given 2 simulations, digest "
                                          r"\w{16}\): other parameters: resume it unchanged or use a new directory$"):
        c.run(other, resume=True)  # simulation 1's: the first simulation's are the same, so none are quoted
    assert {n: (run_dir / n).read_bytes() for n in kept} == kept  # nothing of the campaign was touched
    again = c.run(sims, resume=True)
    assert (again.campaign_id, again.skipped, again.completed, again.ok) == (cid, [0, 1], [0, 1], True)


def test_training_alone_continues_the_campaign_with_its_id(tmp_path):
    """Offline: simulations first, then Campaign.train in the same directory -- the same
    campaign, its id in HPCML_CAMPAIGN_ID; HPCML_RESUME says when to continue a checkpoint
    (resume=True, or a relaunch after a failure). The simulations' record stays."""
    run_dir = tmp_path / "run"
    c = Campaign(run_dir=run_dir, config=lambda: _config(tmp_path, retries=0), progress=False)
    sims = c.run([_sim(tmp_path, 0)])
    record = (run_dir / "campaign.json").read_bytes(), (run_dir / "sims_done.json").read_bytes()
    cid = sims.campaign_id
    trained = c.train(_recorder(tmp_path))
    assert (trained.status, trained.total, trained.campaign_id, _trained(run_dir)) == ("ok", 0, cid, [(cid, "0")])
    assert ((run_dir / "campaign.json").read_bytes(), (run_dir / "sims_done.json").read_bytes()) == record
    assert json.loads((run_dir / "training.json").read_text())["training"]["returncode"] == 0
    with pytest.raises(ConfigError, match=rf"holds campaign {cid} \(started .*\): resume it"):
        c.train(_recorder(tmp_path))
    c.train(_recorder(tmp_path), resume=True)
    assert _trained(run_dir)[1:] == [(cid, "1")]
    relaunched = Campaign(run_dir=tmp_path / "fresh", site="local", progress=False).train(_recorder(tmp_path, True))
    assert (relaunched.status, [r for _, r in _trained(tmp_path / "fresh")]) == ("ok", ["0", "1"])


def test_a_campaign_refused_for_a_loaded_parsl_leaves_no_trace(tmp_path):
    """The user's own Parsl config is loaded: a Campaign (which loads its own) is refused in
    one line before it writes anything -- before, it had already claimed the directory."""
    import parsl

    run_dir = tmp_path / "run"
    parsl.load(_config(tmp_path, retries=0))
    try:
        with pytest.raises(ConfigError, match=r"a Parsl config is already loaded in this process: a Campaign loads its "
                                              r"own; call parsl.dfk\(\).cleanup\(\) and parsl.clear\(\) first, or "
                                              r"drive your own config with hpcml.ensemble.apps"):
            Campaign(run_dir=run_dir, site="local", progress=False).run([_sim(tmp_path, 0)])
    finally:
        parsl.dfk().cleanup()
        parsl.clear()
    assert not run_dir.exists()
    res = Campaign(run_dir=run_dir, config=lambda: _config(tmp_path, retries=0), progress=False) \
        .run([_sim(tmp_path, 0)])
    assert res.status == "ok"  # the same directory, untouched, takes the campaign afterwards


def test_an_older_run_directory_without_identity_is_refused_unless_resumed(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 600}\n')
    c = Campaign(run_dir=run_dir, site="local", progress=False)
    with pytest.raises(ConfigError) as e:
        c.train(_recorder(tmp_path))
    assert str(e.value) == (f"run directory {run_dir} holds an earlier campaign (metrics.jsonl, checkpoints) with no "
                            f"campaign_id.json: resume it (resume=True) or use a new directory")
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "metrics.jsonl"]
    res = c.train(_recorder(tmp_path), resume=True)
    assert _trained(run_dir) == [(res.campaign_id, "1")]  # adopted: it continues the older run
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 600}\n'


def test_streaming_campaign_refuses_a_trainer_rank_without_simulations(tmp_path):
    """Each simulation streams to one trainer rank: a rank with none would wait for nothing.
    Refused before anything starts, with both numbers; offline training is not affected."""
    from hpcml.stream.routing import route

    run_dir = tmp_path / "run"
    c = Campaign(run_dir=run_dir, config=object(), progress=False)
    job = TrainingJob(argv=["true"], ranks=4)
    with pytest.raises(ConfigError) as e:
        c.run([_sim(tmp_path, i) for i in range(3)], training=job, ready_file=run_dir / "ready")
    assert str(e.value) == ("3 simulations for 4 trainer ranks: each trainer rank needs at least one simulation; "
                            "use <= 3 trainer ranks or more simulations")
    local = Campaign(run_dir=run_dir, site="local", progress=False)  # ranks None: the site's 2 per node
    with pytest.raises(ConfigError, match=r"^1 simulation for 2 trainer ranks: .* use <= 1 trainer ranks or more"):
        local.run([_sim(tmp_path, 0)], training=TrainingJob(argv=["true"], stream=True))
    ids = [i for i in range(50) if route(i, 2) == 0][:3]  # enough simulations, all routed to rank 0
    with pytest.raises(ConfigError, match=r"^3 simulations for 2 trainer ranks leave rank\(s\) \[1\] without data"):
        c.run([_sim(tmp_path, i) for i in ids], training=TrainingJob(argv=["true"], ranks=2),
              ready_file=run_dir / "ready")
    assert not run_dir.exists()
    with pytest.raises(ConfigError, match=r"^training stream must be True, False or None, got 1$"):
        TrainingJob(argv=["true"], stream=1)


def test_trainer_failing_after_the_simulations_fails_the_campaign(tmp_path):
    """A trainer that exits non-zero at the end (after every simulation completed) is a failed
    campaign: LaunchError with its exit code and last words, and campaign.json says so."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (tmp_path / "trainer.py").write_text(TRAINER)
    c = Campaign(run_dir=run_dir, config=lambda: _config(tmp_path, retries=0), progress=False)
    job = TrainingJob(argv=[sys.executable, str(tmp_path / "trainer.py"), str(run_dir), "fail-at-end"],
                      ranks=1, stream=False)
    with pytest.raises(LaunchError, match=r"training job exited with code 3 after .* could not save the last"):
        c.run([_sim(tmp_path, 0), _sim(tmp_path, 1)], training=job, ready_file=run_dir / "ready")
    summary = json.loads((run_dir / "campaign.json").read_text())
    assert (summary["status"], summary["ok"], summary["completed"], summary["training_returncode"]) == (
        "failed", False, [0, 1], 3)


# --- the heat workflow follows the Campaign's rules ---------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
HEAT_SMALL = ["--sims", "6", "--val-sims", "1", "--nx", "16", "--ny", "16", "--sim-steps", "400", "--every", "40",
              "--max-concurrent", "3", "--quiet"]


def _heat(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "workflows" / "heat_surrogate.py"), "--run-dir", str(run_dir),
                           *HEAT_SMALL, *extra], cwd=ROOT, capture_output=True, text=True, timeout=400)


def test_heat_workflow_refuses_a_run_directory_of_another_campaign(tmp_path):
    """The reported failure: a reused --run-dir whose old checkpoint the new trainer resumed.
    Now it is refused in one line, with or without --resume, and nothing in it is deleted."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step_00000600\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 600}\n')
    (run_dir / "campaign_id.json").write_text(json.dumps({
        "campaign_id": "heat-old", "created": "2026-01-01T00:00:00+00:00",
        "simulations": {"count": 3, "digest": "0" * 16}, "training": {"argv": ["old"]}}))
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    fresh = _heat(run_dir)
    assert fresh.returncode == 2, fresh.stderr[-2000:]
    assert fresh.stderr.strip().splitlines()[-1] == (
        f"heat_surrogate: error: run directory {run_dir} holds campaign heat-old (started 2026-01-01T00:00:00+00:00): "
        f"resume it (resume=True) or use a new directory")
    resumed = _heat(run_dir, "--resume")
    assert resumed.returncode == 2, resumed.stderr[-2000:]
    assert re.fullmatch(rf"heat_surrogate: error: run directory {run_dir} holds campaign heat-old, defined with other "
                        r"simulations \(3 simulations, digest 0{16}; given 7 simulations, digest \w{16}\): resume it "
                        r"unchanged or use a new directory", resumed.stderr.strip().splitlines()[-1])
    assert {p: p.read_bytes() for p in before} == before
    assert not (run_dir / "summary.json").exists() and not (run_dir / "provenance.jsonl").exists()


def test_heat_workflow_exits_non_zero_with_the_reason_when_the_trainer_fails(tmp_path):
    run_dir = tmp_path / "run"
    proc = _heat(run_dir, "--host", "203.0.113.1")  # TEST-NET: no address of this machine, the bind fails
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("heat_surrogate: failed: training job exited with code "), last
    assert "Cannot assign requested address" in last
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["problems"]) == ("failed", [last.split("failed: ", 1)[1]])
    campaign = json.loads((run_dir / "campaign.json").read_text())
    assert campaign["status"] == "failed" and campaign["training_returncode"] not in (None, 0)
