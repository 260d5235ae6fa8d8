"""Issue 39, part 5: the driver at 10^5 members holds a few bytes a member -- members
described (``Members``), ids as runs (``IdSet``), outcomes in a byte each (``Book``),
records written a chunk at a time (``idset.dump``) -- and reads as before to its callers."""

from __future__ import annotations

import json
import math
import random
import re

import numpy as np
import pytest

from hpcml import safeio
from hpcml.ensemble import Members, SimSpec
from hpcml.ensemble.book import CANCELLED, COMPLETED, FAILED, PENDING, RUNNING, Book
from hpcml.ensemble.members import Specs
from hpcml.ensemble.rundir import definition
from hpcml.ensemble.simpool import Sim
from hpcml.errors import ConfigError
from hpcml.idset import CHUNK, IdSet, dump


def _x(i: int) -> dict:
    return {"x": i / 3, "k": i}


# -- IdSet ------------------------------------------------------------------------------------
def test_idset_is_the_sorted_set_of_what_was_added_whatever_the_order():
    rng = random.Random(7)
    for trial in range(50):
        ids = [rng.randrange(200) for _ in range(rng.randrange(1, 150))]
        s = IdSet(ids)
        want = sorted(set(ids))
        assert list(s) == want and s == want and len(s) == len(want)
        assert all((i in s) == (i in want) for i in range(-2, 205))
        assert [s[k] for k in range(len(want))] == want and s[-1] == want[-1]
        runs = s.runs()
        assert all(hi > lo for lo, hi in runs) and all(b[0] > a[1] for a, b in zip(runs, runs[1:]))  # disjoint, gapped
    assert IdSet(range(100_000)).runs() == [(0, 100_000)]  # 10^5 consecutive ids: one run
    assert IdSet([5, 3, 4]) == [3, 4, 5] and IdSet([1]) != [1, 2] and IdSet() == [] and not IdSet()
    with pytest.raises(IndexError, match="IdSet index 3 out of range for 3 ids"):
        IdSet([1, 2, 3])[3]
    assert repr(IdSet([0, 1, 2, 9])) == "[0, 1, 2, 9]" and repr(IdSet()) == "[]"  # prints as the list it reads as
    assert repr(IdSet([*range(100), 200])) == "IdSet(0-99, 200; 101 ids)"
    assert "x" not in IdSet([1]) and 1.0 not in IdSet([1])


def test_dump_writes_what_json_dumps_would_parse_to():
    rec = {"a": 1, "ids": IdSet(range(3 * CHUNK + 5)), "few": IdSet([2, 9]), "empty": IdSet(),
           "attempts": {i: 1 + (i % 3 == 0) for i in range(2 * CHUNK + 1)}, "names": {"b": [1.5, None, "t"]},
           "nested": {"sims_completed": IdSet(range(10, 20)), "samples": None}, "long": list(range(CHUNK + 3)),
           "text": "q\"uote\n", "f": 0.1}
    plain = json.loads(json.dumps({k: list(v) if isinstance(v, IdSet) else v for k, v in rec.items()}, default=list))
    plain["attempts"] = {str(k): v for k, v in rec["attempts"].items()}
    chunks = list(dump(rec))
    assert json.loads("".join(chunks)) == plain
    assert max(map(len, chunks)) < 12 * CHUNK < sum(map(len, chunks)) / 3  # a chunk at a time, never it all


def test_replace_from_chunks_that_fail_keeps_the_old_file_and_leaves_nothing(tmp_path):
    path = tmp_path / "campaign.json"
    safeio.replace(path, (c for c in ("{", '"a": 1', "}")))
    assert json.loads(path.read_text()) == {"a": 1}

    def broken():
        yield "{"
        raise RuntimeError("no more")

    with pytest.raises(RuntimeError, match="no more"):
        safeio.replace(path, broken())
    assert json.loads(path.read_text()) == {"a": 1} and sorted(p.name for p in tmp_path.iterdir()) == ["campaign.json"]


# -- Members and Specs ------------------------------------------------------------------------
def test_members_read_as_the_simspecs_they_describe():
    m = Members(entry="pkg.mod:run", count=4, params=_x, first_id=10, stream=False)
    assert len(m) == 4 and list(m.ids) == [10, 11, 12, 13]
    assert list(m) == [SimSpec(sim_id=i, params=_x(i), entry="pkg.mod:run", ranks=1, stream=False)
                       for i in range(10, 14)]
    assert m[-1].sim_id == 13 and [s.sim_id for s in m[1:3]] == [11, 12]
    cols = Members(entry="pkg.mod:run", count=3, params={"x": np.array([0.5, 1.5, 2.5]), "n": [1, 2, 3]})
    assert [s.params for s in cols] == [{"x": 0.5, "n": 1}, {"x": 1.5, "n": 2}, {"x": 2.5, "n": 3}]
    assert type(cols[0].params["x"]) is float  # a NumPy scalar becomes a plain number (JSON)


