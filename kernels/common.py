"""What every kernel shares: the config, the time loop and the command line; with the grid
(:mod:`kernels.grid`: decomposition, halo exchange, stencil) and the output sinks
(:mod:`kernels.sinks`), whose names are here too, so a kernel imports from one place.

A kernel is a config dataclass, an initial state and a step function; everything else lives
here so that a second simulation is ~100 lines (see docs/kernels.md). Only numpy, mpi4py and
h5py are imported (``hpcml.stream`` lazily, when streaming): a simulation rank starts in a
fraction of a second and never pulls in torch.

Conventions: a global field has shape ``(nx, ny)``, index ``[i, j]`` with ``i`` along x. A rank
holds its block with one ghost layer, as one float64 array ``state[f, lx + 2, ly + 2]`` for all
``f`` fields, so one halo exchange serves every field.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcml import log, waiting
from hpcml.errors import ConfigError
from kernels.grid import (DT_SAFETY, Decomposition, Halo, Stencil, block, decompose, global_indices, grid_dims,
                          new_state, split_extent, stable_dt)
from kernels.sinks import FanOut, H5Sink, MemorySink, Sink, make_sink

logger = log.get_logger(__name__)

# --------------------------------------------------------------------------- configs and the time loop


def param(default: float | int, help: str) -> Any:
    """A physical parameter field: a flag, a ``--params-json`` key, recorded in the output and the stream."""
    return field(default=default, metadata={"help": help, "param": True})


def option(default: Any, help: str, *, type: type | None = None, choices: list[str] | None = None) -> Any:
    """A run-option field: a command-line flag (``type`` where the default is ``None``)."""
    meta: dict[str, Any] = {"help": help}
    if type is not None:
        meta["type"] = type
    if choices is not None:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True)
class GridConfig:
    """What every kernel run has: the grid, the number of steps, the output interval.

    A field's ``metadata`` makes it a command-line flag (``help``, optional ``type``,
    ``choices``); ``param=True`` marks a physical parameter: accepted in ``--params-json``,
    recorded in the output and sent with every streamed sample.
    """

    nx: int = option(64, "grid cells along x")
    ny: int = option(64, "grid cells along y")
    steps: int = option(100, "time steps to run")
    every: int = option(10, "output every K steps: at steps K, 2K, ... (steps // K outputs; "
                            "the initial state is not output)")
    dt: float | None = option(None, f"time step (default: {DT_SAFETY} x the explicit stability limit; "
                                    "larger than the limit is rejected)", type=float)
    crash_at_step: int | None = option(None, "for reliability tests: rank 0 kills itself with SIGKILL at step K, "
                                             "unless HPCML_ATTEMPT is set and not 0 (so a retry succeeds)", type=int)

    def __post_init__(self) -> None:
        for name, minimum in (("nx", 1), ("ny", 1), ("steps", 0), ("every", 1)):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < minimum:
                raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
        if self.crash_at_step is not None and self.crash_at_step < 1:
            raise ConfigError(f"crash_at_step must be >= 1, got {self.crash_at_step}")

    @classmethod
    def param_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.metadata.get("param")]

    @property
    def params(self) -> dict[str, float]:
        """The physical parameters, as floats (what the output and the stream record)."""
        return {n: float(getattr(self, n)) for n in self.param_names()}

    @property
    def n_outputs(self) -> int:
        return self.steps // self.every

    @property
    def time_step(self) -> float:  # pragma: no cover - every kernel overrides it
        raise NotImplementedError


def check_min(cfg: object, *names: str, minimum: float = 0.0, strict: bool = True) -> None:
    """Raise :class:`ConfigError` naming the value unless each field is > (or >=) ``minimum``."""
    for name in names:
        value = getattr(cfg, name)
        if not (value > minimum if strict else value >= minimum):  # also rejects NaN
            raise ConfigError(f"{name} must be {'>' if strict else '>='} {minimum:g}, got {value}")


def _maybe_crash(step: int, crash_at_step: int | None, comm: MPI.Comm) -> None:
    if step == crash_at_step and comm.Get_rank() == 0 and os.environ.get("HPCML_ATTEMPT", "0") in ("", "0"):
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # a real kill -9: no cleanup, no close, no rename


def march(state: np.ndarray, decomp: Decomposition, advance: Callable[[], None], *, cfg: GridConfig,
          names: Sequence[str], sink: Sink | None) -> None:
    """The time loop every kernel shares: halo exchange, one step, output every ``cfg.every`` steps.

    ``advance`` updates the interior of ``state[f, lx + 2, ly + 2]`` in place from a state
    whose ghosts are filled. Outputs go at steps K, 2K, ... as float32 copies of the interiors.
    """
    halo, dt = Halo(decomp, state.shape[0]), cfg.time_step
    try:
        for step in range(1, cfg.steps + 1):
            halo.exchange(state)
            advance()
            _maybe_crash(step, cfg.crash_at_step, decomp.comm)
            if sink is not None and step % cfg.every == 0:
                sink.send(step, step * dt, {n: np.ascontiguousarray(state[k, 1:-1, 1:-1], dtype=np.float32)
                                            for k, n in enumerate(names)})
    finally:
        halo.free()


# --------------------------------------------------------------------------- command line


@dataclass(frozen=True, kw_only=True)
class KernelSpec:
    """What the shared command line needs to know about a kernel."""

    name: str
    description: str
    config: type[GridConfig]
    run: Callable[..., np.ndarray]
    fields: list[str]
    periodic: bool


class _Parser(argparse.ArgumentParser):
    """Every rank parses alike; only rank 0 speaks: one error line, or the help once."""

    def error(self, message: str) -> None:
        if MPI.COMM_WORLD.Get_rank() == 0:
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)

    def print_help(self, file: Any = None) -> None:
        if MPI.COMM_WORLD.Get_rank() == 0:
            super().print_help(file)


def build_parser(spec: KernelSpec) -> argparse.ArgumentParser:
    """Flags from the config dataclass's fields, then output and campaign flags."""
    p = _Parser(prog=spec.name, description=spec.description)
    for f in dataclasses.fields(spec.config):
        meta = f.metadata
        if "help" in meta:
            kind = meta.get("type", type(f.default))
            p.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=None,
                           choices=meta.get("choices"),
                           help=meta["help"] + ("" if f.default is None else f" (default: {f.default})"))
    p.add_argument("--params-json", help="parameters as a JSON object, e.g. '{\"%s\": 1.0}'; a flag given "
                   "explicitly wins" % spec.config.param_names()[0])
    p.add_argument("--out", help="write the outputs to this HDF5 file (collectively; via PATH.tmp, renamed at the end)")
    p.add_argument("--stream", action="store_true", help="stream the outputs to training (hpcml.stream.Producer)")
    p.add_argument("--sim-id", type=int, default=0, help="this simulation's id in its ensemble")
    p.set_defaults(kernel=spec.name)
    return p


