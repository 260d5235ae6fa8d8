"""Issue 39, part 4: ``Campaign(bundle=N)`` runs members of ``SimSpec(entry=...)`` N to a task,
in one process each, through real Parsl; every member keeps its id, attempts, retries and
provenance line, and a deterministic error still ends the campaign at once."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("parsl")

from hpcml.ensemble import Campaign, Members, SimSpec, TrainingJob  # noqa: E402
from hpcml.errors import ConfigError  # noqa: E402
from hpcml.stream import new_secret  # noqa: E402

MEMBERS = textwrap.dedent('''
    from hpcml.errors import ConfigError

    def member(sim_id, params, attempt):
        if sim_id == 7 and attempt == 0:
            raise RuntimeError("a hiccup")  # its retry, in the same process, succeeds
        if params.get("bad"):
            raise ConfigError(f"params['bad']={params['bad']!r}: expected none")
        return {"y": 2 * params["x"], "samples_sent": 0}
''')


def _campaign(tmp_path, run: str) -> Campaign:
    (tmp_path / "my_members.py").write_text(MEMBERS)
    return Campaign(run_dir=tmp_path / run, site="local", max_concurrent=2, retries=1, progress=False, sim_launch="",
                    bundle=16, env={"PYTHONPATH": str(tmp_path)})


def test_bundled_members_each_keep_their_attempts_and_provenance(tmp_path):
    sims = [SimSpec(sim_id=i, params={"x": float(i)}, entry="my_members:member", stream=False) for i in range(40)]
    res = _campaign(tmp_path, "run").run(sims)
    assert (res.status, res.completed, res.failed) == ("ok", list(range(40)), [])
    assert res.attempts == {i: 2 if i == 7 else 1 for i in range(40)} and res.retried == [7]
    rows = [json.loads(x) for x in (tmp_path / "run" / "provenance.jsonl").read_text().splitlines()]
    assert sorted((r["sim_id"], r["attempt"], r["status"]) for r in rows) == sorted(
        [(i, 0, "ok") for i in range(40) if i != 7] + [(7, 0, "failed"), (7, 1, "ok")])
    assert {r["result"]["y"] for r in rows if r["status"] == "ok"} == {2.0 * i for i in range(40)}
    sims_dir = tmp_path / "run" / "sims"
    assert not list(sims_dir.glob("sim_*")) and len(list(sims_dir.glob("bundle_*"))) == 3  # 16 + 16 + 8
    # resumed: nothing runs again
    again = _campaign(tmp_path, "run").run(sims, resume=True)
    assert again.status == "ok" and again.skipped == list(range(40))


def test_members_described_not_listed_run_once_each_and_are_the_same_campaign_as_their_list(tmp_path):
    """Issue 39, part 5: 10^5 members are described (Members: a rule of their parameters), not
    listed; mixed with listed SimSpecs they run, retry and report as a list would, campaign.json
    reads as before, and the run directory resumes from the same simulations given as a list."""
    members = Members(entry="my_members:member", count=30, params=lambda i: {"x": float(i)}, stream=False)
    extra = SimSpec(sim_id=100, params={"x": 100.0}, entry="my_members:member", stream=False)
    res = _campaign(tmp_path, "run").run([members, extra])
    assert (res.status, res.completed, res.failed, res.total) == ("ok", [*range(30), 100], [], 31)
    assert res.attempts == {i: 2 if i == 7 else 1 for i in [*range(30), 100]} and res.retried == [7]
    record = json.loads((tmp_path / "run" / "campaign.json").read_text())
    assert record["completed"] == [*range(30), 100] and record["attempts"]["7"] == 2 and record["retried"] == [7]
    assert record["cumulative"]["sims_completed"] == [*range(30), 100]
    rows = [json.loads(x) for x in (tmp_path / "run" / "provenance.jsonl").read_text().splitlines()]
    assert sorted((r["sim_id"], r["attempt"], r["result"]["y"]) for r in rows if r["status"] == "ok") == sorted(
        [(i, int(i == 7), 2.0 * i) for i in range(30)] + [(100, 0, 200.0)])
    listed = [*(SimSpec(sim_id=i, params={"x": float(i)}, entry="my_members:member", stream=False) for i in range(30)),
              extra]
    again = _campaign(tmp_path, "run").run(listed, resume=True)  # the same campaign, given as a list
    assert (again.status, again.skipped, again.attempts[3]) == ("ok", [*range(30), 100], 0)
    other = Members(entry="my_members:member", count=30, params=lambda i: {"x": float(i) + 1}, stream=False)
    with pytest.raises(ConfigError, match=r"holds campaign .*, defined with other simulations \(31 simulations, "
                                          r"digest \w+; given 31 simulations, digest \w+\): other parameters "
                                          r"\(simulation 0's parameters \{'x': 0.0\}, now \{'x': 1.0\}\): resume it"):
        _campaign(tmp_path, "run").run([other, extra], resume=True)


def test_a_bundled_members_deterministic_error_ends_the_campaign_naming_it(tmp_path):
    sims = [SimSpec(sim_id=i, params={"x": float(i), **({"bad": 1} if i == 3 else {})}, entry="my_members:member",
                    stream=False) for i in range(10)]
    with pytest.raises(ConfigError, match=r"^simulation 3 failed on a deterministic error, not retried \(a retry, or "
                                          r"a resume before its cause is fixed, would fail the same way\): "
                                          r"ConfigError: params\['bad'\]=1: expected none$"):
        _campaign(tmp_path, "bad").run(sims)
    rows = [json.loads(x) for x in (tmp_path / "bad" / "provenance.jsonl").read_text().splitlines()]
    assert [(r["attempt"], r["status"]) for r in rows if r["sim_id"] == 3] == [(0, "failed")]  # not retried


def test_an_entry_is_validated_in_one_line():
    with pytest.raises(ConfigError, match=r"^sim 1: entry='nocolon': expected 'package.module:function' and no argv"):
        SimSpec(sim_id=1, params={}, entry="nocolon")
    with pytest.raises(ConfigError, match=r"^bundle must be an int >= 1 \(members a task\), got 0$"):
        Campaign(run_dir="/tmp/x", site="local", bundle=0)


STREAMING = textwrap.dedent('''
    import numpy as np
    from mpi4py import MPI
    from hpcml.stream import Producer

    def member(sim_id, params, attempt):
        """A member that streams three outputs of a 64-point field, as a 1-rank simulation would."""
        out = Producer.from_campaign(comm=MPI.COMM_SELF, params=params, global_shape=(64,), offset=(0,),
                                     local_shape=(64,), fields=("u",), sim_id=sim_id, attempt=attempt)
        x = np.arange(64) / 64
        for k in range(3):
            out.send(10 * k, 0.01 * k, {"u": params["amp"] * np.sin(2 * np.pi * x) * np.exp(-params["nu"] * k)})
        out.close()
        return {"samples_sent": 3}
''')


@pytest.mark.timeout(180)
def test_bundled_members_stream_into_a_trainer_every_sample_once(tmp_path):
    (tmp_path / "streaming_members.py").write_text(STREAMING)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    new_secret(run_dir / "stream.key")
    env = {"PYTHONPATH": str(tmp_path), "HPCML_STREAM_ENDPOINTS_FILE": str(run_dir / "endpoints.json"),
           "HPCML_STREAM_SECRET_FILE": str(run_dir / "stream.key")}
    train = str(Path(__file__).resolve().parent / "own_sim" / "train_burgers.py")
    # described, not listed (Members): columns of parameters, as a sample file gives them
    sims = Members(entry="streaming_members:member", count=8,
                   params={"nu": 0.01 + 0.005 * np.arange(8), "amp": 0.5 + 0.05 * np.arange(8)})
    campaign = Campaign(run_dir=run_dir, site="local", max_concurrent=2, retries=1, progress=False, sim_launch="",
                        bundle=4, env=env)
    res = campaign.run(sims, training=TrainingJob(argv=[sys.executable, train, "--nx", "64", "--t-max", "0.05",
                                                        "--steps", "20"], ranks=1),
                       ready_file=run_dir / "endpoints.json", ready_timeout_s=120, train_timeout_s=120)
    assert (res.status, res.completed, res.training_returncode) == ("ok", list(range(8)), 0)
    s = json.loads((run_dir / "train_summary.json").read_text())
    assert (s["samples_expected"], s["samples_ingested"], s["samples_missing"], s["duplicate_samples"]) == \
        (24, 24, 0, 0), s
    rows = [json.loads(x) for x in (run_dir / "provenance.jsonl").read_text().splitlines()]
    assert sorted((r["sim_id"], r["streamed"]) for r in rows) == [(i, 3) for i in range(8)]
