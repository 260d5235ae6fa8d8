"""A campaign's training job in one call: a trainer script is its model, its loss and this.

    from hpcml import stop; stop.install()          # first: a walltime warning is a stop request
    import sys
    from hpcml.train import FieldScales, train_surrogate
    model = MyModel(...)                            # (params [B, P], t [B]) -> field [B, *grid]
    sys.exit(train_surrogate(model, params=("kappa", "u_top"), fields=("u",),
                             scales=FieldScales(param_lo=(0.5, 0), param_hi=(1.5, 1), t_max=0.3)))

It reads the campaign's contract (:mod:`hpcml.contract`: run directory, campaign, resume,
stream, done record, steps and batch), builds the grid (every rank data-parallel), the
:class:`~hpcml.train.fields.FieldTrainer`, the buffer and the source -- the stream server
bound where the contract says, or ``files`` offline -- and runs
:func:`~hpcml.train.online.train_online` with checkpoints in ``run_dir/checkpoints``. The
model's output is checked against the samples before the first step. Rank 0 writes
``run_dir/train_summary.json`` (with the held-out error of ``val_files``, and
``report.png`` with ``report``). The return value is the exit status every rank should exit
with: 0 done; :data:`~hpcml.env.NOT_FINISHED` (75) saved on a stop, resume it;
:data:`~hpcml.contract.INCOMPLETE` (65) trained, but samples of completed simulations never
arrived (named on stderr); :data:`~hpcml.contract.CONFIG_ERROR` (78) a mistake a relaunch
would repeat (e.g. a model whose output is not the simulation's grid, or training that
diverged: :class:`~hpcml.errors.DivergenceError`); 1 anything else.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpcml import log, stop, waiting
from hpcml.contract import CONFIG_ERROR, INCOMPLETE, Contract
from hpcml.env import NOT_FINISHED
from hpcml.errors import ConfigError, DivergenceError, PopulationDivergedError
from hpcml.stream.buffer import BufferConfig

logger = log.get_logger(__name__)


def _error(e: Exception) -> None:
    """One line for an error raised alike on every rank: rank 0's (lines of several ranks at
    once came out interleaved, and the campaign quotes the last line of train.err)."""
    from hpcml import env

    if env.detect().rank == 0:
        print(f"train_surrogate: error: {e}", file=sys.stderr, flush=True)


def _one(name: str, campaign: int | None, here: int | None) -> int | None:
    if campaign is not None and here is not None and campaign != here:
        raise ConfigError(f"{name}={here} here, but the campaign's TrainingJob({name}={campaign}): set it in one place")
    return campaign if campaign is not None else here


def train_surrogate(model, *, params: Sequence[str], fields: Sequence[str], scales, steps: int | None = None,
                    batch: int | None = None, config=None, buffer: BufferConfig | None = None, online=None,
                    parallel=None, loss_fn: Callable | None = None, files: Sequence[str | Path] | None = None,
                    val_files: Sequence[str | Path] | Callable[[], Sequence[str | Path]] = (), report: bool = False,
                    server: Mapping[str, Any] | None = None, on_step: Callable[[dict], None] | None = None,
                    contract: Contract | None = None, torch_threads: int | None = None,
                    shape: Sequence[int] | None = None, population=None) -> int:
    """Train ``model`` on the campaign's samples (see the module docstring); the exit status.

    ``params``/``fields``: the names a sample carries, in the model's order. ``steps`` and
    ``batch`` come from the campaign (``TrainingJob(steps=, batch=)``) or from here -- not
    both. ``val_files``: held-out simulations' files (or a callable giving them, called
    after training: they may be written while it runs). ``config``: the other
    :class:`~hpcml.train.fields.FieldTrainConfig` options (lr, warmup, ...); ``buffer``,
    ``online``, ``parallel``: their configs; ``server``: more
    :class:`~hpcml.stream.server.ServerConfig` options (``end_grace_s``, ``hwm``...).
    ``shape``: the simulation's grid (as ``ServerConfig.shape``). It bounds what one producer
    connection may make a trainer hold to a few samples; without it the bound is ``hwm``
    samples of ``max_sample_bytes`` (8 GiB, and the server says so), and the first sample
    fixes the grid. Without ``online``, it checkpoints every ``steps // 20`` steps (at least 1):
    a relaunched trainer loses at most a twentieth of its steps. ``population``: a
    :class:`~hpcml.train.population_online.PopulationConfig`, K members in this job, each
    training on its own simulations, selected by tournaments or PBT (docs/populations.md).
    """
    stop.install()  # idempotent: the script should have done it first
    try:
        c = contract or Contract.from_env()
        steps, batch = _one("steps", c.steps, steps), _one("batch", c.batch, batch)
    except ConfigError as e:
        _error(e)
        return CONFIG_ERROR
    try:
        result, run, grid = _run(model, c, params=params, fields=fields, scales=scales, steps=steps, batch=batch,
                                 config=config, buffer=buffer, online=online, parallel=parallel, loss_fn=loss_fn,
                                 files=files, server=_with_shape(server, shape), on_step=on_step,
                                 torch_threads=torch_threads, val_files=val_files, population=population)
    except (ConfigError, DivergenceError) as e:  # a mistake raised alike on every rank (agreed) before anything was
        # trained, or a divergence at the same step on every rank of the trainer: a relaunch would repeat either
        if isinstance(e, DivergenceError) and population is not None and not isinstance(e, PopulationDivergedError):
            raise  # one member's ranks only (no selection to replace it): the abort handler ends the job
        _error(e)
        _close_stream(c, str(e))
        return CONFIG_ERROR
    finally:
        stop.finished()
    if result.status == "stopped":
        if run.comm.Get_rank() == 0:
            print(f"[train] stopped at step {result.steps} after saving", flush=True)
        return NOT_FINISHED
    _report(run, result, val_files, params, fields, report, grid)  # every rank: prediction may be collective
    if result.status == "ok":
        return 0
    if run.comm.Get_rank() == 0:
        print("train_surrogate: failed: " + "; ".join(result.problems), file=sys.stderr, flush=True)
    if result.incomplete:
        return INCOMPLETE
    if result.repeat and not result.missing:  # 78: neither the campaign nor a workflow's retry relaunches it
        _close_stream(c, "; ".join(result.problems))
        return CONFIG_ERROR
    return 1


def _with_shape(server: Mapping[str, Any] | None, shape: Sequence[int] | None) -> dict:
    """The server options with the samples' grid (``shape=``; one the options name wins)."""
    out = dict(server or {})
    if shape is not None and out.get("shape") is None:
        try:
            out["shape"] = tuple(int(n) for n in shape)
        except (TypeError, ValueError):
            raise ConfigError(f"train_surrogate(shape={shape!r}): expected the grid as integers") from None
    return out


