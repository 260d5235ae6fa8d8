"""Where a kernel's output goes: one HDF5 file written collectively (parallel HDF5), the
stream into training (``hpcml.stream``, imported only when asked), memory, or several."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import h5py
import numpy as np

from hpcml import log, waiting
from kernels.grid import Decomposition

logger = log.get_logger("kernels.common")  # the kernels' one log name, as before the split

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
        waiting.barrier(self.comm)  # every rank's data is in the file before it gets its final name
        if self.comm.Get_rank() == 0:
            if complete:
                os.replace(self.tmp, self.path)
            else:
                logger.warning("%s: %d of %d outputs written; left as %s", self.path, self._written,
                               self.n_outputs, self.tmp)
        waiting.barrier(self.comm)  # the final name exists on return, on every rank


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
