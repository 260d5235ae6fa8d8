"""What every kernel shares: domain decomposition, halo exchange, the time loop, output sinks, CLI.

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
from typing import Any, Protocol

import h5py
import numpy as np
from mpi4py import MPI

from hpcml import log
from hpcml.errors import ConfigError

logger = log.get_logger(__name__)

#: Fraction of the explicit stability limit used when no ``dt`` is given.
DT_SAFETY = 0.8


# --------------------------------------------------------------------------- decomposition


@dataclass(frozen=True, kw_only=True)
class Decomposition:
    """This rank's block of a 2-D grid on a Cartesian communicator."""

    global_shape: tuple[int, int]
    """(nx, ny) of the whole grid."""
    offset: tuple[int, int]
    """Global index (x0, y0) of this rank's first interior cell."""
    local_shape: tuple[int, int]
    """(lx, ly) interior cells on this rank."""
    dims: tuple[int, int]
    """Ranks along x and y."""
    coords: tuple[int, int]
    """This rank's position in the process grid."""
    periodic: bool
    """Whether both axes wrap around."""
    comm: Any = field(compare=False, repr=False)
    """The Cartesian communicator (``MPI.Cartcomm``)."""

    @property
    def interior(self) -> tuple[slice, slice]:
        """The global index of this rank's block, for slicing a global array."""
        (x0, y0), (lx, ly) = self.offset, self.local_shape
        return slice(x0, x0 + lx), slice(y0, y0 + ly)


def split_extent(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, count) of block ``index`` when ``n`` cells are split into ``parts`` blocks.

    The remainder goes to the first blocks, so sizes differ by at most one.
    """
    base, extra = divmod(n, parts)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


def grid_dims(nx: int, ny: int, size: int) -> tuple[int, int]:
    """Ranks along (x, y) for ``size`` ranks (``MPI.Compute_dims``), checked against the grid.

    Pure arithmetic (no communicator): the same answer and the same error on every rank.
    """
    dims = tuple(MPI.Compute_dims(size, 2))
    for axis, n, d in (("x", nx, dims[0]), ("y", ny, dims[1])):
        if n < d:
            raise ConfigError(f"n{axis}={n} is smaller than the {d} ranks along {axis} "
                              f"(process grid {dims[0]}x{dims[1]} for {size} ranks): expected n{axis} >= {d}")
    return dims  # type: ignore[return-value]


def block(nx: int, ny: int, dims: Sequence[int], coords: Sequence[int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(offset, local_shape) of the block at ``coords`` in a ``dims`` process grid."""
    (x0, lx), (y0, ly) = split_extent(nx, dims[0], coords[0]), split_extent(ny, dims[1], coords[1])
    return (x0, y0), (lx, ly)


def decompose(comm: MPI.Comm, nx: int, ny: int, periodic: bool) -> Decomposition:
    """Split an ``nx`` x ``ny`` grid over ``comm`` on a new Cartesian communicator.

    Validation comes before ``Create_cart`` (the first collective), so bad sizes raise the
    same :class:`ConfigError` on every rank and nothing hangs.
    """
    dims = grid_dims(nx, ny, comm.Get_size())
    cart = comm.Create_cart(dims, periods=[periodic, periodic], reorder=False)
    coords = tuple(cart.Get_coords(cart.Get_rank()))
    offset, local_shape = block(nx, ny, dims, coords)
    return Decomposition(global_shape=(nx, ny), offset=offset, local_shape=local_shape, dims=dims,
                         coords=coords, periodic=periodic, comm=cart)  # type: ignore[arg-type]


