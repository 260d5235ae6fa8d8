"""The file-based path: the same samples, read from the simulations' HDF5 files into the
same buffer, so offline and online training differ only in where samples come from.

File layout (written by the kernels, docs/kernels.md): ``/fields/<name>`` [n_out, nx, ny]
(or [n_out, nx] / [n_out, nx, ny, nz] for a 1-D / 3-D solver of your own), ``/time``
[n_out], ``/step`` [n_out], root attributes ``sim_id`` and ``params`` (JSON). Each trainer
rank reads the simulations that route to it (``route``: sim_id % n_trainers), as the
stream server would receive them.
"""

from __future__ import annotations

import threading
from collections import Counter
import time
from pathlib import Path

import h5py
import numpy as np

from hpcml import safeio
from hpcml.errors import ConfigError
from hpcml.stream.buffer import Buffer, Sample
from hpcml.stream.message import MessageError
from hpcml.stream.routing import route
from hpcml.stream.schema import SampleSchema
from hpcml.stream.source import SampleSource, add_counters, history_of, pack_state, unpack_states


def _bad(path, e: Exception) -> ConfigError:
    return ConfigError(f"simulation file {path}: {type(e).__name__}: {e}; expected the kernels' HDF5 layout "
                       f"(/fields/<name>, /time, /step, attributes sim_id and params: docs/kernels.md)")


def _open(path: str | Path) -> h5py.File:
    if not h5py.is_hdf5(path):  # the signature only: nothing else is parsed by HDF5 first
        raise ValueError("not an HDF5 file")
    return h5py.File(path, "r")


def file_sim_id(path: str | Path) -> int:
    """The simulation id of a file (its attribute only), or a one-line ConfigError."""
    try:
        with _open(path) as f:
            return int(f.attrs["sim_id"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _bad(path, e) from None


def read_samples(path: str | Path, field_names, param_names, schema: SampleSchema | None = None) -> list[Sample]:
    """Every output step of one simulation file as samples; ConfigError, in one line naming
    the file, for one that is not an HDF5 file of the kernels' layout or that breaks the
    trainer's ``schema`` (other fields, parameters or grid than the samples before it)."""
    schema = schema or SampleSchema(field_names, param_names)
    try:
        with _open(path) as f:
            params = safeio.parse_json(f.attrs["params"], "attribute params")  # nesting bounded first
            sim = int(f.attrs["sim_id"])
            names = sorted(f["fields"]) if "fields" in f else []
            shape = f[f"fields/{schema.field_names[0]}"].shape[1:] if schema.field_names[0] in names else ()
            if not isinstance(params, dict):
                raise ValueError(f"attribute params is {type(params).__name__}, expected a JSON object")
            schema.check(sim, names, params, shape)  # the file's first sample fixes the grid below
            p = schema.params_vector(params)
            fields = np.stack([f[f"fields/{n}"][()] for n in schema.field_names], axis=1).astype(np.float32)
            times, steps = f["time"][()], f["step"][()]
        if not (fields.ndim >= 3 and len(times) == len(steps) == len(fields)):
            raise ValueError(f"fields {fields.shape}, {len(times)} times, {len(steps)} steps")
    except MessageError as e:
        raise ConfigError(f"simulation file {path}: {e}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _bad(path, e) from None
    return [schema.sample(sim, int(s), float(t), p, fields[i]) for i, (s, t) in enumerate(zip(steps, times))]


class FileSource(SampleSource):
    """Feeds this rank's share of ``files`` into ``buffer`` from a thread: a
    :class:`~hpcml.stream.source.SampleSource` like the stream server. Its state (buffer and
    the keys already read) goes into the checkpoint, so a resumed run reads on where it
    stopped and takes no sample twice."""

    def __init__(self, files, *, rank: int, n_trainers: int, buffer: Buffer, field_names, param_names) -> None:
        self.files = sorted(Path(f) for f in files)
        self.rank, self.n_trainers, self.buffer = rank, n_trainers, buffer
        self.schema = SampleSchema(field_names, param_names)
        self.field_names, self.param_names = self.schema.field_names, self.schema.param_names
        self.counters = {"samples": 0, "bytes": 0, "files": 0, "duplicates": 0}
        self.expected: dict[int, int] = {}
        """Samples in each file of this rank read so far: a file is read whole or fails the run."""
        self.seen: set[tuple[int, int]] = set()
        self._lock = threading.Lock()  # a sample is in the buffer and in ``seen`` together, or in neither
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t_first = self.t_last = None
        self.error: str | None = None

    def _mine(self, sim: int) -> bool:
        return route(int(sim), self.n_trainers) == self.rank

    def _run(self) -> None:
        try:
            self._read_all()
        except Exception as e:  # a bad file (or a bug): the loader fails every rank with this, no hang
            self.error = str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}"
            self.buffer.fail(f"trainer rank {self.rank}: {self.error}")

    def _read_all(self) -> None:
        self.t_first = time.perf_counter()
        for path in self.files:
            if not self._mine(file_sim_id(path)):
                continue
            samples = read_samples(path, self.field_names, self.param_names, self.schema)
            if samples:
                self.expected[samples[0].sim] = len({x.step for x in samples})
            for s in samples:
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

    def accounting(self) -> dict:
        with self._lock:
            ingested = Counter(sim for sim, _ in self.seen)
            return {"expected": dict(self.expected), "ingested": {s: ingested[s] for s in set(ingested) |
                                                                  set(self.expected)}}

    def state(self) -> dict[str, np.ndarray]:
        with self._lock:
            return pack_state(self.buffer, self.seen, {"counters": self.counters, "schema": self.schema.state()})

    def load_state(self, states: list[dict[str, np.ndarray]]) -> None:
        with self._lock:
            metas = unpack_states(states, self.buffer, self.seen, self._mine, self.rank, self.n_trainers)
            for i, meta in enumerate(metas):
                self.schema.load_state(meta.get("schema") or {})
                if history_of(i, self.rank, self.n_trainers):
                    add_counters(self.counters, meta["counters"], skip=("samples", "files"))
            self.counters["samples"] = len(self.seen)

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
        return {**self.counters, "dropped": {}, "error": self.error, "intake_s": dt,
                "intake_mb_s": self.counters["bytes"] / 1e6 / dt if dt else 0.0,
                "buffer": self.buffer.stats.as_dict(), "buffer_len": len(self.buffer)}
