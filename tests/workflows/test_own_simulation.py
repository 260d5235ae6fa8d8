"""A user's own simulation through the library call, online and offline, with a trainer restart.

The simulation is neither heat2d nor Gray-Scott: a 1-D viscous Burgers solver on 2 MPI ranks
(``own_sim/burgers1d.py``, halo exchange with mpi4py), written as a new user would from
docs/tutorial-online-training.md. Its trainer (``own_sim/train_burgers.py``) is
``train_online`` with ``FieldTrainer`` and a model of its own. Real Parsl, real mpiexec, real
ZeroMQ, real HDF5.

- online: 4 simulations x 2 ranks stream into a 2-rank trainer through ``hpcml.Campaign``;
  the first training job is killed (SIGKILL) right after a checkpoint while every simulation
  is still running, and the Campaign relaunches it, which resumes from that checkpoint on the
  same ports while the simulations reconnect. The moment is made deterministic: before their
  6th output the simulations wait for a file that only the relaunched trainer creates; each
  trainer rank's watermark is every sample its simulations send before that wait, so its
  first step sees them all, and it kills itself right after the next checkpoint (step 25).
  So nothing is in flight at the kill and nothing may be lost (the documented limit -- what a
  killed trainer ingested after its last save is lost -- does not apply), and the numbers are
  exact.
- offline: the simulations write HDF5 files (a Campaign without trainer), then the trainer
  alone (``Campaign.train``) reads them with ``FileSource``, is stopped by the walltime signal
  (SIGUSR1, exit 75) after step 6, and a second launch resumes it and finishes: every sample is
  read exactly once across the two launches.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("parsl")

from hpcml.ensemble import Campaign, SimSpec, TrainingJob, design  # noqa: E402
from hpcml.stream import new_secret, route  # noqa: E402
from hpcml.train.online import load_source_states  # noqa: E402

HERE = Path(__file__).resolve().parent / "own_sim"
SIM, TRAIN = str(HERE / "burgers1d.py"), str(HERE / "train_burgers.py")
NX, SIM_STEPS, NU_MAX = 64, 400, 0.05  # burgers1d.py's grid, time steps and the viscosity its dt is stable for
T_MAX = SIM_STEPS * 0.2 * (1.0 / NX) ** 2 / NU_MAX  # the last output's time (burgers1d.py's dt)
BOUNDS = {"nu": (0.01, 0.05), "amp": (0.5, 1.0)}  # train_burgers.py's input scaling
N_SIMS, TRAIN_RANKS = 4, 2


def _points() -> list[dict[str, float]]:
    return design("lhs", BOUNDS, N_SIMS, seed=7)


def _sims(every: int, extra) -> list[SimSpec]:
    """``extra(i)``: the simulation's own flags."""
    return [SimSpec(sim_id=i, params=p, ranks=2,
                    argv=[sys.executable, SIM, "--nx", str(NX), "--steps", str(SIM_STEPS), "--every", str(every),
                          *extra(i)])
            for i, p in enumerate(_points())]


def _train_argv(*flags: str) -> list[str]:
    return [sys.executable, TRAIN, "--nx", str(NX), "--t-max", repr(T_MAX), *flags]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _provenance(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "provenance.jsonl").read_text().splitlines()]


def _why(run_dir: Path) -> str:
    return "\n".join(f"--- {n}\n" + (run_dir / n).read_text()[-3000:] for n in ("train.out", "train.err")
                     if (run_dir / n).exists())


def _all_keys(outputs: int, every: int) -> set[tuple[int, int]]:
    return {(s, k * every) for s in range(N_SIMS) for k in range(1, outputs + 1)}


def _seen(ckpt: Path) -> list[tuple[int, int]]:
    """Every (simulation, step) key the checkpoint's source states hold, after checking that each
    saved trainer rank holds only simulations routed to it."""
    states = load_source_states(ckpt)
    assert len(states) == TRAIN_RANKS
    keys = []
    for rank, st in enumerate(states):
        mine = [tuple(k) for k in st["seen"].tolist()]
        assert all(route(s, TRAIN_RANKS) == rank for s, _ in mine), (rank, mine)
        keys += mine
    return keys


