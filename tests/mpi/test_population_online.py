"""A population of surrogate trainers in one training job (issue 45, item 5): ``train_surrogate(...,
population=PopulationConfig(members=2, ...))`` on a simulation hpcml has never seen (an advected
blob in the kernels' HDF5 layout). Each member trains on its own simulations (``sim % 2``), every
sample reaching exactly one member once, across a stop and a resume whose members saved
different newest steps; tournaments leave both members with one model; the summary speaks for
the best member. Runs at 2 ranks (members of 1) and 4 (members of dp 2)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
import signal
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcml import ckpt, stop
from hpcml.contract import CONFIG_ERROR, Contract
from hpcml.errors import ConfigError
from hpcml.models.surrogate import MLPSurrogate, MLPSurrogateConfig
from hpcml.train import FieldScales, FieldTrainConfig, PopulationConfig, TournamentConfig, train_surrogate
from hpcml.train.online import OnlineConfig, load_source_states

N_SIMS, N_VAL, N_OUT, NX, NY = 12, 4, 6, 8, 8
SCALES = FieldScales(param_lo=(0.2, 0.1), param_hi=(0.8, 0.4), t_max=1.0)


def _files(comm, tmp_path_factory) -> tuple[Path, list[Path], list[Path]]:
    root = Path(comm.bcast(str(tmp_path_factory.mktemp("popblob")) if comm.rank == 0 else None))
    if comm.rank == 0:
        x, y = np.meshgrid(np.linspace(-1, 1, NX), np.linspace(-1, 1, NY), indexing="ij")
        for sim in range(N_SIMS + N_VAL):
            v, w = 0.2 + 0.04 * sim, 0.1 + 0.015 * sim
            t = np.linspace(0.0, 1.0, N_OUT)
            u = np.stack([np.exp(-((x - v * ti) ** 2 + y ** 2) / w) for ti in t]).astype(np.float32)
            (root / ("val" if sim >= N_SIMS else "train")).mkdir(exist_ok=True)
            with h5py.File(root / ("val" if sim >= N_SIMS else "train") / f"blob_{sim:03d}.h5", "w") as f:
                f["fields/u"], f["time"], f["step"] = u, t, np.arange(N_OUT) * 10
                f.attrs["sim_id"], f.attrs["params"] = sim, json.dumps({"v": v, "w": w})
    comm.Barrier()
    return root, sorted((root / "train").glob("*.h5")), sorted((root / "val").glob("*.h5"))


def _run_dir(comm, tmp_path_factory, name: str) -> tuple[Path, list[Path], list[Path]]:
    """A fresh run directory beside the simulations' files (made once, seen by every rank)."""
    root, files, val = _files(comm, tmp_path_factory)
    if comm.rank == 0:
        (root / name).mkdir()
    comm.Barrier()
    return root / name, files, val


def _train(run_dir: Path, files, val, *, steps: int, resume: bool, on_step=None, population=None) -> int:
    contract = Contract(run_dir=str(run_dir), campaign="pop", resume=resume)
    model = MLPSurrogate(MLPSurrogateConfig(n_params=2, nx=NX, ny=NY, hidden=32, depth=2))
    pop = population or PopulationConfig(
        members=2, tournament=TournamentConfig(every=3, seed=1),
        configure=lambda m, cfg: replace(cfg, lr=cfg.lr * (1 + 9 * m)))
    return train_surrogate(model, params=("v", "w"), fields=("u",), scales=SCALES, steps=steps, batch=4,
                           config=FieldTrainConfig(lr=1e-3, progress=False), files=files, val_files=val,
                           online=OnlineConfig.from_campaign(contract, ckpt_every=2, keep=3, val_every=3),
                           contract=contract,
                           on_step=on_step, torch_threads=1, population=pop)