class Halo:
    """Fills the ghost layer of ``state[f, lx + 2, ly + 2]`` from the neighbouring ranks.

    MPI subarray datatypes describe the edge rows and (strided) columns in place, so nothing
    is copied by hand; all eight messages are in flight at once (a 5-point stencil needs no
    corners). A neighbour beyond a non-periodic edge is ``MPI.PROC_NULL``: its ghost cells
    keep what the kernel put there (the boundary condition).
    """

    def __init__(self, decomp: Decomposition, n_fields: int) -> None:
        self.comm = decomp.comm
        lx, ly = decomp.local_shape
        sizes = [n_fields, lx + 2, ly + 2]

        def sub(subsizes: list[int], starts: list[int]) -> MPI.Datatype:
            return MPI.DOUBLE.Create_subarray(sizes, subsizes, starts).Commit()

        # Per axis: (lower neighbour, upper neighbour, send-low, send-high, recv-low, recv-high).
        self._plan = []
        for axis, (rows, n) in enumerate((([n_fields, 1, ly], lx), ([n_fields, lx, 1], ly))):
            at = (lambda k: [0, k, 1]) if axis == 0 else (lambda k: [0, 1, k])
            lo, hi = self.comm.Shift(axis, 1)
            sends, recvs = (sub(rows, at(1)), sub(rows, at(n))), (sub(rows, at(0)), sub(rows, at(n + 1)))
            self._plan.append((axis, lo, hi, *sends, *recvs))

    def exchange(self, state: np.ndarray) -> None:
        """Post every receive and send, then wait; ``state`` must be C-contiguous float64."""
        reqs = []
        for axis, lo, hi, send_lo, send_hi, recv_lo, recv_hi in self._plan:
            up, down = 2 * axis, 2 * axis + 1  # tags: a rank may be both neighbours, or itself
            reqs.append(self.comm.Irecv([state, 1, recv_lo], source=lo, tag=up))
            reqs.append(self.comm.Irecv([state, 1, recv_hi], source=hi, tag=down))
            reqs.append(self.comm.Isend([state, 1, send_hi], dest=hi, tag=up))
            reqs.append(self.comm.Isend([state, 1, send_lo], dest=lo, tag=down))
        MPI.Request.Waitall(reqs)

    def free(self) -> None:
        for _, _, _, *types in self._plan:
            for t in types:
                t.Free()
        self._plan = []


# --------------------------------------------------------------------------- numerics


def stable_dt(dt: float | None, diffusivity: float, dx: float, dy: float, what: str) -> float:
    """``dt`` checked against the explicit 2-D diffusion limit, or a safe one when ``None``.

    Forward Euler on the 5-point Laplacian is stable for
    ``dt <= 1 / (2 D (1/dx^2 + 1/dy^2))`` (``dx^2 / (4 D)`` on a square grid).
    """
    limit = 1.0 / (2.0 * diffusivity * (1.0 / dx**2 + 1.0 / dy**2))
    if dt is None:
        return DT_SAFETY * limit
    if not dt > 0:
        raise ConfigError(f"dt must be > 0, got {dt}")
    if dt > limit:
        raise ConfigError(f"dt={dt:.6g} is unstable: expected dt <= {limit:.6g} "
                          f"(explicit limit 1/(2 {what} (1/dx^2 + 1/dy^2)) with dx={dx:.6g}, dy={dy:.6g})")
    return dt


class Stencil:
    """The 5-point diffusion increment, vectorised into preallocated buffers (no temporaries)."""

    def __init__(self, local_shape: tuple[int, int]) -> None:
        self._tmp = np.empty(local_shape)

    def diffusion(self, g: np.ndarray, cx: float, cy: float, out: np.ndarray) -> np.ndarray:
        """``out = cx (g[i+1] + g[i-1] - 2g) + cy (g[j+1] + g[j-1] - 2g)`` on the interior of ghosted ``g``.

        With ``cx = D dt / dx^2`` this is the forward-Euler increment of ``D * laplacian``.
        The same operations in the same order on every cell, whatever the decomposition, so
        results agree bitwise across rank counts.
        """
        c, t = g[1:-1, 1:-1], self._tmp
        np.add(g[2:, 1:-1], g[:-2, 1:-1], out=out)
        out -= c
        out -= c
        out *= cx
        np.add(g[1:-1, 2:], g[1:-1, :-2], out=t)
        t -= c
        t -= c
        t *= cy
        out += t
        return out


def new_state(decomp: Decomposition, n_fields: int) -> np.ndarray:
    """Zeroed ``state[n_fields, lx + 2, ly + 2]``: this rank's block of every field with its ghost layer."""
    lx, ly = decomp.local_shape
    return np.zeros((n_fields, lx + 2, ly + 2))


def global_indices(decomp: Decomposition) -> tuple[np.ndarray, np.ndarray]:
    """Global (i, j) index arrays of this rank's interior, for closed-form initial conditions."""
    sx, sy = decomp.interior
    return np.ogrid[sx, sy]


# --------------------------------------------------------------------------- sinks


class Sink(Protocol):
    """Where a kernel's output goes. Every rank calls ``send`` with its own block.

    ``fields`` maps each field name to this rank's interior block (``local_shape``),
    C-contiguous float32. ``send`` and ``close`` are called on every rank in the same order,
    so a sink may use collectives.
    """

    def send(self, step: int, t: float, fields: dict[str, np.ndarray]) -> None: ...

    def close(self) -> None: ...