def _close_stream(c: Contract, why: str) -> None:
    """Rank 0 of a trainer that fails on a mistake a relaunch would repeat: a retry of the job
    launches nothing (:func:`hpcml.outcome.write_trainer_final`), and, before it listened, the
    simulations that wait for its addresses are told (unless this run published them: they then know)."""
    from hpcml import env, safeio
    from hpcml.contract import MAX_RECORD_BYTES, write_endpoints
    from hpcml.outcome import write_trainer_final

    if env.detect().rank != 0:
        return
    try:
        write_trainer_final(c.run_dir, c.run, why)
    except OSError:
        pass
    if not c.endpoints_file:
        return
    try:
        rec = safeio.read_json(c.endpoints_file, MAX_RECORD_BYTES)
        if rec is None or c.stale(rec) is not None:
            write_endpoints(c.endpoints_file, c.campaign, [], c.run, closed=why)
    except (ConfigError, OSError):
        pass


def _run(model, c: Contract, *, params, fields, scales, steps, batch, config, buffer, online, parallel, loss_fn,
         files, server, on_step, torch_threads, val_files=(), population=None):
    import torch

    from hpcml.grid import ProcessGrid, install_abort_handler
    from hpcml.train.fields import FieldTrainConfig, FieldTrainer
    from hpcml.train.online import OnlineConfig, OnlineRun

    install_abort_handler()  # a rank that fails on a bug aborts the job instead of hanging it
    cfg = config or FieldTrainConfig(run_dir=c.run_dir)
    cfg = replace(cfg, **{k: v for k, v in (("steps", steps), ("batch", batch)) if v is not None},
                  run_dir=cfg.run_dir or c.run_dir)
    from hpcml.train import population_online as pop

    if population is not None and not isinstance(population, pop.PopulationConfig):
        raise ConfigError(f"train_surrogate(population={population!r}): expected a PopulationConfig")
    if population is not None and (population.tournament or population.pbt) and not val_files:
        raise ConfigError("train_surrogate(population=...) selects members by their held-out error: give val_files "
                          "(the campaign's held-out simulations' files)")
    lo = getattr(scales, "param_lo", None)
    if lo is not None and len(lo) != len(params):  # every rank alike, before any collective
        raise ConfigError(f"train_surrogate(scales=FieldScales(param_lo={tuple(lo)}, ...)): {len(lo)} bounds for the "
                          f"{len(params)} parameter(s) {list(params)}: expected one (lo, hi) pair per parameter, in "
                          f"params' order")
    grid = ProcessGrid(pop=population.members if population else 1, dp=-1)
    grid.init_torch()  # one rank per GPU with the device's backend; gloo on CPU
    if torch_threads:
        torch.set_num_threads(torch_threads)
    if grid.pop > 1:  # each member its own seed, directory and (configure) settings
        cfg = replace(cfg, seed=cfg.seed + grid.member, run_dir=pop.member_dir(cfg.run_dir, grid))
        cfg = population.configure(grid.member, cfg) if population.configure else cfg
    rank, world, comm = pop.stream_rank(grid), grid.layout.world_size * grid.pop, pop.stream_comm(grid)
    from hpcml.stream import Buffer

    buf = Buffer(replace(buffer or BufferConfig(policy="reservoir", capacity=256, watermark=16),
                         seed=(buffer.seed if buffer else 0) + rank))
    if files is not None:
        from hpcml.stream.files import FileSource

        source = FileSource(files, rank=rank, n_trainers=world, buffer=buf, field_names=fields, param_names=params)
    else:
        from hpcml.stream.server import StreamServer

        source = StreamServer.from_campaign(buf, rank=rank, n_trainers=world, param_names=params, field_names=fields,
                                            contract=c, **dict(server or {}))
    trainer = FieldTrainer(model, grid, cfg, scales, parallel, loss_fn)
    ocfg = online or OnlineConfig.from_campaign(c, ckpt_every=max(1, cfg.steps // 20))
    if files is not None:
        ocfg = replace(ocfg, endpoints_file=None)
    validate = _validator(trainer, grid.comm, val_files, params, fields) if val_files else None
    if grid.pop > 1:
        ocfg = replace(ocfg, ckpt_dir=pop.member_path(ocfg.ckpt_dir, grid))
        validate = _best_of(grid, validate, trainer) if validate else None
        share = _validator(trainer, grid.comm, lambda: pop.member_share(_listed(val_files), grid), params, fields)
        hook = pop.selection_hook(grid, trainer, lambda: share().get("val_rel_l2", float("nan")), population,
                                  record=Path(cfg.run_dir) / "tournaments.jsonl" if cfg.run_dir else None, buffer=buf)
        if hook is not None:
            trainer.hooks.append(hook)
    run = OnlineRun(trainer, source, grid=grid, config=ocfg, on_step=on_step, validate=validate, comm=comm)
    result = run.run()
    if grid.pop > 1 and all(grid.pop_comm.allgather(trainer.diverged)):  # after the last round: none to replace them
        from hpcml.train.loop import MAX_NONFINITE_IN_ROW

        raise PopulationDivergedError(f"every member of the population diverged: each ended its training with "
                                      f"{MAX_NONFINITE_IN_ROW} or more steps in a row skipped (NaN or infinite), after "
                                      f"the last selection round -- lower the learning rate, or look for non-finite "
                                      f"values in the data")
    if comm.Get_rank() == 0 and result.resumed_at is not None:
        print(f"[train] resumed at step {result.resumed_at} from {ocfg.ckpt_dir}", flush=True)
    return result, run, grid


def _validator(trainer, comm, val_files, params, fields) -> Callable[[], dict[str, float]]:
    """The held-out error during training (``OnlineConfig.val_every``): rank 0 lists the
    held-out files there are so far -- they may still be being written -- reads the new ones
    (a file it cannot read yet is tried again next time) and sends every rank the same
    samples; every rank predicts (collective under FSDP)."""
    import numpy as np

    from hpcml.stream.files import read_samples

    seen: dict[str, list] = {}

    def validate() -> dict[str, float]:
        new = {}
        if comm.Get_rank() == 0:
            for f in sorted(str(v) for v in _listed(val_files)):
                if f not in seen and Path(f).is_file():
                    try:
                        new[f] = read_samples(f, fields, params)
                    except Exception:  # noqa: BLE001 -- being written: the next validation reads it
                        continue
        seen.update(waiting.bcast(comm, new))  # rank 0 reads the files
        vals = [s for f in sorted(seen) for s in seen[f]]
        if not vals:
            return {}
        err = trainer.rel_l2(np.stack([s.params for s in vals]), np.array([s.t for s in vals]),
                             np.stack([s.fields[0] for s in vals]))
        return {"val_rel_l2": float(err), "val_samples": float(len(vals))}

    return validate


def _listed(val_files) -> list:
    return list(val_files() if callable(val_files) else val_files)


def _best_of(grid, validate: Callable[[], dict[str, float]], trainer) -> Callable[[], dict[str, float]]:
    """A population's held-out figures: the best member's (what an adaptive campaign steers by),
    never a member whose steps are being skipped (diverged)."""
    from hpcml.train.population_online import best_of

    return lambda: best_of(grid, {"val_rel_l2": math.nan} if trainer.diverged else validate())[0]


def _report(run, result, val_files, params, fields, report: bool, grid) -> None:
    """The held-out error (every rank predicts: collective under FSDP); rank 0 writes the
    summary file again with it, the report, and a line."""
    import numpy as np

    from hpcml.stream.files import read_samples

    extra: dict[str, Any] = {}
    vals = [s for f in sorted(Path(v) for v in _listed(val_files)) for s in read_samples(f, fields, params)]
    if vals:
        extra = {"val_rel_l2": run.trainer.rel_l2(np.stack([s.params for s in vals]), np.array([s.t for s in vals]),
                                                  np.stack([s.fields[0] for s in vals])),
                 "val_samples": len(vals)}
        last = max(vals, key=lambda v: v.t)
        pred = run.trainer.predict(last.params[None], np.array([last.t]))[0]
    if grid.pop > 1:  # the population's best member speaks for it (never one whose steps are skipped)
        from hpcml.train.population_online import best_of

        if run.trainer.diverged:
            extra = {**extra, "val_rel_l2": math.nan}
        extra, errs = best_of(grid, extra)
        if vals:
            extra["val_rel_l2_members"] = errs
            pred = grid.pop_comm.bcast(pred, root=int(extra.get("val_best_member", 0)))
    if run.comm.Get_rank() != 0:
        return
    if "val_best_member" in extra and run.config.ckpt_dir and result.status == "ok":  # every member has saved
        from hpcml.train.population_online import export_best

        export_best(Path(run.config.ckpt_dir).parent, int(extra["val_best_member"]))
    result.summary.update(extra)
    if run.config.summary_file:
        run.write_summary(result, **extra)
    run_dir = run.trainer.config.run_dir
    if report and vals and run_dir:
        from hpcml.train.field_report import write_report

        write_report(Path(run_dir).parent if grid.pop > 1 else run_dir, last, pred, result.summary)
    keys = ("samples_ingested", "samples_missing", "duplicate_samples", "gradient_steps", "final_loss", "val_rel_l2")
    print("[train] summary: " + ", ".join(f"{k}={result.summary[k]}" for k in keys if k in result.summary),
          flush=True)
