"""The run directory is untrusted input (issue 40): the group may write it, so a link, a FIFO,
a huge or deeply nested file, or a record out of bounds may be anyone's. Each case here failed
before the file layer (:mod:`hpcml.safeio`): a write through a link outside the run directory, a
hang, a traceback, a dead server thread, a simulation out of bounds run again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from hpcml import contract, safeio
from hpcml.contract import Contract, read_endpoints
from hpcml.ensemble import attempts, provenance
from hpcml.ensemble.breed import Breed
from hpcml.ensemble.sampling import Halton
from hpcml.ensemble.waves import WAVES_FILE, WavePlan, read_feedback_record
from hpcml.errors import ConfigError

OUTSIDE = b"a file outside the run directory\n"
NESTED = b'{"a":' * 100_000 + b"1" + b"}" * 100_000


@pytest.fixture
def run(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "outside").write_bytes(OUTSIDE)
    return tmp_path / "run"


def _quick(fn, limit_s: float = 5.0):
    """``fn()``'s result or exception, failing the test if it blocks (a FIFO opened for reading)."""
    out: dict = {}

    def call():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 -- handed to the test
            out["error"] = e
    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"{fn} blocked for {limit_s} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _orphan(run_dir, sim=0):
    """An attempt its killed driver never recorded: what a resume folds into provenance."""
    d = attempts.sim_dir(run_dir, sim)
    d.mkdir(parents=True)
    (d / "attempt_0.start").write_text(json.dumps({"start": 1.0, "host": "n1"}))
    (d / "attempt_0.end").write_text(json.dumps({"returncode": 0, "end": 2.0, "reason": ""}))
    return d


def test_a_resume_never_appends_through_a_link_out_of_the_run_directory(run):
    _orphan(run)
    (run / provenance.PROVENANCE_FILE).symlink_to(run.parent / "outside")
    with pytest.raises(ConfigError, match=r"provenance\.jsonl: is a symbolic link"):
        attempts.record_orphans(run)
    assert (run.parent / "outside").read_bytes() == OUTSIDE
    (run / provenance.PROVENANCE_FILE).unlink()
    (run / "sims").rename(run / "sims_real")  # a directory on the way replaced by a link
    (run / "sims").symlink_to(run / "sims_real")
    (run / provenance.PROVENANCE_FILE).write_text("")
    (run.parent / "outside_dir").mkdir()
    os.link(run.parent / "outside", run.parent / "outside_dir" / "hard")
    (run / provenance.PROVENANCE_FILE).unlink()
    os.link(run.parent / "outside", run / provenance.PROVENANCE_FILE)  # a hard link: the same file outside
    with pytest.raises(ConfigError, match=r"hard links"):
        provenance.append_provenance(run, [{"sim_id": 0}])
    assert (run.parent / "outside").read_bytes() == OUTSIDE


def test_fifos_in_the_run_directory_neither_hang_the_driver_nor_pass_for_records(run):
    d = _orphan(run)
    os.mkfifo(run / provenance.PROVENANCE_FILE)
    with pytest.raises(ConfigError, match=r"provenance\.jsonl: is a FIFO"):
        _quick(lambda: list(provenance.iter_provenance(run)))
    os.unlink(run / provenance.PROVENANCE_FILE)
    for name in ("attempt_0.start", "attempt_0.stream.json", "attempt_0.out", "attempt_0.cmd"):
        os.unlink(d / name) if (d / name).exists() else None
        os.mkfifo(d / name)
    rec = _quick(lambda: attempts.attempt_record(run, d, sim_id=0, params={}, argv=["x"], launch="", k=0))
    assert rec["start"] is None and rec["streamed"] is None and rec["command"] is None and rec["result"] is None
    assert rec["status"] == "ok"  # its end record says so; the planted files only lose their fields


