"""Issue 39, mistakes found at their first occurrence: a deterministic error recorded beside its
attempt stops every retry before it launches anything, and a driver whose site disagrees with
the batch job it runs in says so in one line."""

from __future__ import annotations

import json

from hpcml.outcome import read_final_error, write_final_error
from hpcml.ensemble.attempts import hpcml_sim
from hpcml.ensemble.campaign import site_mismatch
from hpcml.ensemble.site import load_site


def test_a_recorded_deterministic_error_stops_the_retry_before_it_claims_an_attempt(tmp_path):
    sim = tmp_path / "sims" / "sim_00003"
    sim.mkdir(parents=True)
    env = {"HPCML_STREAM_RECORD": str(sim / "attempt_0.stream.json")}
    assert read_final_error(sim) is None
    first = hpcml_sim(str(sim), 3, "mpiexec -n 2", ["sim.py"], 0, 5, parsl_resource_specification={})
    assert first.startswith("exec /bin/bash ") and (sim / "attempt_0.start").exists()
    write_final_error("simulation 3 rank 1: fields ['h'] sent, the trainer takes ['u']", 3, 0, env)
    write_final_error("simulation 3 rank 0: the same, second", 3, 0, env)  # the first rank's is kept
    assert read_final_error(sim) == "simulation 3 rank 1: fields ['h'] sent, the trainer takes ['u']"
    assert json.loads((sim / "attempt_0.final.json").read_text())["attempt"] == 0
    retry = hpcml_sim(str(sim), 3, "mpiexec -n 2", ["sim.py"], 0, 5, parsl_resource_specification={})
    assert retry == "exit 78" and not (sim / "attempt_1.start").exists()  # nothing launched, no attempt claimed
    write_final_error("outside a campaign: nowhere", 3, 0, {})  # no record asked for: nothing written
    assert sorted(p.name for p in sim.iterdir()) == ["attempt_0.final.json", "attempt_0.start"]


def test_a_driver_whose_site_disagrees_with_its_batch_job_says_so():
    local, slurm = load_site("local"), load_site("slurm-local")
    assert site_mismatch(local, {"SLURM_JOB_ID": "12", "HPCML_SITE": "slurm-local"}) == (
        "this driver runs in a batch job written for site 'slurm-local' (HPCML_SITE), but the campaign's site is "
        "'local': everything runs on this node; pass site='slurm-local' to use the job's nodes")
    assert site_mismatch(local, {"SLURM_JOB_ID": "12"}) == (
        "this driver runs inside slurm job 12, but the campaign's site 'local' schedules with local: everything runs "
        "on this node; pass a slurm site of this machine to use the job's nodes")
    assert site_mismatch(slurm, {"SLURM_JOB_ID": "12", "HPCML_SITE": "slurm-local"}) is None
    assert site_mismatch(local, {}) is None
