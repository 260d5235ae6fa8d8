#!/usr/bin/env python
"""Crafted run-directory files through every reader of one, each case in a fresh process
under a 10 s wall limit and a 512 MB address-space limit (RLIMIT_AS, set in a preexec_fn).

    python benchmarks/rundir_corpus.py --json          # all 246 cases, a table, the last line JSON
    python benchmarks/rundir_corpus.py --quick         # one case of every class (make test)
    python benchmarks/rundir_corpus.py --only waves --verbose   # a line per case

A run directory is group-writable on HPC facilities: every file in it is input. A case builds
a valid run directory ``run/`` and a copy, ``outside/`` (the canary), crafts one file of
``run/`` and calls its reader as a driver, trainer or the CLI would, in a child process:
provenance.jsonl, sims/sim_00000/attempt_0.*, sims/bundle_*/{members.jsonl,bundle.json}:
attempts.record_orphans + completed_sims (a resume); trainer.lease: Contract.superseded;
endpoints.json: read_endpoints + connections_needed; sims_done.json: read_done, then a
StreamServer polling it (its thread must live); feedback.json: waves.read_feedback_record;
campaign_id.json: rundir.claim(resume=True); waves.jsonl: WavePlan(halton, a in [0, 1],
budget 8, waves of 4) + next_wave; metrics.jsonl: progress.last_json_line; hf/config.json:
interop.hf.config_from_hf; checkpoints/latest: ``hpcml ckpt ls``; sims/job.sbatch: ``hpcml
job --site slurm-local --script`` (the CLI as ``python -m hpcml.cli``).

Classes (CLASSES): symlink to the canary's file, dangling, fifo, sparse (1 GiB + 1 and 1 TiB),
over_limit (a real file one byte past the reader's limit), nested (JSON 100,000 deep),
nonfinite (NaN, Infinity, 1e999), oob (out of range or of the wrong type), foreign (another
campaign's or run's), torn, dirlink (``sims`` or a directory in it, ``checkpoints``: a link).
Outcomes: refused (an hpcml error in one line; the CLI: exit 2, one ``hpcml: error:`` line;
``refused_unnamed`` counts those not naming the file), ok (pristine) / ignored (it went on),
hang, traceback (any other exception or exit), outside_write (a name in ``outside/`` came or
went, or a file's size, mtime or ctime moved), followed (a canary file was read: its atime,
set to 1970 before, moved -- ``atime_tripwire`` says whether this file system moves atimes),
thread_death, rerun_out_of_bounds (a WavePlan took waves outside the sampler's bounds, names
or budget, or a sampler state the record did not propose). Exit 1 on any of the last six.
user_named: a directory link in a path the user gave on the command line (``hpcml ckpt ls
run/checkpoints``, ``hpcml job --script run/sims/job.sbatch``) is followed, as by any Unix
tool -- the user named it; not a failure.
Children run with OPENBLAS_NUM_THREADS=1 (BLAS reserves address space per core), never import
torch, and peak at 110-390 MB of address space here (read_bytes reserves its whole limit).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

WALL_S, AS_BYTES, MiB = 10.0, 512 << 20, 1 << 20
CAMPAIGN, RUN, LAUNCH = "camp-1", "r1", "launch-A"
SIM, BUNDLE = "sims/sim_00000", "sims/bundle_r1_00000002"
CLASSES = ("pristine", "symlink", "dangling", "fifo", "sparse", "over_limit", "nested", "nonfinite", "torn", "oob",
           "foreign", "dirlink", "dir_at_path")
FAILING = ("hang", "traceback", "outside_write", "thread_death", "rerun_out_of_bounds", "followed")
ABBR = {"refused": "R", "ok": "OK", "ignored": "I", "hang": "H", "traceback": "TB", "outside_write": "W",
        "thread_death": "TD", "rerun_out_of_bounds": "OOB", "followed": "F", "user_named": "U"}


def _j(*recs) -> str:
    return "".join(json.dumps(r) + "\n" for r in recs)


WAVE0 = {"wave": 0, "ids": [0, 1, 2, 3], "params": [{"a": 0.725}, {"a": 0.2}, {"a": 0.3}, {"a": 0.4}],
         "sampler": {"kind": "halton", "seed": 0, "drawn": 4}, "feedback_step": 0, "feedback_sims": 0}
HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "max_position_embeddings": 128, "rms_norm_eps": 1e-05, "rope_theta": 10725.0, "hidden_act": "silu"}
DONE = {"completed": [0, 1, 2], "failed": [], "streamed": {"0": 725}, "silent": [], "campaign": CAMPAIGN, "run": RUN}
FEEDBACK = {"campaign": CAMPAIGN, "run": RUN, "step": 3, "params": ["a"], "metrics": {"loss": 0.1},
            "sims": {"0": {"params": [0.725], "loss": 0.1, "samples": 5, "age": 0}}}
ENDPOINTS = {"campaign": CAMPAIGN, "run": RUN, "endpoints": ["tcp://127.0.0.1:5555"], "time": 1.0,
             "max_connections": 725}
MEMBER = {"sim_id": 2, "attempt": 0, "status": "ok", "params": {"a": 0.1}, "streamed": 725, "start": 1.0, "end": 2.0}
# key: (path in the run directory, consumer, valid text, the number a non-finite one replaces, the reader's limit)
FILES = {
    "provenance": ("provenance.jsonl", "orphans", _j({"sim_id": 1, "attempt": 0, "status": "ok", "streamed": 725}),
                   "725", MiB),
    "start": (f"{SIM}/attempt_0.start", "orphans", _j({"start": 1000.725, "host": "node1"}), "1000.725", MiB),
    "end": (f"{SIM}/attempt_0.end", "orphans", _j({"returncode": 0, "end": 1001.725}), "1001.725", MiB),
    "stream": (f"{SIM}/attempt_0.stream.json", "orphans", _j({"n_sent": 725}), "725", MiB),
    "out": (f"{SIM}/attempt_0.out", "orphans", 'step 1\nHPCML_SIM_RESULT {"samples_sent": 725}\n', "725", MiB),
    "members": (f"{BUNDLE}/members.jsonl", "orphans", _j(MEMBER), "725", 256 * MiB),
    "bundle": (f"{BUNDLE}/bundle.json", "orphans", _j({"entry": "m:f", "retries": 0, "members": [
        {"sim_id": 2, "params": {"a": 0.725}}]}), "0.725", 64 * MiB),
    "lease": ("trainer.lease", "lease", LAUNCH + "\n", None, 256),
    "endpoints": ("endpoints.json", "endpoints", _j(ENDPOINTS), "725", 64 * MiB),
    "done": ("sims_done.json", "done", _j(DONE), "725", 64 * MiB),
    "feedback": ("feedback.json", "feedback", _j(FEEDBACK), "0.725", 64 * MiB),
    "campaign_id": ("campaign_id.json", "claim", _j({"campaign_id": CAMPAIGN, "created": "2026-01-01T00:00:00",
                                                     "runs": [{"run": "r0", "pid": 725}]}), "725", MiB),
    "waves": ("waves.jsonl", "waves", _j(WAVE0), "0.725", 256 * MiB),
    "latest": ("checkpoints/latest", "ckpt_ls", "step_00000002\n", None, 4096),
    "metrics": ("metrics.jsonl", "metrics", _j({"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.725}), "0.725",
                64 * 1024),
    "hf_config": ("hf/config.json", "hf", _j(HF), "10725.0", MiB),
    "script": ("sims/job.sbatch", "job", "#!/bin/bash\necho an earlier script\n", None, None),
}
OTHER = {f"{SIM}/spec.json": _j({"params": {"a": 0.5}, "argv": ["sim"]}), f"{SIM}/attempt_0.err": "",
         "checkpoints/step_00000002/.keep": ""}
DEEP = 100_000


def _wave(**kw) -> str:
    return _j({**WAVE0, **kw})


def crafted() -> tuple[dict, dict]:
    """(oob, foreign): key -> [(variant, text)], key -> text; built with the cases, not in every child."""
    oob = {  # key -> [(name, text)]: values out of range or of the wrong type
        "provenance": [("huge_ids", _j({"sim_id": 10**30, "attempt": -1, "status": "ok", "streamed": [1]}))],
        "start": [("str_start", _j({"start": "yesterday", "host": ["x"]}))],
        "end": [("types", _j({"returncode": "0", "end": [1]})), ("huge_rc", _j({"returncode": 10**30, "end": 1e308}))],
        "stream": [("huge", _j({"n_sent": 10**30}))],
        "out": [("result_list", "HPCML_SIM_RESULT [1, 2]\n"), ("types", 'HPCML_SIM_RESULT {"samples_sent": "x"}\n')],
        "members": [("types", _j({**MEMBER, "sim_id": 2**70, "result": "x", "params": 5}))],
        "bundle": [("types", _j({"entry": 5, "retries": "x", "members": [{"sim_id": "x", "params": 5}]}))],
        "lease": [("binary", "\udcff" * 10)],
        "endpoints": [("bad_addr", _j({**ENDPOINTS, "endpoints": ["tcp://evil:99999999", "file:///etc/passwd"]})),
                      ("huge_cap", _j({**ENDPOINTS, "max_connections": 10**30}))],
        "done": [("huge_id", _j({**DONE, "completed": [2**60]})), ("types", _j({**DONE, "streamed": {"x": "y"}}))],
        "feedback": [("neg_step", _j({**FEEDBACK, "step": -1})),
                     ("types", _j({**FEEDBACK, "sims": {"0": {"params": [0.5], "loss": "x", "samples": 5,
                                                             "age": 0}}}))],
        "campaign_id": [("types", _j({"campaign_id": 5, "runs": "x"}))],
        "waves": [("out_of_bounds", _wave(params=[{"a": 5.0}, {"a": 0.2}, {"a": 0.3}, {"a": 0.4}])),
                  ("unknown_name", _wave(params=[{"b": 0.5}, {"a": 0.2}, {"a": 0.3}, {"a": 0.4}])),
                  ("extra_name", _wave(params=[{"a": 0.1, "z": 1.0}, {"a": 0.2}, {"a": 0.3}, {"a": 0.4}])),
                  ("drawn_1e12", _wave(sampler={"kind": "halton", "seed": 0, "drawn": 10**12})),
                  ("drawn_2e9", _wave(sampler={"kind": "halton", "seed": 0, "drawn": 2**31 - 2})),
                  ("million_ids", _wave(ids=list(range(10**6)), params=[{"a": 0.5}] * 10**6)),
                  ("over_budget", _wave() + _wave(wave=1, ids=[4, 5, 6, 7]) + _wave(wave=2, ids=[8, 9, 10, 11])),
                  ("ids_skip", _wave(ids=[5, 6, 7, 8])), ("bool_param", _wave(params=[{"a": True}] * 4))],
        "metrics": [("huge_int", '{"step": 1, "loss": 0.5}\n{"step": 1' + "0" * 5000 + "}\n")],
        "hf_config": [("huge_dims", _j({**HF, "hidden_size": 10**12, "num_hidden_layers": 10**9}))],
        "latest": [("escape", "../../outside/checkpoints/step_00000002\n")],
    }
    foreign = {
        "endpoints": _j({**ENDPOINTS, "campaign": "other-9", "run": "r9"}), "done": _j({**DONE, "campaign": "other-9"}),
        "feedback": _j({**FEEDBACK, "campaign": "other-9"}), "lease": "launch-of-another-job\n",
        "campaign_id": _j({"campaign_id": "other-9", "created": "2020", "simulations": {"count": 3, "digest": "x"}}),
        "waves": _wave(sampler={"kind": "halton", "seed": 99, "drawn": 4}),
        "provenance": _j({"sim_id": 0, "attempt": 0, "status": "ok", "campaign": "other-9"}),
    }
    return oob, foreign


QUICK = ("pristine:waves", "symlink:provenance", "dangling:latest", "fifo:endpoints", "sparse_1g:members",
         "over_limit:feedback", "nested_100000:done", "nonfinite_1e999:waves", "torn:metrics",
         "oob_out_of_bounds:waves", "foreign:campaign_id", "dirlink_sims:provenance", "dir_at_path:script")
"""--quick: a case of every class, over most readers (the StreamServer with a nested done file)."""
DIRLINKS = {"sims": ("sims", "provenance"), "sim_dir": (SIM, "start"), "bundle_dir": (BUNDLE, "members"),
            "checkpoints": ("checkpoints", "latest"), "script_dir": ("sims", "script")}


def cases() -> list[dict]:
    out, (oob, foreign) = [], crafted()

    def add(cls, key, how, data=None, variant=""):
        out.append({"name": f"{cls}{'_' + variant if variant else ''}:{key}", "cls": cls, "key": key, "how": how,
                    "data": data})

    for key, (rel, _, text, num, limit) in FILES.items():
        json_like = key not in ("lease", "latest", "script")
        add("pristine", key, "text", text)
        add("symlink", key, "link")
        add("dangling", key, "dangling")
        add("fifo", key, "fifo")
        add("sparse", key, "sparse", (1 << 30) + 1, "1g")
        add("sparse", key, "sparse", 1 << 40, "1t")
        if limit:
            add("over_limit", key, "over", limit)
        if json_like:
            for depth in (DEEP, 3000) if key in ("out", "metrics") else (DEEP,):
                deep = "[" * depth + "]" * depth
                body = f"HPCML_SIM_RESULT {{\"x\": {deep}}}\n" if key == "out" else f'{{"x": {deep}}}\n'
                add("nested", key, "text", (text if rel.endswith(".jsonl") else "") + body, str(depth))
            for bad in ("NaN", "Infinity", "-Infinity", "1e999"):
                add("nonfinite", key, "text", text.replace(num, bad, 1), bad.lower())
            cut = text.rstrip("\n")
            add("torn", key, "text", text + cut[:len(cut) // 2] if rel.endswith(".jsonl") else cut[:len(cut) // 2])
        for variant, bad in oob.get(key, []):
            add("oob", key, "text", bad, variant)
        if key in foreign:
            add("foreign", key, "text", foreign[key])
    for name, (d, key) in DIRLINKS.items():
        add("dirlink", key, "dirlink", d, name)
    add("dir_at_path", "script", "mkdir")
    return out


# --- the parent: build, run, classify ------------------------------------------------------------

def _write_tree(root: Path) -> None:
    for rel, text in [*OTHER.items(), *((f[0], f[2]) for f in FILES.values())]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, errors="surrogateescape")


def _apply(case: dict, run: Path, out: Path) -> None:
    rel, _, text, _, _ = FILES[case["key"]]
    p, how, data = run / rel, case["how"], case["data"]
    if how == "dirlink":
        shutil.rmtree(run / data)
        (run / data).symlink_to(out / data, target_is_directory=True)
    elif how in ("link", "dangling", "fifo", "mkdir"):
        p.unlink()
        {"link": lambda: p.symlink_to(out / rel), "dangling": lambda: p.symlink_to(out / "no-such-file"),
         "fifo": lambda: os.mkfifo(p), "mkdir": lambda: p.mkdir()}[how]()
    elif how == "sparse":  # the valid text, then a hole up to the size
        os.truncate(p, data)
    elif how == "over":  # the valid text, its last line padded with blanks one byte past the limit
        body = text.rstrip("\n")
        with open(p, "w") as f:
            f.write(body)
            left = data + 1 - len(body.rsplit("\n", 1)[-1])
            while left > 0:
                f.write(" " * min(left, 4 * MiB))
                left -= 4 * MiB
            f.write("\n")
    else:
        p.write_text(data, errors="surrogateescape")


def _canary(root: Path, arm: bool = False) -> dict:
    """Every name under ``root``: (mode, size, mtime, ctime), atime; ``arm``: atimes to 1970 first
    (mtimes kept), so that a read moves them (relatime)."""
    snap = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            if arm and n in files:
                os.utime(p, ns=(10**9, os.lstat(p).st_mtime_ns), follow_symlinks=False)
            st, reg = os.lstat(p), n in files and stat.S_ISREG(os.lstat(p).st_mode)
            snap[os.path.relpath(p, root)] = ((st.st_mode, st.st_size, *((st.st_mtime_ns, st.st_ctime_ns) if reg
                                                                         else (0, 0))), st.st_atime_ns if reg else 0)
    return snap


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_BYTES, AS_BYTES))


_fork = threading.Lock()


def _argv(consumer: str, run: Path) -> list[str]:
    cli = [sys.executable, "-m", "hpcml.cli"]
    if consumer == "ckpt_ls":
        return [*cli, "ckpt", "ls", str(run / "checkpoints")]
    if consumer == "job":
        return [*cli, "job", "--site", "slurm-local", "--nodes", "1", "--walltime", "00:10:00", "--script",
                str(run / FILES["script"][0]), "--", "python", "train.py"]
    return [sys.executable, os.path.abspath(__file__), "--child", consumer, str(run)]


def run_case(case: dict, work: Path, atime: bool) -> dict:
    d = Path(tempfile.mkdtemp(prefix=case["name"].replace(":", ".")[:60] + ".", dir=work))
    run, out = d / "run", d / "outside"
    _write_tree(run)
    _write_tree(out)
    _apply(case, run, out)
    before = _canary(out, arm=True)
    rel, consumer = FILES[case["key"]][:2]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    t0 = time.monotonic()
    with _fork:  # preexec_fn: one fork at a time
        p = subprocess.Popen(_argv(consumer, run), cwd=d, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, preexec_fn=_limits, start_new_session=True, text=True,
                             errors="replace")
    try:
        so, se = p.communicate(timeout=WALL_S)
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        so, se = p.communicate()
        hung = True
    dt = time.monotonic() - t0
    after = _canary(out)
    outcome, problem, unnamed = _classify(case, rel, consumer, p.returncode, so, se, hung, before, after, atime)
    shutil.rmtree(d, ignore_errors=True)
    return {"name": case["name"], "cls": case["cls"], "key": case["key"], "outcome": outcome, "s": round(dt, 2),
            "problem": problem, "unnamed": unnamed}


def _classify(case, rel, consumer, rc, so, se, hung, before, after, atime):
    first = lambda s: (s.strip().splitlines() or [""])[-1][:300]  # noqa: E731
    changed = sorted(k for k in before.keys() | after.keys() if k not in before or k not in after
                     or before[k][0] != after[k][0])
    if case["how"] == "dirlink" and consumer in ("ckpt_ls", "job") and not hung and "Traceback" not in se:
        # the path is on the user's command line: a link in it is theirs to follow, as for any Unix tool
        return "user_named", f"a link in the path the user named (exit {rc})", False
    if changed:
        return "outside_write", f"outside/{changed[0]} changed ({len(changed)} in all)", False
    if hung:
        return "hang", f"killed after {WALL_S:g} s: {first(se) or first(so)}", False
    if "Traceback" in se or rc < 0:
        return "traceback", (first(se) or f"signal {-rc}"), False
    read = sorted(k for k in before if atime and before[k][1] != after[k][1])
    res = None
    if consumer in ("ckpt_ls", "job"):
        err = [ln for ln in se.splitlines() if ln.startswith("hpcml: error:")]
        if rc == 0:
            res = {"status": "ok"}
        elif rc == 2 and len(err) == 1 and err[0] == se.strip().splitlines()[-1]:
            res = {"status": "refused", "msg": err[0]}
    else:
        lines = [ln for ln in so.splitlines() if ln.startswith("RESULT ")]
        res = json.loads(lines[-1][7:]) if rc == 0 and lines else None
    if res is None:
        return "traceback", f"exit {rc}, not one refusal: {first(se) or first(so)}", False
    if res.get("thread_death"):
        return "thread_death", res["thread_death"][:300], False
    if read:
        return "followed", f"outside/{read[0]} was read ({len(read)} in all): {res.get('msg') or res.get('out')}", False
    if res["status"] == "refused":
        needle = case["data"] if case["how"] == "dirlink" else os.path.basename(rel)
        return "refused", res["msg"], needle.split("/")[-1] not in res["msg"] or res.get("lines", 1) > 1
    if res.get("oob"):
        return "rerun_out_of_bounds", res["oob"][:300], False
    return ("ok" if case["cls"] == "pristine" else "ignored"), res.get("out", "")[:300], False


# --- the child: one reader, as its caller uses it --------------------------------------------------

def consume(consumer: str, run: Path):
    """What the reader of one file made of it (a str, or a dict of ``thread_death`` / ``oob``)."""
    import math

    from hpcml import contract
    from hpcml.errors import HpcmlError

    c = contract.Contract(run_dir=str(run), campaign=CAMPAIGN, run=RUN, launch=LAUNCH,
                          endpoints_file=str(run / "endpoints.json"), done_file=str(run / "sims_done.json"))
    if consumer == "orphans":  # a resumed driver (rundir.claim) and then the campaign's skip of completed ones
        from hpcml.ensemble import attempts, provenance

        n, done = attempts.record_orphans(run), sorted(provenance.completed_sims(run))
        last = [(r.get("sim_id"), r.get("status"), r.get("streamed"), r.get("samples_sent"))
                for r in provenance.read_provenance(run)[-3:]]
        return f"orphans={n} completed={done} last={last}"
    if consumer == "lease":
        return f"superseded={c.superseded()}"
    if consumer == "endpoints":  # a simulation's producer, and the driver's check of max_concurrent
        got = contract.read_endpoints(c.endpoints_file, 0.0, contract=c)
        contract.connections_needed(c.endpoints_file, 4, 2, c)
        return f"endpoints={got}"
    if consumer == "done":  # the trainer's view: read_done, then its stream server polling the file
        from hpcml.stream import Buffer, BufferConfig
        from hpcml.stream.server import ServerConfig, StreamServer

        try:
            got = f"done={contract.read_done(c.done_file, c)}"
        except HpcmlError as e:
            got = e
        srv = StreamServer(campaign=CAMPAIGN, secret=b"k" * 32, rank=0, n_trainers=1, contract=c,
                           buffer=Buffer(BufferConfig(policy="fifo", capacity=4, watermark=1)),
                           config=ServerConfig(param_names=("a",), field_names=("T",), done_file=c.done_file,
                                               end_grace_s=5)).start()
        time.sleep(1.2)  # it reads the done file every 0.5 s
        alive, error = srv._thread.is_alive(), srv.error
        srv.stop()
        if not alive:
            return {"thread_death": f"the stream server thread died: {error}"}
        if isinstance(got, Exception):
            raise got
        return f"{got} server_error={error}"
    if consumer == "feedback":
        from hpcml.ensemble import waves

        rec = waves.read_feedback_record(run / "feedback.json", campaign=CAMPAIGN, run=RUN)
        return f"step={rec.step} sims={ {k: v.params for k, v in rec.sims.items()} } metrics={rec.metrics}"
    if consumer == "claim":
        from hpcml.ensemble import rundir

        cl = rundir.claim(run, resume=True)
        rundir.release(run)
        return f"campaign={cl.campaign} held={cl.held}"
    if consumer == "waves":  # a resumed adaptive driver: the plan read back, then its next wave
        from hpcml.ensemble import sampling, waves

        budget, size = 8, 4
        plan = waves.WavePlan(run, sampling.static("halton", {"a": (0.0, 1.0)}), budget=budget, size=size)
        recorded = plan.proposed
        new = plan.next_wave({}) if not plan.done else []
        sims = plan.simulations()
        bad = [f"simulation {i} {p}" for i, p in sims if set(p) != {"a"} or isinstance(p["a"], bool)
               or not math.isfinite(p["a"]) or not 0.0 <= p["a"] <= 1.0]
        if len(sims) > budget or any(len(w["ids"]) > size for w in plan.waves):
            bad.append(f"{len(sims)} simulations in waves of {[len(w['ids']) for w in plan.waves][:5]}")
        if plan.sampler.drawn != plan.proposed:
            bad.append(f"the sampler has drawn {plan.sampler.drawn} points for the {plan.proposed} proposed")
        out = f"recorded={recorded} new={[i for i, _ in new]}"
        return {"oob": f"accepted: {bad[0]} ({out})"} if bad else out
    if consumer == "metrics":
        from hpcml.ensemble import progress

        return f"last={progress.last_json_line(run / 'metrics.jsonl')}"
    from hpcml.interop.hf import config_from_hf

    cfg = config_from_hf(run / "hf")
    return f"dim={cfg.dim} layers={cfg.n_layers} rope_theta={cfg.rope_theta}"


def child(consumer: str, run: str) -> None:
    from hpcml.errors import HpcmlError

    try:
        got = consume(consumer, Path(run))
        res = {"status": "ok", **(got if isinstance(got, dict) else {"out": str(got)[:500]})}
    except HpcmlError as e:  # the clean refusal; anything else is a traceback
        res = {"status": "refused", "msg": f"{type(e).__name__}: {e}"[:500], "lines": len(str(e).splitlines())}
    print("RESULT " + json.dumps(res), flush=True)


# --- report --------------------------------------------------------------------------------------

def report(rows: list[dict], wall: float, atime: bool) -> dict:
    classes = [c for c in CLASSES if any(r["cls"] == c for r in rows)]
    by_class = {c: {} for c in classes}
    for r in rows:
        by_class[r["cls"]][r["outcome"]] = by_class[r["cls"]].get(r["outcome"], 0) + 1
    outcomes = [o for o in ABBR if any(o in v for v in by_class.values())]
    print(f"| class | cases | {' | '.join(outcomes)} |\n|---|---|{'---|' * len(outcomes)}")
    for c in classes:
        print(f"| {c} | {sum(by_class[c].values())} | " + " | ".join(str(by_class[c].get(o, "")) for o in outcomes)
              + " |")
    keys = list(dict.fromkeys(r["key"] for r in rows))
    print(f"\n| file | {' | '.join(classes)} |\n|---|{'---|' * len(classes)}")
    for k in keys:
        cells = []
        for c in classes:
            got = [r["outcome"] for r in rows if r["key"] == k and r["cls"] == c]
            cells.append(" ".join(f"{got.count(o)}{ABBR[o]}" for o in ABBR if o in got) or "-")
        print(f"| {FILES[k][0]} | " + " | ".join(cells) + " |")
    count = lambda o: sum(r["outcome"] == o for r in rows)  # noqa: E731
    failing = [{"name": r["name"], "outcome": r["outcome"], "problem": r["problem"].splitlines()[0] if r["problem"]
                else ""} for r in rows if r["outcome"] in FAILING]
    for f in failing:
        print(f"FAIL {f['name']}: {f['outcome']}: {f['problem']}", file=sys.stderr)
    unnamed = [f"{r['name']}: {r['problem'][:160]}" for r in rows if r["unnamed"]]
    for u in unnamed:
        print(f"note: refused without naming the file: {u}", file=sys.stderr)
    return {"cases": len(rows), "by_class": by_class, "hangs": count("hang"), "tracebacks": count("traceback"),
            "outside_writes": count("outside_write"), "thread_deaths": count("thread_death"),
            "out_of_bounds_rerun": count("rerun_out_of_bounds"), "outside_reads": count("followed"),
            "atime_tripwire": atime, "refused_unnamed": len(unnamed),
            "max_case_s": max((r["s"] for r in rows), default=0.0), "wall_s": round(wall, 1), "failing": failing}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="a last line of JSON")
    p.add_argument("--quick", action="store_true", help="one case of every class")
    p.add_argument("--only", help="the cases whose name holds this")
    p.add_argument("--list", action="store_true")
    p.add_argument("--jobs", type=int, default=2, help="cases at a time (default 2)")
    p.add_argument("--verbose", action="store_true", help="a line per case: outcome, seconds, what it said")
    p.add_argument("--workdir", help="where the cases are built (default: a temporary directory)")
    p.add_argument("--child", nargs=2, metavar=("CONSUMER", "RUN_DIR"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    todo = [c for c in cases() if not args.only or args.only in c["name"]]
    if args.quick:
        todo = [c for c in todo if c["name"] in QUICK]
    if args.list:
        print("\n".join(c["name"] for c in todo))
        return 0
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rundir_corpus.", dir=args.workdir) as work:
        probe = Path(work, "probe")  # does this file system move atimes (relatime)?
        probe.write_text("x")
        _canary(Path(work), arm=True)
        atime = probe.read_text() == "x" and os.stat(probe).st_atime_ns != 10**9
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            rows = list(pool.map(lambda c: run_case(c, Path(work), atime), todo))
    for r in rows if args.verbose else ():
        print(f"{r['name']:<34} {r['outcome']:<14} {r['s']:5.2f}s  {r['problem'][:150]}")
    out = report(rows, time.monotonic() - t0, atime)
    if args.json:
        print(json.dumps(out))
    bad = sum(out[k] for k in ("hangs", "tracebacks", "outside_writes", "thread_deaths", "out_of_bounds_rerun",
                               "outside_reads"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