class MemorySink:
    """Keeps every output in memory: for tests and notebooks."""

    def __init__(self) -> None:
        self.records: list[tuple[int, float, dict[str, np.ndarray]]] = []
        self.closed = False

    def send(self, step: int, t: float, fields: dict[str, np.ndarray]) -> None:
        self.records.append((step, t, {k: v.copy() for k, v in fields.items()}))

    def close(self) -> None:
        self.closed = True


class FanOut:
    """Sends every output to several sinks (``--out`` and ``--stream`` together)."""

    def __init__(self, *sinks: Sink) -> None:
        self.sinks = sinks

    def send(self, step: int, t: float, fields: dict[str, np.ndarray]) -> None:
        for s in self.sinks:
            s.send(step, t, fields)

    def close(self) -> None:
        for s in self.sinks:
            s.close()


class H5Sink:
    """One HDF5 file written collectively by all ranks (parallel HDF5, h5py ``driver="mpio"``).

    Layout (the offline trainer reads it): ``/fields/<name>`` [n_outputs, nx, ny] float32,
    ``/step`` [n_outputs] int64, ``/time`` [n_outputs] float64; root attributes ``kernel``,
    ``params`` (JSON), one float attribute per parameter, ``nx``, ``ny``, ``sim_id``.
    The file is written as ``PATH.tmp`` and renamed to ``PATH`` by rank 0 once every output
    is in and the file is closed, so a killed simulation never leaves a half file under the
    final name.
    """

    def __init__(self, path: str | os.PathLike, decomp: Decomposition, *, kernel: str, params: dict[str, float],
                 field_names: Sequence[str], n_outputs: int, sim_id: int = 0) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.comm, self.decomp, self.n_outputs = decomp.comm, decomp, n_outputs
        self._written = 0
        nx, ny = decomp.global_shape
        # Every call below is collective: same order and same values on every rank.
        self._file = h5py.File(self.tmp, "w", driver="mpio", comm=self.comm)
        f = self._file
        f.attrs["kernel"] = kernel
        f.attrs["params"] = json.dumps(params, sort_keys=True)
        for k, v in params.items():
            f.attrs[k] = float(v)
        f.attrs["nx"], f.attrs["ny"], f.attrs["sim_id"] = nx, ny, int(sim_id)
        self._fields = {n: f.create_dataset(f"fields/{n}", shape=(n_outputs, nx, ny), dtype=np.float32)
                        for n in field_names}
        self._step = f.create_dataset("step", shape=(n_outputs,), dtype=np.int64)
        self._time = f.create_dataset("time", shape=(n_outputs,), dtype=np.float64)

    def send(self, step: int, t: float, fields: dict[str, np.ndarray]) -> None:
        if self._written >= self.n_outputs:
            raise ValueError(f"{self.path}: more outputs than the {self.n_outputs} the file was made for")
        where = (self._written, *self.decomp.interior)
        for name, ds in self._fields.items():
            with ds.collective:  # one MPI-IO collective write per field, each rank its hyperslab
                ds[where] = fields[name]
        if self.comm.Get_rank() == 0:
            self._step[self._written] = step
            self._time[self._written] = t
        self._written += 1

    def close(self) -> None:
        """Close collectively; rename to the final name only when every output was written."""
        if self._file is None:
            return
        self._file.close()
        self._file = None
        complete = self._written == self.n_outputs
        self.comm.Barrier()  # every rank's data is in the file before it gets its final name
        if self.comm.Get_rank() == 0:
            if complete:
                os.replace(self.tmp, self.path)
            else:
                logger.warning("%s: %d of %d outputs written; left as %s", self.path, self._written,
                               self.n_outputs, self.tmp)
        self.comm.Barrier()  # the final name exists on return, on every rank


def make_sink(args: argparse.Namespace, decomp: Decomposition, params: dict[str, float], field_names: list[str],
              n_outputs: int) -> Sink | None:
    """The sink the command line asks for: ``--out`` (HDF5), ``--stream`` (hpcml.stream), both, or none."""
    sinks: list[Sink] = []
    if args.out:
        sinks.append(H5Sink(args.out, decomp, kernel=args.kernel, params=params, field_names=field_names,
                            n_outputs=n_outputs, sim_id=args.sim_id))
    if args.stream:
        from hpcml.stream import Producer  # lazily: the file-only path never imports the streaming stack

        sinks.append(Producer.from_campaign(comm=decomp.comm, params=params, global_shape=decomp.global_shape,
                                            offset=decomp.offset, local_shape=decomp.local_shape, fields=field_names,
                                            copy=False))  # march() sends fresh float32 copies it never touches again
    if not sinks:
        return None
    return sinks[0] if len(sinks) == 1 else FanOut(*sinks)


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
    errors = [e for e in comm.allgather(error) if e]  # so that all ranks stop, or none
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