def test_each_member_trains_its_own_simulations_once_across_a_stop_and_an_uneven_resume(comm, tmp_path_factory):
    run_dir, files, val = _run_dir(comm, tmp_path_factory, "run")
    seen_steps: list[dict] = []

    def stop_at_5(m):
        seen_steps.append({k: m[k] for k in ("step", "tournament") if k in m})
        if m["step"] == 5:
            stop.request("SIGUSR1")

    try:
        rc = _train(run_dir, files, val, steps=9, resume=False, on_step=stop_at_5)
    finally:
        stop.clear()
        for s in stop.STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL)
    from hpcml.env import NOT_FINISHED

    comm.Barrier()  # each member saves on its own ranks: look once all have
    assert rc == NOT_FINISHED
    assert [s["step"] for s in seen_steps] == [1, 2, 3, 4, 5]  # every member stepped together
    assert "tournament" in seen_steps[2] and "tournament" not in seen_steps[1]
    ck = [run_dir / "checkpoints" / f"member_{m}" for m in (0, 1)]
    assert all((c / "step_00000005").is_dir() and (c / "step_00000004").is_dir() for c in ck)
    assert (run_dir / "member_0" / "metrics.jsonl").is_file() and (run_dir / "member_1" / "metrics.jsonl").is_file()
    comm.Barrier()
    if comm.rank == 0:  # member 1's save at step 5 never happened: the population resumes at step 4
        shutil.rmtree(ck[1] / "step_00000005")
        (ck[1] / "latest").write_text("step_00000004\n")
    comm.Barrier()

    rc = _train(run_dir, files, val, steps=9, resume=True)
    comm.Barrier()
    assert rc == 0
    s = json.loads((run_dir / "train_summary.json").read_text())
    assert (s["status"], s["resumed_at"], s["gradient_steps"]) == ("ok", 4, 9)
    assert (s["samples_ingested"], s["samples_missing"], s["duplicate_samples"]) == (N_SIMS * N_OUT, 0, 0)
    assert s["val_best_member"] in (0.0, 1.0) and len(s["val_rel_l2_members"]) == 2
    assert s["val_rel_l2"] == min(s["val_rel_l2_members"])
    # what an adaptive campaign steers by during training: the best member's error, the same
    # figure as the summary's after the last step (the same models, the same held-out files)
    fb = json.loads((run_dir / "feedback.json").read_text())["metrics"]
    assert (fb["val_step"], fb["val_best_member"], fb["val_rel_l2"]) == (9.0, s["val_best_member"], s["val_rel_l2"])
    # each member's own simulations, every sample once across both
    keys = []
    for m, c in enumerate(ck):
        seen = np.concatenate([st["seen"] for st in load_source_states(c)])
        assert {int(k[0]) % 2 for k in seen.tolist()} == {m}, (m, sorted({int(k[0]) for k in seen.tolist()}))
        keys += [tuple(k) for k in seen.tolist()]
    assert len(keys) == len(set(keys)) == N_SIMS * N_OUT
    # each member kept the better model on its own held-out share; where both chose one (one kept
    # its own, the other its partner's) their last saves hold the same weights, bit for bit
    rounds = [[json.loads(x) for x in (run_dir / f"member_{m}" / "tournaments.jsonl").read_text().splitlines()]
              for m in (0, 1)]
    assert [r["step"] for r in rounds[0]] == [3, 6, 9] and [r["step"] for r in rounds[1]] == [3, 6, 9]
    assert all(r["kept"] == ("partner" if r["partner_score"] < r["own_score"] else "own") for rs in rounds for r in rs)
    if comm.rank == 0:
        a, b = ckpt.read_tensors(ck[0], "model/"), ckpt.read_tensors(ck[1], "model/")
        same = sorted(a) == sorted(b) and all(np.array_equal(a[n].numpy(), b[n].numpy()) for n in a)
        assert a and same == (sorted([rounds[0][-1]["kept"], rounds[1][-1]["kept"]]) == ["own", "partner"])

def test_a_population_is_checked_before_anything_runs(comm, tmp_path_factory):
    with pytest.raises(ConfigError, match=r"PopulationConfig\(members=0\): expected a whole number of members >= 1"):
        PopulationConfig(members=0)
    with pytest.raises(ConfigError, match="tournament and pbt both given"):
        from hpcml.train.pbt import PBTConfig

        PopulationConfig(members=2, tournament=TournamentConfig(every=2), pbt=PBTConfig(every=2))
    run_dir, files, _ = _run_dir(comm, tmp_path_factory, "run_noval")
    assert _train(run_dir, files, [], steps=4, resume=False) == CONFIG_ERROR  # every rank, nothing trained
    assert not (run_dir / "checkpoints").exists()


def test_pbt_rounds_run_in_a_population_of_surrogates(comm, tmp_path_factory):
    from hpcml.train.pbt import PBTConfig

    run_dir, files, val = _run_dir(comm, tmp_path_factory, "run_pbt")
    history = run_dir / "pbt.jsonl"
    explore = ("lr", "buffer_policy")  # the training buffer's policy too: switched on a copy
    rc = _train(run_dir, files, val, steps=6, resume=False,
                population=PopulationConfig(members=2, pbt=PBTConfig(every=3, history=str(history),
                                                                     hyperparameters=explore)))
    comm.Barrier()
    assert rc == 0
    rounds = [json.loads(x) for x in history.read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    before = {0: "reservoir", 1: "reservoir"}  # train_surrogate's default buffer
    for r in rounds:  # a copier switches to another policy than its source's; the others keep theirs
        now = {m["member"]: m["buffer_policy"] for m in r["members"]}
        for m in r["members"]:
            if m["copied"] is None:
                assert now[m["member"]] == before[m["member"]], r
            else:
                assert now[m["member"]] in {"fifo", "firo", "reservoir"} - {before[m["copied"]]}, r
        before = now
    s = json.loads((run_dir / "train_summary.json").read_text())
    assert (s["status"], s["samples_ingested"], s["gradient_steps"]) == ("ok", N_SIMS * N_OUT, 6)