@pytest.mark.parametrize("kw, msg", [
    (dict(count=-1), r"Members count must be an int >= 0, got -1"),
    (dict(count=True), r"Members count must be an int >= 0, got True"),
    (dict(first_id=2**53), r"Members ids 9007199254740992 to 9007199254740993 pass 2\*\*53"),
    (dict(entry="nocolon"), r"Members entry='nocolon': expected 'package.module:function'"),
    (dict(params={"x": [1.0]}), r"Members params column 'x' has 1 values, expected count=2"),
    (dict(params=3), r"Members params must be a function of the member's id or a mapping of columns, got int"),
    (dict(stream="yes"), r"Members stream must be True, False or None, got 'yes'"),
])
def test_members_refuse_a_bad_description_naming_the_value(kw, msg):
    args = dict(entry="pkg.mod:run", count=2, params=_x) | kw
    with pytest.raises(ConfigError, match=msg):
        Members(**args)


def test_a_members_rule_that_gives_bad_parameters_is_refused_before_anything_runs():
    with pytest.raises(ConfigError, match=r"member 1: params column 'x' holds nan: expected a finite number"):
        Members(entry="p.m:f", count=2, params={"x": [0.0, math.nan]})[1]
    with pytest.raises(ConfigError, match=r"Members params\(5\) returned \[1\]: expected a dict of parameter names"):
        Members(entry="p.m:f", count=1, first_id=5, params=lambda i: [1])[0]
    bad = Specs([Members(entry="p.m:f", count=3, params=lambda i: {"x": math.inf if i == 2 else 1.0})])
    with pytest.raises(ConfigError, match=r"^simulation 2: params \{'x': inf\} must be finite JSON values"):
        definition(bad, None)  # the digest pass, in the claim: before the run directory is written


def test_specs_flatten_simspecs_and_members_and_find_them_by_id():
    listed = [SimSpec(sim_id=3, params={}, argv=["a"]), SimSpec(sim_id=1, params={}, argv=["b"], ranks=4)]
    specs = Specs([listed[0], Members(entry="p.m:f", count=3, params=_x, first_id=10), listed[1]])
    assert len(specs) == 5 and list(specs.ids()) == [3, 10, 11, 12, 1]
    assert [specs.position(i) for i in (3, 10, 12, 1, 99)] == [0, 1, 3, 4, None]
    assert specs[2] == SimSpec(sim_id=11, params=_x(11), entry="p.m:f", ranks=1) and specs.sim_id(2) == 11
    assert [specs.is_member(p) for p in range(5)] == [False, True, True, True, False] and specs.max_ranks() == 4
    assert specs.extend([SimSpec(sim_id=20, params={}, argv=["c"])]) == range(5, 6) and specs.position(20) == 5
    assert [d[0] for d in specs.definitions()] == [1, 3, 10, 11, 12, 20]
    for sims, dup in (([Members(entry="p.m:f", count=5, params=_x), Members(entry="p.m:f", count=5, params=_x,
                                                                              first_id=3)], [3]),
                      ([Members(entry="p.m:f", count=5, params=_x), SimSpec(sim_id=4, params={}, argv=["a"])], [4]),
                      ([SimSpec(sim_id=4, params={}, argv=["a"])] * 2, [4])):
        with pytest.raises(ConfigError, match=re.escape(f"sim_id values must be unique, repeated: {dup}")):
            Specs(sims).check_unique()
    with pytest.raises(ConfigError, match="a simulation must be a SimSpec or Members, got dict"):
        Specs([{"sim_id": 1}])


def test_members_and_the_simspecs_they_describe_are_one_campaign():
    """The digest is the one run directories already hold (pinned), whichever way the
    simulations are given: a run of Members resumes from a list of SimSpecs and back."""
    listed = [SimSpec(sim_id=i, params=_x(i), entry="p.m:f") for i in range(1000)]
    members = Members(entry="p.m:f", count=1000, params=_x)
    want = definition(listed, None)
    assert definition(Specs([members]), None) == want
    assert definition(Specs(listed[::-1]), None) == want  # listed in any order
    five = definition([SimSpec(sim_id=i, params={"x": float(i)}, entry="p.m:f") for i in range(5)], None)
    assert (five["simulations"]["count"], five["simulations"]["digest"]) == (5, "f8d9725c3e60b45e")  # the digest
    # before issue 39's Specs: run directories written since resume


