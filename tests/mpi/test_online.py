"""hpcml.train.online.train_online on every rank of the launch: a simulation hpcml has never
seen (an advected blob, written in the kernels' HDF5 layout), trained from files; stopped by
the walltime flag mid-run, saved, resumed by a fresh trainer and source, finished with every
sample taken exactly once; a source that gives nothing fails loudly."""

from __future__ import annotations

import json
import signal
import warnings
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


def _trainer_and_source(grid, files, steps, *, batch=4, policy="reservoir"):
    scales = FieldScales(param_lo=(0.2, 0.1), param_hi=(0.8, 0.4), t_max=1.0)
    model = MLPSurrogate(MLPSurrogateConfig(n_params=2, nx=NX, ny=NY, hidden=32, depth=2))
    trainer = FieldTrainer(model, grid, FieldTrainConfig(steps=steps, batch=batch, lr=1e-3, progress=False), scales)
    buffer = Buffer(BufferConfig(policy=policy, capacity=64, watermark=min(4, batch), seed=grid.rank))
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
                             config=OnlineConfig(ckpt_dir=ckpt_dir, ckpt_every=100))
    finally:
        stop.clear()
        for s in stop.STOP_SIGNALS:  # train_online ignores late warnings once decided; this process goes on
            signal.signal(s, signal.SIG_DFL)
    assert (first.status, first.steps, first.resumed_at) == ("stopped", 5, None)
    assert (Path(ckpt_dir) / "step_00000005").is_dir()  # saved on the stop, not at ckpt_every

    trainer, source = _trainer_and_source(grid, files, steps)  # a new job: fresh objects, resume
    second = train_online(trainer, source, grid=grid,
                          config=OnlineConfig(ckpt_dir=ckpt_dir, ckpt_every=100, resume=True))
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
    result = train_online(trainer, source, grid=grid, config=OnlineConfig())
    assert (result.status, result.steps) == ("failed", 0)
    assert result.problems == ["the trainer took 0 gradient steps"] + [
        f"trainer rank {r} received no sample" for r in range(comm.size)]  # the same outcome on every rank


def test_fewer_samples_than_a_batch_fails_naming_the_batch_and_a_relaunch_would_repeat_it(comm, tmp_path_factory):
    """A newcomer's batch of 8 against the 6 samples one simulation gives: before, "the trainer
    took 0 gradient steps", exit 1 -- so the campaign relaunched it, to fail alike."""
    files = _blob_files(comm, tmp_path_factory)[:1]  # simulation 0: 6 samples, all on the rank it routes to
    grid = ProcessGrid(dp=-1)
    grid.init_torch()
    trainer, source = _trainer_and_source(grid, files, 10, batch=8, policy="fifo")
    result = train_online(trainer, source, grid=grid, config=OnlineConfig())
    assert (result.status, result.steps, result.repeat) == ("failed", 0, True)
    assert result.problems[0].startswith(f"the trainer took 0 gradient steps: trainer rank 0 received {N_OUT} "
                                         f"sample(s) before its stream ended, fewer than the batch of 8 a rank takes "
                                         f"a step -- lower the batch (TrainingJob(batch=) or the trainer's config) to "
                                         f"at most {N_OUT}")


def test_a_stream_that_ends_before_the_steps_asked_for_says_so(comm, tmp_path_factory):
    """FIFO uses each sample once: 72 samples, a batch of 4 a rank, 100 steps asked for. Before,
    exit 0 after the steps the samples made, nothing said (the schedule never decayed)."""
    files = _blob_files(comm, tmp_path_factory)
    grid = ProcessGrid(dp=-1)
    grid.init_torch()
    trainer, source = _trainer_and_source(grid, files, 100, policy="fifo")
    result = train_online(trainer, source, grid=grid, config=OnlineConfig())
    assert result.status == "ok" and 0 < result.steps <= N_SIMS * N_OUT // (4 * comm.size) and not result.repeat
    assert [n for n in result.notes if n.startswith(f"training ended at step {result.steps} of the 100 asked for: the "
                                                    f"stream ended and the fifo buffer had no batch more "
                                                    f"({N_SIMS * N_OUT} samples, 4 a rank a step on {comm.size} "
                                                    f"rank(s), each used once)")]


