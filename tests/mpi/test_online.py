"""hpcml.train.online.train_online on every rank of the launch: a simulation hpcml has never
seen (an advected blob, written in the kernels' HDF5 layout), trained from files; stopped by
the walltime flag mid-run, saved, resumed by a fresh trainer and source, finished with every
sample taken exactly once; a source that gives nothing fails loudly."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcml import stop
from hpcml.errors import ConfigError
from hpcml.grid import ProcessGrid
from hpcml.models.surrogate import MLPSurrogate, MLPSurrogateConfig
from hpcml.stream import Buffer, BufferConfig
from hpcml.stream.files import FileSource
from hpcml.train.fields import FieldScales, FieldTrainConfig, FieldTrainer
from hpcml.train.online import OnlineConfig, load_source_states, train_online

N_SIMS, N_OUT, NX, NY = 12, 6, 8, 8


def _blob_files(comm, tmp_path_factory) -> list[Path]:
    """A user's own 2-D simulation: a Gaussian blob advected with speed v, width w."""
    root = Path(comm.bcast(str(tmp_path_factory.mktemp("blob")) if comm.rank == 0 else None))
    if comm.rank == 0:
        x, y = np.meshgrid(np.linspace(-1, 1, NX), np.linspace(-1, 1, NY), indexing="ij")
        for sim in range(N_SIMS):
            v, w = 0.2 + 0.05 * sim, 0.1 + 0.02 * sim
            t = np.linspace(0.0, 1.0, N_OUT)
            u = np.stack([np.exp(-((x - v * ti) ** 2 + y ** 2) / w) for ti in t]).astype(np.float32)
            with h5py.File(root / f"blob_{sim:03d}.h5", "w") as f:
                f["fields/u"], f["time"], f["step"] = u, t, np.arange(N_OUT) * 10
                f.attrs["sim_id"], f.attrs["params"] = sim, json.dumps({"v": v, "w": w})
    comm.Barrier()
    return sorted(root.glob("blob_*.h5"))


def _trainer_and_source(grid, files, steps):
    scales = FieldScales(param_lo=(0.2, 0.1), param_hi=(0.8, 0.4), t_max=1.0)
    model = MLPSurrogate(MLPSurrogateConfig(n_params=2, nx=NX, ny=NY, hidden=32, depth=2))
    trainer = FieldTrainer(model, grid, FieldTrainConfig(steps=steps, batch=4, lr=1e-3, progress=False), scales)
    buffer = Buffer(BufferConfig(policy="reservoir", capacity=64, watermark=4, seed=grid.rank))
    source = FileSource(files, rank=grid.rank, n_trainers=grid.layout.world_size, buffer=buffer, field_names=("u",),
                        param_names=("v", "w"))
    return trainer, source


def test_stopped_then_resumed_takes_every_sample_once(comm, tmp_path_factory):
    files = _blob_files(comm, tmp_path_factory)
    ckpt_dir = str(files[0].parent / "ckpt")
    grid = ProcessGrid(dp=-1)
    grid.init_torch()
    steps = 12
    trainer, source = _trainer_and_source(grid, files, steps)

    def warn_at_5(m):  # the walltime warning on every rank at step 5: all stop together after it
        if m["step"] == 5:
            stop.request("SIGUSR1")

    try:
        first = train_online(trainer, source, grid=grid, on_step=warn_at_5,
                             config=OnlineConfig(steps=steps, batch=4, ckpt_dir=ckpt_dir, ckpt_every=100))
    finally:
        stop.clear()
        for s in stop.STOP_SIGNALS:  # train_online ignores late warnings once decided; this process goes on
            signal.signal(s, signal.SIG_DFL)
    assert (first.status, first.steps, first.resumed_at) == ("stopped", 5, None)
    assert (Path(ckpt_dir) / "step_00000005").is_dir()  # saved on the stop, not at ckpt_every

    trainer, source = _trainer_and_source(grid, files, steps)  # a new job: fresh objects, resume
    second = train_online(trainer, source, grid=grid,
                          config=OnlineConfig(steps=steps, batch=4, ckpt_dir=ckpt_dir, ckpt_every=100, resume=True))
    assert (second.status, second.steps, second.resumed_at, second.problems) == ("ok", steps, 5, [])
    seen = np.concatenate([st["seen"] for st in load_source_states(ckpt_dir)])
    keys = {tuple(k) for k in seen.tolist()}
    assert len(seen) == len(keys) == N_SIMS * N_OUT  # every sample of every file, once, across the restart
    if comm.rank == 0:
        s = second.summary
        assert s["samples_ingested"] == N_SIMS * N_OUT and s["gradient_steps"] == steps
        assert s["samples_trained"] == steps * 4 * comm.size
        assert np.isfinite(s["final_loss"]) and s["final_loss"] < 1.0
    else:
        assert second.summary == {}


