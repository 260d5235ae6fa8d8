"""Issue 39, part 4's first piece: a bundle runs many members in one process, each with its
own id, attempts, retries, record and stream accounting (:mod:`hpcml.ensemble.bundle`).

The members are a user's function the project does not ship (written into the test's
directory), streaming through a real StreamServer over loopback."""

from __future__ import annotations

import json
import textwrap
import time

import pytest

from hpcml.ensemble import bundle
from hpcml.errors import ConfigError
from hpcml.stream import Buffer, BufferConfig
from hpcml.stream.server import ServerConfig, StreamServer

SECRET = b"b" * 32

MEMBER = textwrap.dedent('''
    import os
    import numpy as np
    from hpcml.errors import ConfigError
    from hpcml.stream import Producer

    def member(sim_id, params, attempt):
        if sim_id == 2 and attempt % 2 == 0:
            raise RuntimeError("a node hiccup")              # retried
        if sim_id == 4:
            raise ConfigError("params['x'] out of range")    # deterministic: final, not retried
        if sim_id == 5:
            return [1, 2]                                    # not a dict: final
        p = Producer(endpoint=os.environ["ENDPOINT"], secret=b"b" * 32, campaign="bundle", sim_id=sim_id,
                     attempt=attempt, rank=0, nranks=1, params=params, global_shape=(4,), offset=(0,),
                     local_shape=(4,))
        for step in range(2):
            p.send(step, float(step), {"u": np.full(4, sim_id + step, np.float32)})
        p.close()
        return {"twice": 2 * params["x"]}
''')


def test_a_bundle_runs_its_members_in_process_each_with_its_own_attempts_and_records(tmp_path, monkeypatch):
    (tmp_path / "my_members.py").write_text(MEMBER)
    monkeypatch.syspath_prepend(str(tmp_path))
    srv = StreamServer(campaign="bundle", secret=SECRET, rank=0, n_trainers=1,
                       buffer=Buffer(BufferConfig(policy="fifo", capacity=64, watermark=1)),
                       config=ServerConfig(param_names=("x",), field_names=("u",), shape=(4,))).start()
    monkeypatch.setenv("ENDPOINT", srv.endpoint)
    d = tmp_path / "bundle_0"
    bundle.write_spec(d, "my_members:member", [{"sim_id": i, "params": {"x": float(i)}} for i in range(6)], retries=1)
    try:
        t0 = time.perf_counter()
        counts = bundle.run_bundle(d, bundle_attempt=0)
        took = time.perf_counter() - t0
        deadline = time.monotonic() + 10
        while srv.counters["samples"] < 8 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert counts == {"ok": 4, "failed": 0, "final": 2, "skipped": 0}
        recs = bundle.read_records(d)
        assert [(r["sim_id"], r["attempt"], r["status"]) for r in recs] == [
            (0, 0, "ok"), (1, 0, "ok"), (2, 0, "failed"), (2, 1, "ok"), (3, 0, "ok"), (4, 0, "final"), (5, 0, "final")]
        by = {(r["sim_id"], r["attempt"]): r for r in recs}
        assert by[0, 0]["result"] == {"twice": 0.0} and by[3, 0]["result"] == {"twice": 6.0}
        assert [by[k]["streamed"] for k in ((0, 0), (1, 0), (2, 1), (3, 0))] == [2, 2, 2, 2]
        assert "RuntimeError: a node hiccup" in by[2, 0]["error"]
        assert by[4, 0]["error"] == "ConfigError: params['x'] out of range"
        assert by[5, 0]["error"] == "ConfigError: the bundle entry returned list: expected a dict or None"
        assert sorted(srv.seen) == [(s, k) for s in (0, 1, 2, 3) for k in (0, 1)] and srv.dropped == {}
        assert sorted(p.name for p in d.iterdir()) == ["bundle.json", "members.jsonl"]  # no file per member
        # the bundle's task run again (a node died): what ended is not run again; attempts go on from 2
        again = bundle.run_bundle(d, bundle_attempt=1)
        assert again == {"ok": 0, "failed": 0, "final": 0, "skipped": 6} and len(bundle.read_records(d)) == 7
        print(f"\nbundle: 6 members, 7 attempts, 8 samples streamed in {took:.2f} s in one process")
    finally:
        srv.stop()


def test_a_bundle_that_cannot_start_says_why_in_one_line(tmp_path, capsys):
    d = tmp_path / "b"
    bundle.write_spec(d, "no_such_module_xyz:run", [{"sim_id": 0, "params": {}}], retries=0)
    with pytest.raises(ConfigError, match=r"^bundle entry 'no_such_module_xyz:run': ModuleNotFoundError: "):
        bundle.run_bundle(d)
    assert bundle.main([str(d)]) == 78 and capsys.readouterr().err.startswith("hpcml bundle: bundle entry ")
    (d / "bundle.json").write_text(json.dumps({"entry": "x:y", "members": [{"params": {}}]}))
    with pytest.raises(ConfigError, match=r"bundle\.json: KeyError: 'sim_id'; expected entry, retries and members"):
        bundle.run_bundle(d)
    with pytest.raises(ConfigError, match=r"^bundle entry 'os.path': expected 'package.module:function'$"):
        bundle.load_entry("os.path")


ALIKE = textwrap.dedent('''
    def member(sim_id, params, attempt):
        if sim_id == 0:
            raise ValueError(f"kappa={params['x']} is outside the solver's range")  # the same every time
        if sim_id == 1:
            raise RuntimeError(f"diverged at attempt {attempt}")                    # a different one each time
        if sim_id == 2:
            raise ConnectionRefusedError("[Errno 111] the file server refused")     # a retry may cure it
        return {}
''')


def test_a_member_raising_the_same_exception_twice_is_not_tried_a_third_time(tmp_path, monkeypatch, capsys):
    """As a launched simulation (tests/unit/test_repeated_failure.py): the member's own exception
    twice ends its retries, in this bundle run and in the next; a different one each time, or
    one a retry may cure, uses every retry."""
    (tmp_path / "alike_members.py").write_text(ALIKE)
    monkeypatch.syspath_prepend(str(tmp_path))
    d = tmp_path / "bundle_0"
    bundle.write_spec(d, "alike_members:member", [{"sim_id": i, "params": {"x": 0.5}} for i in range(4)], retries=3)
    assert bundle.run_bundle(d, bundle_attempt=0) == {"ok": 1, "failed": 3, "final": 0, "skipped": 0}
    tries = [r["sim_id"] for r in bundle.read_records(d)]
    assert [tries.count(i) for i in range(4)] == [2, 4, 4, 1]
    err = capsys.readouterr().err
    assert ("hpcml bundle: member 0: not retried: its last two attempts both raised ValueError: kappa=0.5 is outside "
            "the solver's range") in err and err.count("not retried") == 1
    assert bundle.run_bundle(d, bundle_attempt=1) == {"ok": 0, "failed": 3, "final": 0, "skipped": 1}
    tries = [r["sim_id"] for r in bundle.read_records(d)]
    assert [tries.count(i) for i in range(4)] == [2, 8, 8, 1]  # the task run again: member 0 still not