@pytest.mark.timeout(240)
def test_online_trainer_killed_and_relaunched_by_the_campaign_loses_nothing(tmp_path):
    every, hold_at = 40, 6
    outputs = SIM_STEPS // every  # 10 per simulation
    steps, ckpt_every = 200, 25
    # each trainer rank gets 2 simulations (asserted below); its first step waits for the 5 outputs
    # each sends before holding: then nothing more can come until the relaunch releases them
    watermark = 2 * (hold_at - 1)
    run_dir = tmp_path / "online"
    run_dir.mkdir()
    new_secret(run_dir / "stream.key")
    release = run_dir / "release"  # the simulations wait for it before output 6; the relaunched trainer writes it
    env = {"HPCML_STREAM_ENDPOINTS_FILE": str(run_dir / "endpoints.json"),
           "HPCML_STREAM_SECRET_FILE": str(run_dir / "stream.key")}
    sims = _sims(every, lambda i: ["--stream", "--hold-file", str(release), "--hold-at", str(hold_at)])
    assert sorted(route(s.sim_id, TRAIN_RANKS) for s in sims) == [0, 0, 1, 1]  # 2 simulations per trainer rank
    training = TrainingJob(argv=_train_argv("--mode", "online", "--steps", str(steps),
                                            "--ckpt-every", str(ckpt_every), "--keep", "100",
                                            "--watermark", str(watermark),
                                            "--crash-after-hold", "--release", str(release),
                                            "--hold-at", str(hold_at)),
                           ranks=TRAIN_RANKS, max_restarts=1)
    campaign = Campaign(run_dir=run_dir, site="local", max_concurrent=N_SIMS, retries=1, env=env, progress=False)
    res = campaign.run(sims, training=training, ready_file=run_dir / "endpoints.json", ready_timeout_s=120,
                       train_timeout_s=120)

    # the campaign: every simulation completed on its first attempt, the trainer exited 0 after one relaunch
    assert (res.status, res.completed, res.failed, res.cancelled, res.retried) == ("ok", [0, 1, 2, 3], [], [], []), \
        _why(run_dir)
    assert res.attempts == {i: 1 for i in range(N_SIMS)} and res.samples_sent == N_SIMS * outputs
    assert res.training_returncode == 0
    record = json.loads((run_dir / "campaign.json").read_text())
    assert record["training"]["restarts"] == 1 and record["training"]["returncode"] == 0
    prov = _provenance(run_dir)
    assert sorted((r["sim_id"], r["attempt"], r["status"], r["samples_sent"]) for r in prov) == \
        [(i, 0, "ok", outputs) for i in range(N_SIMS)]
    assert all(r["result"]["ranks"] == 2 and abs(r["result"]["mass"]) < 1e-9 for r in prov)  # a conservative scheme

    # the kill came right after a checkpoint, the relaunch resumed from it, and the simulations were
    # still running: they finished only after the relaunched trainer released them
    out = (run_dir / "train.out").read_text()
    killed = [line for line in out.splitlines() if "killing the training job after the checkpoint at step" in line]
    resumed = [line for line in out.splitlines() if "] resumed at step " in line]
    assert len(killed) == 1 and len(resumed) == 1, out[-3000:]
    assert "[train] every sample sent before the hold is in at step 1\n" in out, out[-3000:]
    k = int(killed[0].rsplit(" ", 1)[1])
    assert k == ckpt_every  # the first checkpoint after step 1
    assert resumed[0].startswith(f"[train] resumed at step {k} from ")
    at_kill = _seen(run_dir / "checkpoints" / f"step_{k:08d}")  # what the relaunch resumed from
    assert sorted(at_kill) == sorted(_all_keys(hold_at - 1, every))  # every output before the hold, once
    assert release.read_text() == str(k + 1)  # written by the relaunch at its first step, not as a fallback
    assert min(r["end"] for r in prov) >= release.stat().st_mtime - 0.5
    assert [m["step"] for m in _metrics(run_dir)] == list(range(1, steps + 1))  # 1..k, then k+1..steps

    # the trainer's numbers: every output of every simulation ingested once, nothing dropped
    s = json.loads((run_dir / "train_summary.json").read_text())
    assert (s["status"], s["problems"], s["resumed_at"]) == ("ok", [], k)
    assert s["samples_ingested"] == s["samples_expected"] == N_SIMS * outputs
    assert (s["duplicate_samples"], s["dropped_messages"]) == (0, {})
    assert s["bytes_ingested"] == N_SIMS * outputs * NX * 4  # float32 fields of nx points
    assert (s["gradient_steps"], s["samples_trained"], s["train_ranks"]) == (steps, steps * 4 * TRAIN_RANKS, 2)
    first_loss = _metrics(run_dir)[0]["loss"]
    assert math.isfinite(s["final_loss"]) and s["final_loss"] < first_loss / 5, (first_loss, s["final_loss"])
    keys = _seen(run_dir / "checkpoints")
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{steps:08d}"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == \
        [f"step_{i:08d}" for i in range(ckpt_every, steps + 1, ckpt_every)]
    assert len(keys) == len(set(keys)) and set(keys) == _all_keys(outputs, every)