def test_huge_and_nested_records_are_refused_in_one_line_not_read_whole(run):
    prov = run / provenance.PROVENANCE_FILE
    good = json.dumps({"sim_id": 3, "attempt": 0, "status": "ok"}).encode()
    with open(prov, "wb") as f:  # a 64 MiB line between two good ones, and a nested one
        f.write(good + b"\n" + b"x" * (64 << 20) + b"\n" + NESTED + b"\n" + good.replace(b"3", b"4") + b"\n")
    assert sorted(provenance.completed_sims(run)) == [3, 4]
    for name in ("endpoints.json", "feedback.json", "campaign_id.json", "sims_done.json"):
        (run / name).write_bytes(NESTED)
        with pytest.raises(ConfigError, match=rf"{name}: JSON nested more than 64 deep") as e:
            safeio.read_json(run / name, contract.MAX_RECORD_BYTES)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="nested more than 64"):
        read_endpoints(run / "endpoints.json")
    with pytest.raises(ConfigError, match="nested more than 64"):
        read_feedback_record(run / "feedback.json")
    os.truncate(run / "sims_done.json", 1 << 40)  # a sparse TiB
    with pytest.raises(ConfigError, match=r"sims_done\.json: 1099511627776 bytes, larger than"):
        safeio.read_json(run / "sims_done.json", contract.MAX_RECORD_BYTES)


def test_the_lease_is_read_bounded_never_through_a_fifo_or_link(run):
    c = Contract(run_dir=str(run), campaign="c", launch="mine")
    lease = run / contract.LEASE_FILE
    lease.write_text("other\n")
    assert c.superseded()
    lease.write_text("mine\n")
    assert not c.superseded()
    lease.unlink()
    os.mkfifo(lease)
    assert _quick(c.superseded) is False  # a planted FIFO: not this job's to judge, and no hang
    lease.unlink()
    lease.symlink_to(run.parent / "outside")
    assert c.superseded() is False
    lease.unlink()
    with open(lease, "wb") as f:
        f.truncate(1 << 30)
    assert c.superseded() is False  # 1 GiB is no launch token: not read


def test_a_nested_done_record_leaves_the_stream_server_thread_running(run):
    from hpcml.stream import Buffer, BufferConfig
    from hpcml.stream.server import ServerConfig, StreamServer

    (run / "sims_done.json").write_bytes(NESTED)
    srv = StreamServer(campaign="c", secret=b"k" * 32, rank=0, n_trainers=1,
                       buffer=Buffer(BufferConfig(policy="fifo", capacity=4, watermark=1)),
                       config=ServerConfig(param_names=("a",), field_names=("T",),
                                           done_file=str(run / "sims_done.json"))).start()
    try:
        deadline = time.monotonic() + 5
        while srv.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.error is not None and "nested more than 64" in srv.error
        assert srv._thread.is_alive()  # the error is the buffer's to report, the thread lives on
    finally:
        srv.stop()


BOUNDS = {"k": (0.1, 10.0), "q": (-1.0, 1.0)}


def _recorded_wave(run, **change):
    plan = WavePlan(run, Breed(bounds=BOUNDS, seed=1, ramp_waves=1), budget=20, size=4)
    plan.next_wave({})
    w = json.loads((run / WAVES_FILE).read_text())
    for k, v in change.items():
        w[k] = v(w[k]) if callable(v) else v
    (run / WAVES_FILE).write_text(json.dumps(w).replace("Infinity", "1e999") + "\n")  # JSON's own way to inf


@pytest.mark.parametrize("params, why", [
    ({"k": 1e999, "q": 0.0}, r"not JSON \(1e999 overflows a float"),
    ({"k": -1e999, "q": 0.0}, r"not JSON \(-1e999 overflows a float"),
    ({"k": 1e9, "q": 0.0}, r"k=1000000000\.0, outside the sampler's bounds \(0\.1, 10\.0\)"),
    ({"k": 1.0, "q": 0.0, "evil": 1.0}, r"parameters \['evil', 'k', 'q'\], the sampler's are \['k', 'q'\]"),
])
def test_a_recorded_wave_out_of_bounds_is_refused_not_run_again(run, params, why):
    _recorded_wave(run, params=lambda ps: [params] + ps[1:])
    with pytest.raises(ConfigError, match=rf"waves\.jsonl, line 1: (simulation 0 has )?{why}"):
        WavePlan(run, Breed(bounds=BOUNDS, seed=1, ramp_waves=1), budget=20, size=4)


