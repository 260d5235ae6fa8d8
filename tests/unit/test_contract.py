"""The campaign <-> trainer contract and the run directory's claim, without Parsl or MPI:
one record in the environment, files that name their run, one driver per directory,
orphaned attempts recorded, the lifeline's two reasons to exit."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcml import lifeline, safeio
from hpcml.contract import (MAX_RECORD_BYTES, Contract, DoneRecord, read_done, read_endpoints, write_done,
                            write_endpoints)
from hpcml.outcome import write_stream_record
from hpcml.errors import ConfigError, LaunchError


def _contract(tmp_path: Path, **kw) -> Contract:
    base = dict(run_dir=str(tmp_path), campaign="c-1", run="r-1", secret_file=str(tmp_path / "stream.key"),
                endpoints_file=str(tmp_path / "endpoints.json"), done_file=str(tmp_path / "sims_done.json"))
    return Contract(**{**base, **kw})


def test_the_contract_travels_in_the_environment_and_back(tmp_path):
    c = _contract(tmp_path, resume=True, steps=500, batch=8, n_sims=16, deadline=1.8e9, driver_pid=42,
                  driver_host="login1", launch="abc", stream_interface="hsn0")
    env = c.to_env()
    assert env["HPCML_RESUME"] == "1" and env["HPCML_TRAIN_STEPS"] == "500" \
        and env["HPCML_JOB_DEADLINE"] == "1800000000"
    assert Contract.from_env(env) == c and eval(repr(c), {"Contract": Contract}) == c  # repr rebuilds it
    assert c.ckpt_dir == tmp_path / "checkpoints" and c.summary_file == tmp_path / "train_summary.json"


@pytest.mark.parametrize("env, says", [
    ({}, "HPCML_RUN_DIR and HPCML_CAMPAIGN_ID not set: this process was not started by a campaign"),
    ({"HPCML_RUN_DIR": "/r", "HPCML_CAMPAIGN_ID": "c", "HPCML_RESUME": "yes"}, "HPCML_RESUME='yes': expected 0 or 1"),
    ({"HPCML_RUN_DIR": "/r", "HPCML_CAMPAIGN_ID": "c", "HPCML_TRAIN_STEPS": "ten"},
     "HPCML_TRAIN_STEPS='ten': expected a"),
    ({"HPCML_RUN_DIR": "/r", "HPCML_CAMPAIGN_ID": "c", "HPCML_TRAIN_BATCH": "0"},
     "Contract.batch=0: expected an integer"),
])
def test_a_bad_or_missing_contract_is_one_line(env, says):
    with pytest.raises(ConfigError) as e:
        Contract.from_env(env)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_protocol_files_of_another_run_are_never_read(tmp_path):
    c = _contract(tmp_path)
    write_endpoints(c.endpoints_file, "c-1", ["tcp://127.0.0.1:5"], run="r-0")  # the previous run's
    write_done(c.done_file, DoneRecord(completed=[1], failed=[], streamed={1: 4}, campaign="c-1", run="r-0"))
    assert read_done(c.done_file, c) is None
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"is an earlier run's \(it belongs to campaign 'c-1' run 'r-0', not 'c-1' "
                                          r"run 'r-1'\) and this run's trainer did not publish its own within 0.2 s"):
        read_endpoints(c.endpoints_file, 0.2, contract=c)
    assert time.monotonic() - t0 < 2
    write_endpoints(c.endpoints_file, "c-1", ["tcp://127.0.0.1:6"], run="r-1")
    assert read_endpoints(c.endpoints_file, contract=c) == ("c-1", ["tcp://127.0.0.1:6"])
    write_done(c.done_file, DoneRecord(completed=[1, 2], failed=[3], streamed={1: 4}, campaign="c-1", run="r-1"))
    assert read_done(c.done_file, c) == DoneRecord(completed=[1, 2], failed=[3], streamed={1: 4}, campaign="c-1",
                                                   run="r-1")


def test_a_trainer_that_failed_before_it_listened_releases_the_waiting_simulations_at_once(tmp_path):
    c = _contract(tmp_path)
    write_endpoints(c.endpoints_file, "c-1", [], run="r-1", closed="batch=4 here, but the campaign's batch=2")
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"the training job of this run failed before it took a stream: batch=4 here"):
        read_endpoints(c.endpoints_file, 60, contract=c)
    assert time.monotonic() - t0 < 1


@pytest.mark.parametrize("text, says", [
    ('{"completed": [1], "failed": [], "streamed": {"1": -2}}', "malformed done record (ValueError: sample count -2)"),
    ('{"completed": [true], "failed": []}', "malformed done record (ValueError: simulation id True)"),
    ('{"completed": "all", "failed": []}', "malformed done record"),
    ("[1, 2]", "expected a JSON object, got list"),
    ("{", "not JSON"),
])
def test_a_malformed_done_record_is_refused_naming_the_file(tmp_path, text, says):
    path = tmp_path / "sims_done.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        read_done(path)
    assert str(path) in str(e.value) and says in str(e.value)


def test_a_huge_record_is_refused_before_parsing(tmp_path):
    path = tmp_path / "endpoints.json"
    path.write_bytes(b"[" * (2 << 20))
    with pytest.raises(ConfigError, match="larger than 1024 bytes, expected a small JSON record"):
        safeio.read_json(path, 1024)


def test_the_stream_record_goes_where_the_attempt_wrapper_says(tmp_path):
    write_stream_record(3, 96, sim=1, attempt=0, environ={})  # outside a campaign: nothing
    assert list(tmp_path.iterdir()) == []
    write_stream_record(3, 96, sim=1, attempt=0, environ={"HPCML_STREAM_RECORD": str(tmp_path / "a.stream.json")})
    assert safeio.read_json(tmp_path / "a.stream.json", MAX_RECORD_BYTES)["n_sent"] == 3


def test_one_driver_per_run_directory_and_the_claim_refuses_or_resumes(tmp_path):
    from hpcml.ensemble import rundir

    run = tmp_path / "run"
    first = rundir.claim(run, resume=False, entry="apps")
    assert not first.held and first.campaign.startswith("run-")
    (run / "endpoints.json").write_text("{}")
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
            f"from hpcml.ensemble import rundir\n"
            f"try:\n    rundir.claim(__import__('pathlib').Path({str(run)!r}), resume=True)\n"
            f"except Exception as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.strip() == (f"run directory {run} is in use by a running driver (pid {os.getpid()} on "
                           f"{socket.gethostname()}): wait for it to end, or use a new directory")
    rundir.release(run)
    out = subprocess.run([sys.executable, "-c", code.replace("resume=True", "resume=False")], capture_output=True,
                         text=True, timeout=60).stdout
    assert out.strip() == f"run directory {run} holds campaign {first.campaign} (started " + \
        json.loads((run / "campaign_id.json").read_text())["created"] \
        + "): resume it (resume=True) or use a new directory"
    again = rundir.claim(run, resume=True)
    rundir.release(run)
    assert (again.campaign, again.held) == (first.campaign, True) and again.run != first.run
    assert not (run / "endpoints.json").exists()  # the earlier run's: removed
    assert [r["run"] for r in json.loads((run / "campaign_id.json").read_text())["runs"]] == [first.run, again.run]


def test_a_simulation_id_is_one_simulation(tmp_path):
    from hpcml.ensemble import rundir
    from hpcml.ensemble.spec import SimSpec

    rundir.record_spec(tmp_path, SimSpec(sim_id=3, params={"a": 1.0}, argv=["sim"]))
    rundir.record_spec(tmp_path, SimSpec(sim_id=3, params={"a": 1.0}, argv=["sim"], ranks=4))  # ranks may change
    with pytest.raises(ConfigError, match=r"simulation 3 of run directory .* was defined with params \{'a': 1.0\} and "
                                          r"argv \['sim'\], now \{'a': 2.0\} and \['sim'\]: one id is one simulation"):
        rundir.record_spec(tmp_path, SimSpec(sim_id=3, params={"a": 2.0}, argv=["sim"]))


def test_attempts_killed_with_their_driver_get_a_provenance_line_on_resume(tmp_path):
    from hpcml.ensemble import attempts, provenance

    d = attempts.sim_dir(tmp_path, 4)
    d.mkdir(parents=True)
    (d / "spec.json").write_text(json.dumps({"sim_id": 4, "params": {"a": 1.0}, "argv": ["sim"]}))
    for k, end in ((0, {"returncode": 143, "end": 5.0, "reason": "driver_gone"}), (1, None)):
        (d / f"attempt_{k}.start").write_text(json.dumps({"start": 1.0, "host": "n1"}))
        if end:
            (d / f"attempt_{k}.end").write_text(json.dumps(end))
    assert attempts.record_orphans(tmp_path) == 2 and attempts.record_orphans(tmp_path) == 0
    recs = provenance.read_provenance(tmp_path)
    assert [(r["attempt"], r["status"], r["returncode"], r["params"]) for r in recs] == [
        (0, "driver_gone", 143, {"a": 1.0}), (1, "lost", None, {"a": 1.0})]


def test_the_progress_counts_attempts_that_run_not_tasks_handed_to_parsl(tmp_path):
    from hpcml.ensemble.book import CANCELLED, RUNNING, Book
    from hpcml.ensemble.members import Specs
    from hpcml.ensemble.simpool import Sim, SimPool
    from hpcml.ensemble.spec import SimSpec

    book = Book(Specs([SimSpec(sim_id=i, params={}, argv=["x"]) for i in range(5)]))
    sims = [Sim(spec=book.specs[i], pos=i, dir=tmp_path / f"s{i}") for i in range(5)]
    pool = SimPool(None, tmp_path, book, sims.__getitem__, check=lambda: None, stopping=lambda: False,
                   show=lambda: None)
    for i, s in enumerate(sims[:4]):  # four in Parsl's hands; one attempt started, one ended
        s.dir.mkdir()
        s.outcome, s.claimed = "running", int(i < 2)
        book.set(i, RUNNING)
        pool.inflight[object()] = s
    (sims[0].dir / "attempt_0.start").write_text("{}")
    (sims[1].dir / "attempt_0.start").write_text("{}")
    (sims[1].dir / "attempt_0.end").write_text("{}")
    book.set(4, CANCELLED)
    assert pool.counts() == {"completed": 0, "failed": 0, "cancelled": 1, "running": 1, "retried": 0}


def test_the_lifeline_says_why_a_trainer_must_go(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    assert lifeline.check(_contract(tmp_path, driver_pid=os.getpid(), driver_host=host)) is None
    assert lifeline.check(_contract(tmp_path, driver_pid=dead.pid, driver_host=host)) == (
        f"the campaign's driver (pid {dead.pid} on {host}) is gone")
    assert lifeline.check(_contract(tmp_path, driver_pid=dead.pid, driver_host="elsewhere")) is None  # cannot tell
    (tmp_path / "trainer.lease").write_text("new\n")
    assert lifeline.check(_contract(tmp_path, launch="new")) is None
    assert "a newer launch of the training job holds" in lifeline.check(_contract(tmp_path, launch="old"))