def config_from_args(cls: type[GridConfig], args: argparse.Namespace) -> GridConfig:
    """Config from defaults, then ``--params-json``, then explicit flags; validated by the config."""
    values: dict[str, Any] = {}
    if args.params_json:
        try:
            given = json.loads(args.params_json)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--params-json is not valid JSON ({e.msg} at character {e.pos}): expected an object")
        if not isinstance(given, dict):
            raise ConfigError(f"--params-json must be a JSON object, got {type(given).__name__}")
        known = cls.param_names()
        for k, v in given.items():
            if k not in known:
                raise ConfigError(f"unknown parameter {k!r} in --params-json: expected one of {', '.join(known)}")
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ConfigError(f"parameter {k} in --params-json must be a number, got {v!r}")
            values[k] = v
    for f in dataclasses.fields(cls):
        if getattr(args, f.name, None) is not None:
            values[f.name] = getattr(args, f.name)
    return cls(**values)


def main(spec: KernelSpec, argv: Sequence[str] | None = None) -> int:
    """Run a kernel from the command line; bad input: one line on stderr (rank 0), exit status 2.

    Everything that can be wrong with the input is checked on every rank before the first
    collective. At the end rank 0 prints ``HPCML_SIM_RESULT {json}`` for the campaign.
    """
    comm = MPI.COMM_WORLD
    args = build_parser(spec).parse_args(argv)
    try:
        cfg = config_from_args(spec.config, args)
        if args.out and not Path(args.out).resolve().parent.is_dir():
            raise ConfigError(f"--out {args.out}: directory {Path(args.out).resolve().parent} does not exist")
        decomp = decompose(comm, cfg.nx, cfg.ny, periodic=spec.periodic)
    except ConfigError as e:
        if comm.Get_rank() == 0:
            print(f"{spec.name}: error: {e}", file=sys.stderr)
        return 2
    from hpcml.grid import install_abort_handler

    install_abort_handler(comm)  # from here on, one failing rank ends the job instead of hanging it
    t0 = time.perf_counter()
    sink, error = None, None
    try:
        sink = make_sink(args, decomp, cfg.params, spec.fields, cfg.n_outputs)
    except ConfigError as e:  # e.g. --stream without the campaign's environment, maybe on some ranks only
        error = str(e)
    # so that all ranks stop, or none (a sink's set-up, a connection to the trainer, takes its own time on each)
    errors = [e for e in waiting.allgather(comm, error) if e]
    if errors:
        if comm.Get_rank() == 0:
            print(f"{spec.name}: error: {errors[0]}", file=sys.stderr)
        return 2
    logger.info("%s: %dx%d cells on %dx%d ranks, %d steps of dt=%.6g, %d outputs", spec.name, cfg.nx, cfg.ny,
                *decomp.dims, cfg.steps, cfg.time_step, cfg.n_outputs if sink else 0)
    spec.run(comm, cfg, sink, decomp=decomp)
    if sink is not None:
        sink.close()
    wall = time.perf_counter() - t0
    if comm.Get_rank() == 0:
        result = {"sim_id": args.sim_id, "kernel": spec.name, "steps": cfg.steps, "outputs": cfg.n_outputs,
                  "samples_sent": cfg.n_outputs if sink is not None else 0, "wall_s": round(wall, 6),
                  "step_s": wall / max(cfg.steps, 1), "ranks": comm.Get_size(), "nx": cfg.nx, "ny": cfg.ny,
                  "dt": cfg.time_step, "params": cfg.params, "out": args.out}
        print("HPCML_SIM_RESULT " + json.dumps(result), flush=True)
    return 0


__all__ = ["DT_SAFETY", "Decomposition", "FanOut", "GridConfig", "H5Sink", "Halo", "KernelSpec", "MemorySink", "Sink",
           "Stencil", "block", "build_parser", "check_min", "config_from_args", "decompose", "global_indices",
           "grid_dims", "main", "make_sink", "march", "new_state", "option", "param", "split_extent", "stable_dt"]