@pytest.mark.timeout(240)
def test_offline_files_then_trainer_stopped_and_resumed_reads_every_sample_once(tmp_path):
    every = 20
    outputs = SIM_STEPS // every  # 20 per simulation, 80 in all: 40 per trainer rank
    steps, batch, stop_at = 16, 2, 6
    run_dir = tmp_path / "offline"
    data = run_dir / "data"
    data.mkdir(parents=True)
    campaign = Campaign(run_dir=run_dir, site="local", max_concurrent=2, retries=1, progress=False)

    # phase 1: the simulations write their files; no trainer
    res = campaign.run(_sims(every, lambda i: ["--out", str(data / f"sim_{i:05d}.h5")]))
    assert (res.status, res.completed, res.failed, res.retried, res.training_returncode) == \
        ("ok", [0, 1, 2, 3], [], [], None)
    assert sorted(p.name for p in data.iterdir()) == [f"sim_{i:05d}.h5" for i in range(N_SIMS)]  # no .tmp left
    assert not (run_dir / "endpoints.json").exists()

    # phase 2: the trainer alone, FIFO (each sample used once), stopped by SIGUSR1 after step 6
    training = TrainingJob(argv=_train_argv("--mode", "offline", "--data", str(data),
                                            "--steps", str(steps), "--batch", str(batch), "--buffer", "fifo",
                                            "--capacity", "6", "--watermark", "2", "--ckpt-every", "100",
                                            "--stop-at", str(stop_at)),
                           ranks=TRAIN_RANKS, stream=False)
    first = campaign.train(training, train_timeout_s=120)
    assert (first.status, first.interrupted, first.training_returncode) == ("interrupted", True, 75), _why(run_dir)
    assert "[train] stopped at step 6 after saving" in (run_dir / "train.out").read_text()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{stop_at:08d}"  # saved on the stop
    assert not (run_dir / "train_summary.json").exists()
    at_stop = _seen(run_dir / "checkpoints")
    assert len(at_stop) == len(set(at_stop)) and set(at_stop) < _all_keys(outputs, every)
    # FIFO with room for 6: the files were read only as far as training went (12 per rank used, at most 6 + a
    # batch waiting), so the resume must read on from where this one stopped
    assert stop_at * batch * TRAIN_RANKS <= len(at_stop) <= (stop_at * batch + 6 + batch) * TRAIN_RANKS

    # phase 3: the same job again, resumed (HPCML_RESUME=1 from the Campaign): it finishes
    second = campaign.train(training, train_timeout_s=120, resume=True)
    assert (second.status, second.training_returncode) == ("ok", 0), _why(run_dir)
    training_record = json.loads((run_dir / "training.json").read_text())
    assert training_record["total"] == 0 and training_record["campaign_id"] == first.campaign_id == res.campaign_id
    out = (run_dir / "train.out").read_text()
    assert out.count("] resumed at step ") == 1 and f"[train] resumed at step {stop_at} from " in out, out[-3000:]
    assert [m["step"] for m in _metrics(run_dir)] == list(range(1, steps + 1))  # 1..6, then 7..16

    s = json.loads((run_dir / "train_summary.json").read_text())
    assert (s["status"], s["problems"], s["resumed_at"]) == ("ok", [], stop_at)
    assert s["samples_ingested"] == s["samples_expected"] == N_SIMS * outputs
    assert (s["duplicate_samples"], s["dropped_messages"]) == (0, {})
    assert (s["gradient_steps"], s["samples_trained"]) == (steps, steps * batch * TRAIN_RANKS)
    # FIFO: every sample was trained on once or left over at the end -- none lost at the stop, none twice
    assert s["samples_trained"] + s["samples_unused"] == N_SIMS * outputs
    for rank in s["buffer"]["per_rank"]:
        assert set(rank.get("reuse_hist", {})) <= {"1"}, rank
    first_loss = _metrics(run_dir)[0]["loss"]
    assert math.isfinite(s["final_loss"]) and s["final_loss"] < first_loss, (first_loss, s["final_loss"])
    keys = _seen(run_dir / "checkpoints")
    assert len(keys) == len(set(keys)) and set(keys) == _all_keys(outputs, every)
    assert set(at_stop) <= set(keys)