def test_a_recorded_wave_larger_than_the_plan_or_a_sampler_state_out_of_range_is_refused(run):
    _recorded_wave(run, ids=list(range(10**5)), params=lambda ps: ps * 25_000)  # the 10^6: the same check
    with pytest.raises(ConfigError, match=r"wave 0 of 100000 simulations from id 0: this plan runs waves of at "
                                          r"most 4 and 20 simulations in all"):
        WavePlan(run, Breed(bounds=BOUNDS, seed=1, ramp_waves=1), budget=20, size=4)
    (run / WAVES_FILE).unlink()
    plan = WavePlan(run, Halton(BOUNDS, seed=1), budget=20, size=4)
    plan.next_wave({})
    w = json.loads((run / WAVES_FILE).read_text())
    w["sampler"]["drawn"] = 10**12
    (run / WAVES_FILE).write_text(json.dumps(w) + "\n")
    with pytest.raises(ConfigError, match=r"waves\.jsonl, line 1: the sampler's state says drawn=1000000000000: more "
                                          r"than this plan drew"):
        WavePlan(run, Halton(BOUNDS, seed=1), budget=20, size=4)


def test_hpcml_job_script_into_a_fifo_fails_at_once_in_one_line(tmp_path):
    os.mkfifo(tmp_path / "job.sh")
    p = subprocess.run([sys.executable, "-m", "hpcml.cli", "job", "--site", "slurm-local", "--script",
                        str(tmp_path / "job.sh"), "--nodes", "1", "--walltime", "00:10:00", "--", "python", "train.py"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert f"{tmp_path / 'job.sh'}: is a FIFO" in p.stderr.strip().splitlines()[-1]


#: Reads and writes outside the file layer, each with why it is not a user's file.
ALLOWED = {
    "/proc/": "the kernel's own files",
    "resources.files(": "the package's data",
    "hpcml/plan/fit.py": "the developers' fit writes the package's data",
    "PBS_NODEFILE": "the scheduler's node file, outside the run directory",
}


def test_no_file_is_opened_outside_the_file_layer():
    """A bare ``open(`` / ``read_text(`` / ``write_text(`` in hpcml is a reader or writer the
    file layer does not guard: it must go through :mod:`hpcml.safeio`, or be allowed above."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    bare = re.compile(r"(?<![\w.])open\(|(?<!safeio)\.(read_text|write_text|read_bytes|write_bytes)\(")
    found = []
    for path in sorted((root / "hpcml").rglob("*.py")):
        rel = str(path.relative_to(root))
        if rel.startswith("hpcml/safeio/"):
            continue
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            code = line.split("#", 1)[0]
            if not bare.search(code) or code.lstrip().startswith(("def ", "blocking ``open")):
                continue
            context = rel + "\n" + "\n".join(lines[max(0, i - 3):i + 1])
            if not any(key in context for key in ALLOWED):
                found.append(f"{rel}:{i + 1}: {line.strip()}")
    assert found == [], "\n".join(found)
    assert bare.search('open(p, "a")') and not bare.search("safeio.read_text(p)")  # the pattern sees what it must


def test_one_case_of_every_class_of_the_corpus_passes():
    """``benchmarks/rundir_corpus.py --quick``: one crafted case of every class (links, FIFOs,
    sparse, over the limit, nested, non-finite, torn, out of bounds, foreign, directory links)
    through its real reader in a child process under 10 s and 512 MB: nothing hangs, fails with
    a traceback, reads or writes outside the run directory, kills a thread or runs a wave out of bounds."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "rundir_corpus.py"), "--quick", "--json"],
                       capture_output=True, text=True, timeout=300, cwd=root)
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    assert p.returncode == 0, rec["failing"]
    assert rec["cases"] >= 13 and set(rec["by_class"]) >= {"symlink", "fifo", "sparse", "nested", "oob", "dirlink"}
    assert (rec["hangs"], rec["tracebacks"], rec["outside_writes"], rec["thread_deaths"], rec["out_of_bounds_rerun"],
            rec["outside_reads"]) == (0, 0, 0, 0, 0, 0)
    assert rec["by_class"]["pristine"] == {"ok": 1}  # the valid run directory is read as valid: the corpus can tell