@pytest.mark.parametrize("kw, message", [
    ({"keep": 0}, "OnlineConfig.keep=0: expected an integer >= 1"),
    ({"ckpt_every": -1}, "OnlineConfig.ckpt_every=-1: expected an integer >= 0"),
    ({"resume": True}, "OnlineConfig.resume=True needs ckpt_dir"),
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
                         config=OnlineConfig(ckpt_dir=ckpt_dir, campaign="blob-1"))
    assert (first.status, first.steps) == ("ok", 3)
    trainer, source = _trainer_and_source(grid, files, 6)
    with pytest.raises(ConfigError, match=r"belongs to campaign 'blob-1', not 'blob-2': resume that campaign, or "
                                          r"use a new run directory"):
        train_online(trainer, source, grid=grid, config=OnlineConfig(ckpt_dir=ckpt_dir,
                                                    resume=True, campaign="blob-2"))
    assert trainer.step == 0  # refused before anything was loaded
    again = train_online(trainer, source, grid=grid, config=OnlineConfig(ckpt_dir=ckpt_dir,
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
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses[fsdp] = [trainer.train_step(batch)["loss"] for _ in range(4)]
        # FSDP2 warns when the root returns a view: an in-place op on it would skip the gather
        assert not [w for w in caught if "view tensor" in str(w.message)], fsdp
        with torch.no_grad():  # a copy under FSDP only: a view elsewhere
            assert (trainer.model.parts[0](torch.zeros(2, 2), torch.zeros(2))._base is None) == fsdp
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
        result = train_online(trainer, source, grid=grid, config=OnlineConfig())
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


def _wave_files(comm, tmp_path_factory, n=96, sims=None) -> list[Path]:
    """A user's own 1-D simulation: a travelling wave sin(2 pi (x - c t)) of speed c, amplitude a."""
    sims = sims if sims is not None else range(2 * comm.size)
    root = Path(comm.bcast(str(tmp_path_factory.mktemp("wave")) if comm.rank == 0 else None))
    if comm.rank == 0:
        x = np.linspace(0, 1, n, endpoint=False)
        for sim in sims:
            c, a = 0.5 + 0.1 * sim, 1.0 - 0.05 * sim
            t = np.linspace(0.0, 1.0, N_OUT)
            u = np.stack([a * np.sin(2 * np.pi * (x - c * ti)) for ti in t]).astype(np.float32)
            with h5py.File(root / f"wave_{sim:03d}.h5", "w") as f:
                f["fields/u"], f["time"], f["step"] = u, t, np.arange(N_OUT)
                f.attrs["sim_id"], f.attrs["params"] = sim, json.dumps({"c": c, "a": a})
    comm.Barrier()
    return sorted(root.glob("wave_*.h5"))


def _wave_run(grid, files, model, steps=6, **online):
    scales = FieldScales(param_lo=(0.4, 0.0), param_hi=(2.0, 1.0), t_max=1.0)
    trainer = FieldTrainer(model, grid, FieldTrainConfig(steps=steps, batch=2, progress=False), scales)
    source = FileSource(files, rank=grid.rank, n_trainers=grid.layout.world_size, field_names=("u",),
                        param_names=("c", "a"), buffer=Buffer(BufferConfig(policy="fifo", capacity=64, watermark=2)))
    return train_online(trainer, source, grid=grid, config=OnlineConfig(**online))


def test_a_1d_field_trains_with_the_shipped_mlp_and_async_checkpoints(comm, tmp_path_factory):
    files = _wave_files(comm, tmp_path_factory)
    grid = ProcessGrid(dp=-1)
    grid.init_torch()
    ckpt_dir = str(files[0].parent / "ckpt")
    result = _wave_run(grid, files, MLPSurrogate(MLPSurrogateConfig(n_params=2, shape=(96,), hidden=32, depth=2)),
                       steps=5, ckpt_dir=ckpt_dir, ckpt_every=2, async_save=True, keep=10)
    assert (result.status, result.steps, result.problems) == ("ok", 5, [])
    steps = sorted(p.name for p in Path(ckpt_dir).glob("step_*"))
    assert steps == ["step_00000002", "step_00000004", "step_00000005"]  # async periodic saves, then the end
    if comm.rank == 0:
        s = result.summary
        assert (s["samples_expected"], s["samples_ingested"], s["samples_missing"]) == (len(files) * N_OUT,) * 2 + (0,)
    seen = np.concatenate([st["seen"] for st in load_source_states(ckpt_dir)])
    assert len({tuple(k) for k in seen.tolist()}) == len(seen) == len(files) * N_OUT


def test_a_model_of_the_wrong_shape_fails_on_every_rank_before_the_first_step(comm, tmp_path_factory):
    files = _wave_files(comm, tmp_path_factory)
    grid = ProcessGrid(dp=-1)
    grid.init_torch()
    wrong = MLPSurrogate(MLPSurrogateConfig(n_params=2, shape=(96, 1), hidden=8, depth=1))  # ny=1: not a 1-D field
    with pytest.raises(ConfigError, match=r"the model's output per sample is \[96, 1\], but simulation \d+'s field "
                                          r"is \[96\]: the model must output the simulation's grid"):
        _wave_run(grid, files, wrong)
    more = MLPSurrogate(MLPSurrogateConfig(n_params=3, shape=(96,), hidden=8, depth=1))  # 3 params, samples carry 2
    with pytest.raises(ConfigError, match=r"the model cannot take simulation \d+'s sample "
                                          r"\(ValueError: params must have "
                                          r"shape \[B=1, n_params=3\], got \[1, 2\]\)"):
        _wave_run(grid, files, more)


def test_simulations_of_two_grids_are_refused_naming_both(comm, tmp_path_factory):
    """Each rank's files are of one grid, but the ranks' grids differ: refused before a step."""
    if comm.size < 2:
        pytest.skip("needs two trainer ranks")
    coarse = _wave_files(comm, tmp_path_factory, n=64, sims=range(0, 2 * comm.size, 2))  # rank 0's
    fine = _wave_files(comm, tmp_path_factory, n=96, sims=range(1, 2 * comm.size, 2))    # rank 1's
    grid = ProcessGrid(dp=-1)
    grid.init_torch()
    from torch import nn

    class Any1D(nn.Module):  # a model that takes any grid: only the data check can see the mix
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(1))

        def forward(self, p, t):
            return self.w * torch.ones(p.shape[0], int(os.environ["HPCML_TEST_N"]))

    import os

    import torch
    os.environ["HPCML_TEST_N"] = str(64 if comm.rank % 2 == 0 else 96)
    with pytest.raises(ConfigError, match=r"simulation \d+'s samples are \[1, (64|96)\] \(fields x grid\), simulation "
                                          r"\d+'s \[1, (96|64)\]: every sample of a training must share one grid"):
        _wave_run(grid, coarse + fine, Any1D())
    # within one rank, a file of another grid is refused by the schema, naming both simulations
    from hpcml.stream.files import read_samples
    from hpcml.stream.schema import SampleSchema

    schema = SampleSchema(("u",), ("c", "a"))
    read_samples(coarse[0], ("u",), ("c", "a"), schema)
    with pytest.raises(ConfigError, match=r"wrong_shape: simulation 1's grid is 96 \(1-D\), simulation 0's 64 \(1-D\)"):
        read_samples(fine[0], ("u",), ("c", "a"), schema)


def test_resuming_past_the_step_budget_is_refused(comm, tmp_path_factory):
    files = _wave_files(comm, tmp_path_factory)
    grid = ProcessGrid(dp=-1)
    grid.init_torch()
    ckpt_dir = str(files[0].parent / "ckpt_past")
    model = lambda: MLPSurrogate(MLPSurrogateConfig(n_params=2, shape=(96,), hidden=8, depth=1))  # noqa: E731
    first = _wave_run(grid, files, model(), steps=5, ckpt_dir=ckpt_dir)
    n = comm.size  # 12 samples a rank, 10 used in 5 steps of 2: the others are said, not a failure
    assert (first.status, first.notes) == ("ok", [f"{2 * n} of {12 * n} ingested samples were never in a batch (the "
                                                  f"step budget, 5 steps, ended before they were used): they are in "
                                                  f"the checkpoint; raise the steps and resume to train on them"])
    with pytest.raises(ConfigError, match=r"resumed at step 5 from .*step_00000005, past steps=3: nothing would be "
                                          r"trained; give steps >= 5"):
        _wave_run(grid, files, model(), steps=3, ckpt_dir=ckpt_dir, resume=True)
    again = _wave_run(grid, files, model(), steps=5, ckpt_dir=ckpt_dir, resume=True)  # the budget spent: drains
    assert (again.status, again.resumed_at, again.steps) == ("ok", 5, 5)


def test_samples_a_source_lacks_fail_the_run_naming_them(comm, tmp_path_factory):
    """A source whose simulations sent more than it holds (a trainer that died after its last
    save): the run is not ok, every rank knows, and the problem names the simulations."""
    files = _wave_files(comm, tmp_path_factory)
    grid = ProcessGrid(dp=-1)
    grid.init_torch()

    class Lossy(FileSource):
        def accounting(self) -> dict:
            acc = super().accounting()
            return {**acc, "expected": {s: n + 2 * (s == 0) for s, n in acc["expected"].items()}}

    trainer = FieldTrainer(MLPSurrogate(MLPSurrogateConfig(n_params=2, shape=(96,), hidden=8, depth=1)), grid,
                           FieldTrainConfig(steps=3, batch=2, progress=False),
                           FieldScales(param_lo=(0.4, 0.0), param_hi=(2.0, 1.0), t_max=1.0))
    source = Lossy(files, rank=grid.rank, n_trainers=comm.size, field_names=("u",), param_names=("c", "a"),
                   buffer=Buffer(BufferConfig(policy="fifo", capacity=64, watermark=2)))
    result = train_online(trainer, source, grid=grid, config=OnlineConfig())
    assert (result.status, result.missing, result.incomplete) == ("failed", 2, True)
    assert result.problems == [f"2 of {len(files) * N_OUT + 2} samples of completed simulations never reached "
                               f"training (simulation 0: 2 of {N_OUT + 2} missing): a trainer that died lost what it "
                               f"received after its last checkpoint; resume the campaign to run those simulations "
                               f"again"]


def test_feedback_reports_every_simulation_and_survives_a_resume(comm, tmp_path_factory):
    """Issue 25: the trainer publishes, per simulation, the loss of its samples, how many were
    trained on and their parameters; the table is in every checkpoint, so a resumed run's
    counts go on from the saved ones and end at every sample trained on, once."""
    from hpcml.ensemble.waves import read_feedback

    files = _blob_files(comm, tmp_path_factory)
    root = files[0].parent
    ckpt_dir, fb = str(root / "ckpt_fb"), root / "feedback.json"
    grid = ProcessGrid(dp=-1)
    grid.init_torch()
    steps, world = 12, grid.layout.world_size

    def warn_at_6(m):
        if m["step"] == 6:
            stop.request("SIGUSR1")

    trainer, source = _trainer_and_source(grid, files, steps)
    cfg = OnlineConfig(ckpt_dir=ckpt_dir, ckpt_every=100, feedback_file=str(fb), feedback_every=3, campaign="c1")
    try:
        first = train_online(trainer, source, grid=grid, on_step=warn_at_6, config=cfg)
    finally:
        stop.clear()
        for s in stop.STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL)
    assert first.status == "stopped"
    step, sims = read_feedback(fb, campaign="c1")
    assert step == 6 and sum(s.samples for s in sims.values()) == 6 * 4 * world
    trainer, source = _trainer_and_source(grid, files, steps)
    second = train_online(trainer, source, grid=grid, config=OnlineConfig(**{**cfg.__dict__, "resume": True}))
    assert second.status == "ok", second.problems
    step, sims = read_feedback(fb, campaign="c1")
    assert step == steps and sum(s.samples for s in sims.values()) == steps * 4 * world
    assert set(sims) <= {str(i) for i in range(N_SIMS)} and len(sims) >= N_SIMS // 2
    for sim, st in sims.items():  # the parameters are the simulation's own, under the stream's names
        i = int(sim)
        assert st.params == pytest.approx({"v": 0.2 + 0.05 * i, "w": 0.1 + 0.02 * i})
        assert st.age >= 0
    evaluated = [st for st in sims.values() if st.loss == st.loss]
    assert evaluated and all(0 < st.loss < 10 for st in evaluated)
    # every simulation was scored once, before a step trained on it (the loader's agreement put
    # every rank through that forward together: no hang), and kept across the resume
    assert all(st.fresh is not None and 0 < st.fresh < 10 and st.surprise > 0 for st in sims.values()), sims
    with pytest.raises(ConfigError, match=r"written for campaign 'c1', this is 'c2'$"):
        read_feedback(fb, campaign="c2")


def test_periodic_validation_is_published_for_the_campaigns_target(comm, tmp_path_factory):
    """Issue 25: with ``val_every`` the held-out error of the files there are (rank 0 lists
    and reads them, every rank predicts) goes into feedback.json's metrics with the latest
    loss; the value is the trainer's own rel_l2 on those files."""
    from hpcml.ensemble.waves import read_feedback_record
    from hpcml.stream.files import read_samples
    from hpcml.train.online import OnlineRun
    from hpcml.train.surrogate_job import _validator

    files = _blob_files(comm, tmp_path_factory)
    root = files[0].parent
    held_out, train_files = files[:2], files[2:]
    grid = ProcessGrid(dp=-1)
    grid.init_torch()
    trainer, source = _trainer_and_source(grid, train_files, 6)
    validate = _validator(trainer, comm, lambda: held_out + [root / "not_yet.h5"], ("v", "w"), ("u",))
    cfg = OnlineConfig(feedback_file=str(root / "fb_val.json"), feedback_every=2, val_every=4, campaign="c")
    result = OnlineRun(trainer, source, grid=grid, config=cfg, validate=validate).run()
    assert result.status == "ok", result.problems
    rec = read_feedback_record(root / "fb_val.json", campaign="c")
    assert rec.step == 6 and rec.metrics["val_step"] == 4.0 and rec.metrics["val_samples"] == 2 * N_OUT
    vals = [s for f in held_out for s in read_samples(f, ("u",), ("v", "w"))]
    assert 0 < rec.metrics["val_rel_l2"] < 10 and rec.metrics["loss"] == pytest.approx(trainer.history[-1]["loss"])
    now = trainer.rel_l2(np.stack([s.params for s in vals]), np.array([s.t for s in vals]),
                         np.stack([s.fields[0] for s in vals]))
    assert validate()["val_rel_l2"] == pytest.approx(now)  # the same figure the final report computes


def test_a_source_of_ones_own_needs_only_its_buffer_and_one_stop_agreement_a_step(comm, tmp_path_factory):
    """Issue 44: a sample source is a ``SampleSource`` subclass, every member the loop uses has
    a default (this one fills its buffer and nothing else); anything else is refused in one
    line. The loop is ``TrainLoop.fit``: a stop asked by the trainer on rank 0 alone is agreed
    by the loader before the next step, so every rank stops after the same step and no step's
    own collective carries it (each step's ``stop`` is False)."""
    from hpcml.stream import Sample
    from hpcml.stream.source import SampleSource

    class Mine(SampleSource):
        def __init__(self, buffer, rank):
            self.buffer, self.rank = buffer, rank

        def start(self):
            rng = np.random.default_rng(self.rank)
            for i in range(40):
                self.buffer.put(Sample(sim=self.rank, step=i, t=i / 40, params=np.array([0.5, 0.2], np.float32),
                                       fields=rng.random((1, NX, NY), dtype=np.float32)))
            return self

    grid = ProcessGrid(dp=-1)
    grid.init_torch()
    trainer, _ = _trainer_and_source(grid, [], 10)
    with pytest.raises(ConfigError, match="source object is not a hpcml.stream.source.SampleSource with a buffer: "
                                          "subclass SampleSource"):
        train_online(trainer, object(), grid=grid, config=OnlineConfig())
    ckpt_dir = str(_blob_files(comm, tmp_path_factory)[0].parent / "ckpt_own")

    def ask_on_rank_0(m):
        if m["step"] == 3 and comm.rank == 0:
            trainer.stop_requested = True

    source = Mine(Buffer(BufferConfig(policy="fifo", capacity=64, watermark=4)), grid.rank)
    result = train_online(trainer, source, grid=grid, on_step=ask_on_rank_0,
                          config=OnlineConfig(ckpt_dir=ckpt_dir, ckpt_every=100))
    assert (result.status, result.steps) == ("stopped", 3)
    assert [m["stop"] for m in trainer.history] == [False] * 3
    assert (Path(ckpt_dir) / "step_00000003").is_dir()
    states = load_source_states(ckpt_dir)  # the default state: the buffer's samples, every rank's
    assert sum(len(st["buffer/keys"]) for st in states) == comm.size * (40 - 3 * 4)
