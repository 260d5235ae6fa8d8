"""The file-based path: the same samples, read from the simulations' HDF5 files into the
same buffer, so offline and online training differ only in where samples come from.

File layout (written by the kernels, docs/kernels.md): ``/fields/<name>`` [n_out, nx, ny],
``/time`` [n_out], ``/step`` [n_out], root attributes ``sim_id`` and ``params`` (JSON).
Each trainer rank reads the simulations that route to it.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import h5py
import numpy as np

from hpcml.stream.buffer import Buffer, Sample
from hpcml.stream.routing import route


def read_samples(path: str | Path, field_names, param_names) -> list[Sample]:
    """Every output step of one simulation file as samples."""
    with h5py.File(path, "r") as f:
        params = json.loads(f.attrs["params"])
        p = np.array([params[n] for n in param_names], np.float32)
        fields = np.stack([f[f"fields/{n}"][()] for n in field_names], axis=1).astype(np.float32)
        times, steps, sim = f["time"][()], f["step"][()], int(f.attrs["sim_id"])
    return [Sample(sim, int(s), float(t), p, fields[i]) for i, (s, t) in enumerate(zip(steps, times))]


class FileSource:
    """Feeds this rank's share of ``files`` into ``buffer`` from a thread (same interface the
    loader uses on a :class:`~hpcml.stream.server.StreamServer`)."""

    def __init__(self, files, *, rank: int, n_trainers: int, buffer: Buffer, field_names, param_names) -> None:
        self.files = sorted(Path(f) for f in files)
        self.rank, self.n_trainers, self.buffer = rank, n_trainers, buffer
        self.field_names, self.param_names = tuple(field_names), tuple(param_names)
        self.counters = {"samples": 0, "bytes": 0, "files": 0, "duplicates": 0}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t_first = self.t_last = None

    def _mine(self, path: Path) -> bool:
        with h5py.File(path, "r") as f:
            return route(int(f.attrs["sim_id"]), self.n_trainers) == self.rank

    def _run(self) -> None:
        self.t_first = time.perf_counter()
        for path in self.files:
            if not self._mine(path):
                continue
            for s in read_samples(path, self.field_names, self.param_names):
                while not self.buffer.put(s, timeout=0.1):
                    if self._stop.is_set():
                        return
                self.counters["samples"] += 1
                self.counters["bytes"] += s.fields.nbytes
            self.counters["files"] += 1
        self.t_last = time.perf_counter()
        self.buffer.end()

    def start(self) -> FileSource:
        self._thread = threading.Thread(target=self._run, name="hpcml-files", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def stats(self) -> dict:
        dt = (self.t_last - self.t_first) if self.t_last else 0.0
        return {**self.counters, "dropped": {}, "intake_s": dt,
                "intake_mb_s": self.counters["bytes"] / 1e6 / dt if dt else 0.0,
                "buffer": self.buffer.stats.as_dict(), "buffer_len": len(self.buffer)}