def test_a_source_that_gives_nothing_fails_with_the_reason(comm, tmp_path_factory):
    grid = ProcessGrid(dp=-1)
    grid.init_torch()
    trainer, source = _trainer_and_source(grid, [], 10)
    result = train_online(trainer, source, grid=grid, config=OnlineConfig(steps=10, batch=4))
    assert (result.status, result.steps) == ("failed", 0)
    assert "the trainer took 0 gradient steps" in result.problems
    if comm.rank == 0:
        assert f"trainer rank(s) {list(range(comm.size))} received no sample" in result.problems


@pytest.mark.parametrize("kw, message", [
    ({"steps": 0, "batch": 4}, "OnlineConfig.steps=0: expected an integer >= 1"),
    ({"steps": 5, "batch": 4, "ckpt_every": -1}, "OnlineConfig.ckpt_every=-1: expected an integer >= 0"),
    ({"steps": 5, "batch": 4, "resume": True}, "OnlineConfig.resume=True needs ckpt_dir"),
])
def test_bad_config_is_one_line_on_every_rank(kw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        OnlineConfig(**kw)


def test_checkpoint_of_another_campaign_is_never_resumed(comm, tmp_path_factory):
    files = _blob_files(comm, tmp_path_factory)
    ckpt_dir = str(files[0].parent / "ckpt_campaign")
    grid = ProcessGrid(dp=-1)
    grid.init_torch()
    trainer, source = _trainer_and_source(grid, files, 3)
    first = train_online(trainer, source, grid=grid,
                         config=OnlineConfig(steps=3, batch=4, ckpt_dir=ckpt_dir, campaign="blob-1"))
    assert (first.status, first.steps) == ("ok", 3)
    trainer, source = _trainer_and_source(grid, files, 6)
    with pytest.raises(ConfigError, match=r"belongs to campaign 'blob-1', not 'blob-2': resume that campaign, or "
                                          r"use a new run directory"):
        train_online(trainer, source, grid=grid, config=OnlineConfig(steps=6, batch=4, ckpt_dir=ckpt_dir,
                                                                     resume=True, campaign="blob-2"))
    assert trainer.step == 0  # refused before anything was loaded
    again = train_online(trainer, source, grid=grid, config=OnlineConfig(steps=6, batch=4, ckpt_dir=ckpt_dir,
                                                                         resume=True, campaign="blob-1"))
    assert (again.status, again.resumed_at, again.steps) == ("ok", 3, 6)


def test_more_steps_on_resume_stretch_the_schedule_without_a_jump(comm, tmp_path_factory):
    from hpcml.train.checkpointing import load_trainer, save_trainer

    files = _blob_files(comm, tmp_path_factory)
    ckpt_dir = files[0].parent / "ckpt_steps"
    grid = ProcessGrid(dp=-1)
    grid.init_torch()
    trainer, source = _trainer_and_source(grid, files, 20)
    source.start()
    batch = source.buffer.get(4, timeout=10.0)
    lrs = [trainer.train_step(batch)["lr"] for _ in range(15)]  # warmup 10 steps, then cosine towards step 20
    save_trainer(trainer, ckpt_dir)
    source.stop()
    longer, _ = _trainer_and_source(grid, files, 40)
    load_trainer(longer, ckpt_dir)
    after = [longer.train_step(batch)["lr"] for _ in range(25)]
    cfg = longer.config
    # the next step's rate is exactly the one the 20-step run would have used: no jump ...
    assert after[0] == pytest.approx(trainer.optimizer.param_groups[0]["lr"], rel=1e-12)
    assert after[0] < lrs[-1]
    assert all(a > b for a, b in zip(after, after[1:]))  # ... then decreasing
    assert after[-1] == pytest.approx(cfg.lr * (cfg.min_lr_ratio + (after[0] / cfg.lr - cfg.min_lr_ratio)
                                                * 0.5 * (1 + np.cos(np.pi * 24 / 25))), rel=1e-9)


def test_field_trainer_fsdp_matches_replicated_and_plain_modules_refuse_other_axes(comm, tmp_path_factory):
    import torch

    from hpcml.parallel import ParallelConfig

    files = _blob_files(comm, tmp_path_factory)
    grid = ProcessGrid(dp=-1)
    grid.init_torch()
    scales = FieldScales(param_lo=(0.2, 0.1), param_hi=(0.8, 0.4), t_max=1.0)
    buffer = Buffer(BufferConfig(policy="fifo", capacity=256, watermark=1, seed=0))
    source = FileSource(files, rank=grid.rank, n_trainers=comm.size, buffer=buffer, field_names=("u",),
                        param_names=("v", "w"))
    source.start()
    batch = buffer.get(4, timeout=10.0)
    source.stop()
    losses = {}
    for fsdp in (False, True):
        torch.manual_seed(100 + comm.rank)  # different weights per rank: the trainer starts them equal
        model = MLPSurrogate(MLPSurrogateConfig(n_params=2, nx=NX, ny=NY, hidden=32, depth=2))
        trainer = FieldTrainer(model, grid, FieldTrainConfig(steps=4, batch=4, warmup_steps=0, progress=False),
                               scales, parallel=ParallelConfig(fsdp=fsdp))
        losses[fsdp] = [trainer.train_step(batch)["loss"] for _ in range(4)]
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
    assert losses[False][-1] < losses[False][0]
    tp_grid = ProcessGrid(tp=2, dp=-1)
    with pytest.raises(ConfigError, match=r"MLPSurrogate has no parallel plan for \{'tp': 2\}: it runs data-parallel"):
        FieldTrainer(MLPSurrogate(MLPSurrogateConfig(n_params=2, nx=NX, ny=NY)), tp_grid,
                     FieldTrainConfig(progress=False), scales)


def test_dropped_messages_fail_the_run_except_a_superseded_attempt(comm, tmp_path_factory):
    """A source of one's own that dropped messages: the run trained, but data never reached
    it, so it fails with the count and reasons; a stale attempt alone does not fail it."""
    files = _blob_files(comm, tmp_path_factory)
    grid = ProcessGrid(dp=-1)
    grid.init_torch()

    class Dropping(FileSource):
        drops: dict = {}

        def stats(self) -> dict:
            return {**super().stats(), "dropped": dict(self.drops)}

    for drops, problem in (({"bad_header": 2, "stale_attempt": 1}, "2 message(s) were dropped (2 bad_header): see "
                                                                      "the trainer's log"),
                           ({"stale_attempt": 3}, None)):
        trainer, plain = _trainer_and_source(grid, files, 3)
        source = Dropping(files, rank=grid.rank, n_trainers=comm.size, buffer=plain.buffer, field_names=("u",),
                          param_names=("v", "w"))
        source.drops = drops if comm.rank == 0 else {}
        result = train_online(trainer, source, grid=grid, config=OnlineConfig(steps=3, batch=4))
        assert result.steps == 3
        if comm.rank == 0:
            assert result.summary["dropped_messages"] == drops
            assert (result.status, result.problems) == (("failed", [problem]) if problem else ("ok", []))


def test_the_agreement_waits_for_late_ranks_without_spinning_a_core(comm):
    """A trainer rank whose batch is ready waits in the agreement for the others; MPICH's
    blocking all-reduce would spin a core there that the simulations feeding it need."""
    import time

    from hpcml.stream.loader import agree_min

    late = 0.4
    flags = np.array([comm.rank + 5, 1 - (comm.rank == comm.size - 1)], np.int32)
    comm.Barrier()
    if comm.rank == 0:
        time.sleep(late)  # the late rank
    wall, cpu = time.perf_counter(), time.process_time()
    agree_min(comm, flags)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert flags.tolist() == [5, 0]
    if comm.rank != 0:  # waited about `late` seconds, nearly all of them asleep
        assert wall > 0.5 * late and cpu < 0.3 * wall, (wall, cpu)
