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


def test_a_producer_in_a_campaign_without_a_stream_is_refused_once_as_final(tmp_path, monkeypatch):
    """A training job built without stream=True gives its simulations no stream: the first
    attempt's Producer refuses, naming the fix, and records it so no retry launches."""
    import pytest
    from hpcml.contract import Contract
    from hpcml.errors import ConfigError
    from hpcml.stream.producer import Producer

    sim = tmp_path / "sims" / "sim_00004"
    sim.mkdir(parents=True)
    monkeypatch.setenv("HPCML_STREAM_RECORD", str(sim / "attempt_0.stream.json"))
    monkeypatch.setenv("HPCML_SIM_ID", "4")
    monkeypatch.setenv("HPCML_ATTEMPT", "0")
    with pytest.raises(ConfigError, match=r"^simulation 4: campaign 'c1' gives it no stream \(no HPCML_STREAM_SECRET_"
                                          r"FILE or HPCML_STREAM_ENDPOINTS_FILE\): its training job takes none -- "
                                          r"give it TrainingJob\(stream=True\), or write files instead"):
        Producer.from_campaign(comm=None, params={"a": 1.0}, global_shape=(8,), offset=(0,), local_shape=(8,),
                               contract=Contract(run_dir=str(tmp_path), campaign="c1"))
    assert read_final_error(sim).startswith("simulation 4: campaign 'c1' gives it no stream")
    retry = hpcml_sim(str(sim), 4, "mpiexec -n 2", ["sim.py"], 1, 5, parsl_resource_specification={})
    assert retry == "exit 78" and not (sim / "attempt_1.start").exists()


def test_train_surrogate_refuses_bounds_for_another_number_of_parameters_before_any_collective(tmp_path, capsys):
    """Three (lo, hi) bounds for two parameters: one line naming both, exit 78 -- not numpy's
    broadcast error from the first batch, after the simulations started."""
    from hpcml.contract import Contract
    from hpcml.train.fields import FieldScales
    from hpcml.train.surrogate_job import train_surrogate

    scales = FieldScales(param_lo=(0.0, 0.0, 0.0), param_hi=(1.0, 1.0, 1.0), t_max=1.0)
    c = Contract(run_dir=str(tmp_path), campaign="c2")
    assert train_surrogate(None, params=("nu", "amp"), fields=("u",), scales=scales, steps=2, batch=1,
                           contract=c, files=[]) == 78
    assert capsys.readouterr().err.splitlines()[-1] == (
        "train_surrogate: error: train_surrogate(scales=FieldScales(param_lo=(0.0, 0.0, 0.0), ...)): 3 bounds for the "
        "2 parameter(s) ['nu', 'amp']: expected one (lo, hi) pair per parameter, in params' order")
