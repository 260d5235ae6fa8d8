"""The file-based path: the same samples, read from the simulations' HDF5 files into the
same buffer, so offline and online training differ only in where samples come from.

File layout (written by the kernels, docs/kernels.md): ``/fields/<name>`` [n_out, nx, ny]
(or [n_out, nx] / [n_out, nx, ny, nz] for a 1-D / 3-D solver of your own), ``/time``
[n_out], ``/step`` [n_out], root attributes ``sim_id`` and ``params`` (JSON). Each trainer
rank reads the simulations that route to it (``route``: sim_id % n_trainers), as the
stream server would receive them.
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
from hpcml.stream.source import pack_state, unpack_states


def read_samples(path: str | Path, field_names, param_names) -> list[Sample]:
    """Every output step of one simulation file as samples."""
    with h5py.File(path, "r") as f:
        params = json.loads(f.attrs["params"])
        p = np.array([params[n] for n in param_names], np.float32)
        fields = np.stack([f[f"fields/{n}"][()] for n in field_names], axis=1).astype(np.float32)
        times, steps, sim = f["time"][()], f["step"][()], int(f.attrs["sim_id"])
    return [Sample(sim, int(s), float(t), p, fields[i]) for i, (s, t) in enumerate(zip(steps, times))]


class FileSource:
    """Feeds this rank's share of ``files`` into ``buffer`` from a thread: a
    :class:`~hpcml.stream.source.SampleSource` like the stream server. Its state (buffer and
    the keys already read) goes into the checkpoint, so a resumed run reads on where it
    stopped and takes no sample twice."""

    def __init__(self, files, *, rank: int, n_trainers: int, buffer: Buffer, field_names, param_names) -> None:
        self.files = sorted(Path(f) for f in files)
        self.rank, self.n_trainers, self.buffer = rank, n_trainers, buffer
        self.field_names, self.param_names = tuple(field_names), tuple(param_names)
        self.counters = {"samples": 0, "bytes": 0, "files": 0, "duplicates": 0}
        self.seen: set[tuple[int, int]] = set()
        self._lock = threading.Lock()  # a sample is in the buffer and in ``seen`` together, or in neither
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t_first = self.t_last = None

    def _mine(self, sim: int) -> bool:
        return route(int(sim), self.n_trainers) == self.rank

    def _run(self) -> None:
        self.t_first = time.perf_counter()
        for path in self.files:
            with h5py.File(path, "r") as f:
                if not self._mine(int(f.attrs["sim_id"])):
                    continue
            for s in read_samples(path, self.field_names, self.param_names):
                if (s.sim, s.step) in self.seen:  # read before a restart: in the checkpoint already
                    continue
                while True:
                    with self._lock:
                        if self.buffer.put(s, timeout=0.05):
                            self.seen.add((s.sim, s.step))
                            self.counters["samples"] += 1
                            self.counters["bytes"] += s.fields.nbytes
                            break
                    if self._stop.is_set():
                        return
            self.counters["files"] += 1
        self.t_last = time.perf_counter()
        self.buffer.end()

    def quiesce(self) -> None:
        """Nothing is in flight between a file and the buffer."""

    def state(self) -> dict[str, np.ndarray]:
        with self._lock:
            return pack_state(self.buffer, self.seen, {"counters": self.counters})

    def load_state(self, states: list[dict[str, np.ndarray]]) -> None:
        with self._lock:
            metas = unpack_states(states, self.buffer, self.seen, self._mine, self.rank)
            self.counters["samples"] = len(self.seen)
            if len(metas) == self.n_trainers:
                self.counters["bytes"] = metas[self.rank]["counters"]["bytes"]

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