@pytest.mark.parametrize("change, named", [
    ({"argv": ["sim.py", "--steps", "20"]}, r": other argv \(simulation 0's argv \['sim.py', '--steps', '10'\], now "
                                            r"\['sim.py', '--steps', '20'\]\): resume it unchanged"),
    ({"params": {"nu": 0.5}}, r": other parameters \(simulation 0's parameters \{'nu': 0.1\}, now \{'nu': 0.5\}\)"),
    ({"sim_id": 7}, r": other simulation ids and parameters: resume it"),  # in id order: the first is another
])
def test_a_resume_with_other_simulations_is_refused_naming_what_changed(tmp_path, change, named):
    from hpcml.ensemble import rundir

    def sims(**first):
        spec = {"sim_id": 0, "params": {"nu": 0.1}, "argv": ["sim.py", "--steps", "10"], **first}
        return [SimSpec(**spec), SimSpec(sim_id=1, params={"nu": 0.2}, argv=["sim.py", "--steps", "10"])]

    rundir.claim(tmp_path, sims(), None, resume=False)
    rundir.release(tmp_path)
    rundir.claim(tmp_path, sims(), None, resume=True)  # unchanged: the same campaign
    rundir.release(tmp_path)
    with pytest.raises(ConfigError, match=r"defined with other simulations \(2 simulations, digest \w+; given 2 "
                                          r"simulations, digest \w+\)" + named):
        rundir.claim(tmp_path, sims(**change), None, resume=True)


# -- the Book ---------------------------------------------------------------------------------
def test_the_book_counts_outcomes_and_attempts_in_a_byte_each():
    book = Book(Specs([Members(entry="p.m:f", count=6, params=_x, first_id=100)]))
    assert book.counts == [6, 0, 0, 0, 0] and list(book.pending()) == list(range(6))
    sims = []
    for pos, outcome, recorded in ((0, "completed", {0: {"status": "ok", "samples_sent": 3, "duration_s": 1.0}}),
                                   (1, "completed", {0: {"status": "failed", "samples_sent": None, "duration_s": 1.0},
                                                     1: {"status": "ok", "samples_sent": 2, "duration_s": 1.0}}),
                                   (2, "failed", {0: {"status": "failed", "samples_sent": 5, "duration_s": 0.5}})):
        book.set(pos, RUNNING)
        s = Sim(spec=book.specs[pos], pos=pos, dir=None, submitted=10.0, finished=13.0, recorded=recorded,
                outcome=outcome)
        book.fold(s)
        sims.append(s)
    book.skip(3)
    book.cancel_pending()
    assert book.counts[PENDING] == 0 and book.counts[COMPLETED] == 3 and book.counts[FAILED] == 1
    assert book.counts[CANCELLED] == 2 and book.counts[RUNNING] == 0
    assert book.ids(COMPLETED) == [100, 101, 103] and book.ids(FAILED) == [102] and book.ids(CANCELLED) == [104, 105]
    assert book.skipped == [103] and book.retried == 1 and book.retried_ids() == [101] and book.samples_sent == 5
    assert dict(book.attempts()) == {100: 1, 101: 2, 102: 1, 103: 0, 104: 0, 105: 0} == book.attempts()
    assert book.attempts()[101] == 2 and book.overheads.median() == 2.0  # 3 s in Parsl, 1 s running
    assert book.extend([SimSpec(sim_id=7, params={}, argv=["a"])]) == range(6, 7) and book.counts[PENDING] == 1
    assert not book.all_done()


def test_a_campaign_result_of_id_sets_is_what_json_and_asdict_take():
    """Users write their results out: ``asdict`` of a CampaignResult holding IdSets and the
    attempts view gives plain lists and a dict, which ``json.dumps`` takes."""
    from dataclasses import asdict

    from hpcml.ensemble import CampaignResult

    book = Book(Specs([Members(entry="p.m:f", count=3, params=_x)]))
    book.skip(1)
    r = CampaignResult(run_dir="r", total=3, completed=book.ids(COMPLETED), failed=IdSet(), cancelled=IdSet([0, 2]),
                       attempts=book.attempts(), retried=IdSet(), samples_sent=0, wall_s=1.0, parsl_load_s=0.0,
                       task_overhead_s=None, training_returncode=None, skipped=book.skipped)
    d = asdict(r)
    assert (d["completed"], d["cancelled"], d["skipped"], d["attempts"]) == ([1], [0, 2], [1], {0: 0, 1: 0, 2: 0})
    assert type(d["completed"]) is list and json.loads(json.dumps(d))["attempts"] == {"0": 0, "1": 0, "2": 0}
    assert repr(r.attempts) == "{0: 0, 1: 0, 2: 0}"


def test_a_tampered_definition_in_the_run_directory_is_refused_in_one_line(tmp_path):
    """The record is run-directory input others may write: another shape is a ConfigError, not a TypeError."""
    from hpcml.ensemble import rundir

    sims = [SimSpec(sim_id=0, params={"a": 1.0}, argv=["x"])]
    rundir.claim(tmp_path, sims, None, resume=False)
    rundir.release(tmp_path)
    rec = json.loads((tmp_path / "campaign_id.json").read_text())
    (tmp_path / "campaign_id.json").write_text(json.dumps({**rec, "simulations": [1, 2]}))
    with pytest.raises(ConfigError, match=r"campaign_id.json is unreadable \(.*simulations=\[1, 2\], expected an "
                                          r"object\); expected the campaign's id and definition: use a new directory$"):
        rundir.claim(tmp_path, sims, None, resume=True)
