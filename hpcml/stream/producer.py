"""The simulation side: each rank of a simulation sends its subdomain of every output step.

All ranks of simulation ``s`` send to the one trainer rank ``route(s, n)`` over TCP with the
stream's own framing (:mod:`hpcml.stream.sender`). Backpressure is the trainer's
acknowledgements and TCP's window: when the trainer's buffer is full it stops reading, and
``send`` blocks once ``hwm`` messages are held here unacknowledged, so a fast simulation slows
down instead of growing memory. The sender reconnects by itself and sends again whatever the
trainer had not acknowledged, so a trainer restarted on the same address picks the stream up
with nothing lost; ``close()`` returns once the trainer has taken everything, and raises if it
did not. At the first ``send`` the producer checks what the trainer said of itself at the
handshake -- campaign, run, fields, parameters, grid -- so a simulation that sends what the
trainer would drop fails then, naming the values (a ConfigError: final, never retried).
Imports no torch: a simulation starts in a fraction of a second.

Fields have 1 to 3 dimensions. Whatever the trainer would drop (a shape it cannot
assemble, ids out of range, a dtype it cannot carry...) is a ConfigError here, at
construction or at ``send``: a drop is only counted in the trainer's log, while the
simulation would go on and report success.
"""

from __future__ import annotations

import json
import math
import operator
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import zmq

from hpcml import log
from hpcml.contract import ENV, ENV_ATTEMPT, ENV_SIM_ID, Contract, read_endpoints
from hpcml.outcome import write_final_error, write_stream_record
from hpcml.errors import ConfigError, LaunchError
from hpcml.stream import framing, message, routing, sender, tiling, zmtp
from hpcml.stream.handshake import HandshakeError

logger = log.get_logger(__name__)

#: The largest integer float32 holds exactly (and every one below it): an integer field past it is refused.
EXACT_F32 = 1 << 24


def trainer_mismatch(info: dict, *, campaign: str, run: str, fields: Sequence[str], params: Mapping,
                     global_shape: Sequence[int]) -> str | None:
    """What in a producer's output the trainer that sent ``info`` would drop, or None."""
    if info.get("campaign") != campaign:
        return f"the trainer belongs to campaign {info.get('campaign')!r}, this simulation to {campaign!r}"
    if info.get("run") and info["run"] != run:
        return (f"the trainer belongs to run {info['run']!r} of the campaign, this simulation to run {run!r}" if run
                else f"the trainer belongs to run {info['run']!r} of the campaign, this producer names no run "
                     f"(build it with Producer.from_campaign, or pass run=)")
    want = info.get("fields") or []
    if want and sorted(fields) != sorted(want):
        return f"fields {sorted(fields)} sent, the trainer takes {sorted(want)}"
    missing = [p for p in info.get("params") or [] if p not in params]
    if missing:
        return f"parameters {missing} missing from params {sorted(params)} (the trainer needs {info['params']})"
    shape = info.get("shape")
    if shape and list(global_shape) != list(shape):
        return f"global grid {list(global_shape)} sent, the trainer's samples are {list(shape)}"
    return None


def _final(text: str, sim: int, attempt: int) -> ConfigError:
    """A deterministic mistake of simulation ``sim``: recorded for its campaign (no retry, the cause named)."""
    write_final_error(text, sim, attempt)
    return ConfigError(text)


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ConfigError(f"environment variable {name} is not set (the campaign sets it for each simulation)")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


@dataclass(kw_only=True)
class Producer:
    """Sends one simulation rank's output; ``close()`` tells the trainer this rank is done."""

    endpoint: str
    secret: bytes
    campaign: str
    sim_id: int
    attempt: int
    rank: int
    nranks: int
    params: dict[str, float]
    global_shape: tuple[int, ...]
    """The whole field: (nx,), (nx, ny) or (nx, ny, nz)."""
    offset: tuple[int, ...]
    """Origin of this rank's block in the whole field (as many entries as ``global_shape``)."""
    local_shape: tuple[int, ...]
    """Extent of this rank's block: the shape of every array given to ``send``."""
    fields: Sequence[str] | None = None
    """The field names every ``send`` carries (None: not checked beyond being names)."""
    hwm: int = 4
    """Messages queued here before ``send`` blocks (memory bound: ~hwm x message size, plus the
    kernel's socket buffers)."""
    send_timeout_s: float = 600.0
    """A trainer unreachable this long is an error (the campaign then retries the simulation)."""
    copy: bool = True
    """True: every message is copied once into the buffer that is sent (one message, one
    buffer: :mod:`hpcml.stream.framing`), so the caller may overwrite its arrays as soon as
    ``send`` returns. False: C-contiguous float32/float64 arrays are sent as they are, without
    a copy, so the caller hands each array over and never changes it again (a fresh array per
    output, as a kernel that copies its state to send it)."""
    run: str = ""
    """The campaign's run (``from_campaign`` sets it): every message carries it, and a server
    of another run drops it -- a message replayed from an earlier run is never this run's data."""

    def __post_init__(self) -> None:
        if self.hwm < 1 or self.send_timeout_s <= 0:
            raise ConfigError(f"Producer needs hwm >= 1 and send_timeout_s > 0, got {self.hwm}, {self.send_timeout_s}")
        self._check()
        # the header's parts that never change, serialised once (without its closing brace)
        self._header_json = json.dumps({
            "kind": "data", "campaign": self.campaign, **({"run": self.run} if self.run else {}), "sim": self.sim_id,
            "attempt": self.attempt, "rank": self.rank, "nranks": self.nranks, "global_shape": list(self.global_shape),
            "offset": list(self.offset), "shape": list(self.local_shape), "params": self.params},
            separators=(",", ":"))[:-1]
        self._names_json: dict[tuple, str] = {}
        wire = zmtp if self.endpoint.startswith(zmtp.SCHEME) else sender  # the address says which wire
        if wire is sender:
            sender.parse_endpoint(self.endpoint)  # a bad address fails here, in one line
        self._sock = wire.Sender(self.secret, hwm=self.hwm, timeout_s=self.send_timeout_s)
        self._sock.connect(self.endpoint)
        self._trainer_checked = False
        self.n_sent = 0
        self.bytes_sent = 0
        self.blocked_s = 0.0
        self._closed = False

    def _error(self, what: str) -> ConfigError:
        """A deterministic mistake: recorded for the campaign (no retry, the cause named), raised here."""
        return _final(f"simulation {self.sim_id} rank {self.rank}: {what}", self.sim_id, self.attempt)

    def _check(self) -> None:
        """Refuse now what the trainer's decoder and assembly would drop later (message.decode, server)."""
        try:
            ids = [operator.index(v) for v in (self.sim_id, self.attempt, self.rank, self.nranks)]
        except TypeError:
            raise self._error(f"sim_id, attempt, rank, nranks must be integers, got {self.sim_id!r}, "
                              f"{self.attempt!r}, {self.rank!r}, {self.nranks!r}") from None
        self.sim_id, self.attempt, self.rank, self.nranks = ids
        if not (0 <= self.sim_id <= message.MAX_ID and 0 <= self.attempt <= message.MAX_ID):
            raise self._error(f"sim_id {self.sim_id}, attempt {self.attempt}: expected integers in 0..{message.MAX_ID}")
        if not 0 <= self.rank < self.nranks <= message.MAX_RANKS:
            raise self._error(f"rank {self.rank} of nranks {self.nranks}, expected 0 <= rank < nranks <= "
                              f"{message.MAX_RANKS}")
        shapes = []
        for k in ("global_shape", "offset", "local_shape"):
            try:
                shapes.append(tuple(operator.index(x) for x in getattr(self, k)))
            except TypeError:
                raise self._error(f"{k}={getattr(self, k)!r} is not a sequence of integers, expected e.g. (nx,), "
                                  f"(nx, ny) or (nx, ny, nz)") from None
        self.global_shape, self.offset, self.local_shape = shapes
        problem = message.box_problem(*shapes, shape_name="local_shape")
        if problem:
            raise self._error(problem)
        if self.nranks == 1 and self.local_shape != self.global_shape:
            raise self._error(f"a one-rank simulation sends the whole field: local_shape {self.local_shape} must be "
                              f"global_shape {self.global_shape}")
        if not isinstance(self.params, Mapping):
            raise self._error(f"params={self.params!r}: expected a dict of names to numbers")
        params = {}
        for k, v in self.params.items():
            try:
                params[str(k)] = float(v)
            except (TypeError, ValueError):
                params[str(k)] = math.nan
            if not math.isfinite(params[str(k)]):
                raise self._error(f"params[{k!r}]={v!r}: expected a finite number") from None
        self.params = params
        if self.fields is not None:
            names = tuple(self.fields)
            if not (1 <= len(names) <= message.MAX_FIELDS and len(set(names)) == len(names)
                    and all(isinstance(n, str) for n in names)):
                raise self._error(f"fields {names!r}: expected 1 to {message.MAX_FIELDS} distinct names (strings)")
            self.fields = names

    @classmethod
    def from_campaign(cls, *, comm, params: dict[str, float], global_shape, offset, local_shape, fields=None,
                      sim_id: int | None = None, attempt: int | None = None, contract: Contract | None = None,
                      **kw) -> Producer:
        """The producer of this simulation rank in the campaign that started it: the secret,
        campaign and run from the contract (:meth:`~hpcml.contract.Contract.from_env`), the
        simulation id and attempt from the attempt wrapper, and the trainer rank this
        simulation routes to from this run's ``endpoints.json``, waited for up to
        ``HPCML_STREAM_WAIT_S`` (120 s) -- an earlier run's file is never used. ``comm`` is the
        simulation's communicator."""
        c = contract or Contract.from_env()
        sim = _env_int(ENV_SIM_ID) if sim_id is None else sim_id
        if not c.streams:  # the same in every attempt: recorded as final, so the campaign retries nothing
            raise _final(f"simulation {sim}: campaign {c.campaign!r} gives it no stream (no {ENV['secret_file']} or "
                         f"{ENV['endpoints_file']}): its training job takes none -- give it TrainingJob(stream=True), "
                         f"or write files instead of using a Producer",
                         sim, _env_int(ENV_ATTEMPT, 0) if attempt is None else attempt)
        wait = float(os.environ.get("HPCML_STREAM_WAIT_S", "120"))
        _, endpoints = read_endpoints(c.endpoints_file, timeout_s=wait, contract=c)
        p = cls(endpoint=endpoints[routing.route(sim, len(endpoints))], secret=routing.read_secret(c.secret_file),
                campaign=c.campaign, run=c.run, sim_id=sim,
                attempt=_env_int(ENV_ATTEMPT, 0) if attempt is None else attempt,
                rank=comm.Get_rank(), nranks=comm.Get_size(), params=params, global_shape=global_shape,
                offset=offset, local_shape=local_shape, fields=fields, **kw)
        p._check_tiling(comm, wait)
        return p

    def _check_tiling(self, comm, timeout_s: float) -> None:
        """Every rank of ``comm`` at once: the ranks' blocks tile the grid, or the decomposition's
        mistake is final here, named on every rank (the trainer would drop each sample as
        ``incomplete_cover``, after the whole campaign had run)."""
        if self.nranks == 1:
            return
        blocks = tiling.gather_blocks(comm, self.global_shape, self.offset, self.local_shape, timeout_s)
        if blocks is None:
            logger.warning("simulation %d rank %d: the ranks' blocks not checked (not every rank made its Producer "
                           "within %.0f s, or not an mpi4py communicator)", self.sim_id, self.rank, timeout_s)
            return
        problem = tiling.tiling_problem(*blocks)
        if problem:
            self._abandon()
            raise _final(f"simulation {self.sim_id}: {problem}", self.sim_id, self.attempt)

    from_env = from_campaign
    """The former name of :meth:`from_campaign`."""

    def _send(self, text: bytes, arrays=()) -> None:
        """One message of header ``text`` and ``arrays`` ((array, dtype) pairs): each array copied
        (and converted) once, straight into the message's one buffer (the wire's unit,
        :mod:`hpcml.stream.framing`), so the caller may overwrite it as soon as this returns."""
        message.check_header(text)
        t0 = time.perf_counter()
        try:
            sealed = self._sealed()
            if not self.copy and all(a.dtype == dtype and a.flags.c_contiguous for a, dtype in arrays):
                frames = [message.MAGIC, text, *[memoryview(a).cast("B") for a, _ in arrays]]
                if sealed:
                    frames.append(message.mac(self.secret, frames))
                self._sock.send_frames(frames)
            else:
                nbytes = [a.size * dtype.itemsize for a, dtype in arrays]
                buf, views = framing.frame_buffer([len(message.MAGIC), len(text), *nbytes,
                                                   *([message.MAC_BYTES] if sealed else [])])
                views[0][:], views[1][:] = message.MAGIC, text
                for (a, dtype), view in zip(arrays, views[2:]):
                    np.copyto(np.frombuffer(view, dtype).reshape(a.shape), a, casting="unsafe")
                if sealed:
                    views[-1][:] = message.mac(self.secret, views[:-1])
                self._sock.send_message(buf, views)
        except zmq.Again:
            self._abandon()
            raise LaunchError(f"simulation {self.sim_id} rank {self.rank}: trainer at {self.endpoint} took no data for "
                              f"{self.send_timeout_s:.0f} s") from None
        except HandshakeError as e:
            self._abandon()
            raise self._error(f"trainer at {self.endpoint}: {e}") from None
        self.blocked_s += time.perf_counter() - t0

    def _sealed(self) -> bool:
        """Whether messages carry a MAC: always on the zmtp wire; on the framed one unless the
        trainer said at the handshake that the challenge is enough (``integrity="connection"``),
        and always before any handshake finished (a sealed message is taken by every server)."""
        info = getattr(self._sock, "info", None)
        return not (isinstance(info, dict) and info.get("integrity") == "connection")

    def _abandon(self) -> None:
        """Stop at once (nothing more is waited for at exit) after an error that ends this producer."""
        self._closed = True
        self._sock.close(linger=0)

    def _check_trainer(self, names: Sequence[str]) -> None:
        """Before the first message leaves: what the trainer said of itself at the handshake
        (campaign, run, fields, parameters, grid) against what this producer sends."""
        try:
            info = self._sock.wait_info(self.send_timeout_s)
        except HandshakeError as e:
            self._abandon()
            raise self._error(f"trainer at {self.endpoint}: {e}") from None
        if info is None:
            if isinstance(self._sock, zmtp.Sender):
                self._trainer_checked = True
                return
            self._abandon()
            raise LaunchError(f"simulation {self.sim_id} rank {self.rank}: no trainer answered at {self.endpoint} for "
                              f"{self.send_timeout_s:.0f} s")
        problem = trainer_mismatch(info, campaign=self.campaign, run=self.run, fields=names, params=self.params,
                                   global_shape=self.global_shape)
        if problem:
            self._abandon()
            raise self._error(f"{problem} (trainer rank {info.get('rank')} at {self.endpoint}): it would drop every "
                              f"sample; fix the simulation or the trainer's configuration")
        self._trainer_checked = True

    def send(self, step: int, t: float, fields: dict[str, np.ndarray]) -> None:
        """Send this rank's subdomain of every field at output ``step`` (arrays are copied first,
        so the simulation may overwrite them as soon as this returns)."""
        if self._closed:
            raise LaunchError("Producer.send after close()")
        try:
            step_i = operator.index(step)
        except TypeError:
            step_i = -1
        if not 0 <= step_i <= message.MAX_ID:
            raise self._error(f"step={step!r}: expected an integer in 0..{message.MAX_ID}")
        try:
            t_f = float(t)
        except (TypeError, ValueError):
            t_f = math.nan
        if not math.isfinite(t_f):
            raise self._error(f"t={t!r}: expected a finite number")
        t = t_f
        if not isinstance(fields, Mapping):
            raise self._error(f"fields must map names to arrays, got {type(fields).__name__}")
        if not 1 <= len(fields) <= message.MAX_FIELDS:
            raise self._error(f"{len(fields)} fields, expected 1 to {message.MAX_FIELDS}")
        for name in fields:
            if not isinstance(name, str):
                raise self._error(f"field name {name!r} is not a string")
        if self.fields is not None and set(fields) != set(self.fields):
            raise self._error(f"fields {sorted(fields)} are not the declared fields {sorted(self.fields)}")
        arrays, names = [], []
        for name, a in fields.items():
            a = np.asarray(a)
            if a.dtype.kind not in "biuf":
                raise self._error(f"field {name!r} has dtype {a.dtype}, expected real numbers (sent as float32, "
                                  f"float64 as float64)")
            if tuple(a.shape) != self.local_shape:
                raise self._error(f"field {name!r} has shape {tuple(a.shape)}, expected the subdomain "
                                  f"{self.local_shape}")
            if a.dtype.kind == "f" and not np.isfinite(a).all():  # ~24 us a MiB: one sample would make every weight NaN
                bad, nan = ~np.isfinite(a), int(np.isnan(a).sum())
                first = tuple(int(i) for i in np.unravel_index(int(np.flatnonzero(bad)[0]), a.shape))
                raise self._error(f"field {name!r} at step {step_i} holds {nan} NaN and "
                                  f"{int(bad.sum()) - nan} infinite values of {a.size} (the first "
                                  f"at {first} of this rank's subdomain): the simulation diverged or left them unset; "
                                  f"only finite values are sent (one such sample would make every weight of the "
                                  f"surrogate NaN) -- mask them with finite values first (np.nan_to_num)")
            if a.dtype.kind in "iu" and a.size and a.dtype.itemsize >= 4 and (
                    int(a.max()) > EXACT_F32 or int(a.min()) < -EXACT_F32):  # float32 holds integers to 2^24 exactly
                raise self._error(f"field {name!r} holds integers from {int(a.min())} to {int(a.max())}: sent as "
                                  f"float32, which holds integers exactly only within +-{EXACT_F32} (the values would "
                                  f"arrive rounded) -- send them as float64 (a.astype(np.float64))")
            dtype = np.dtype(np.float64 if a.dtype == np.float64 else np.float32)
            if a.size * dtype.itemsize > message.MAX_FRAME_BYTES:
                raise self._error(f"field {name!r} of this rank is {a.size * dtype.itemsize} bytes, more than the "
                                  f"{message.MAX_FRAME_BYTES} a stream server reads in one frame: use more ranks")
            arrays.append((a, dtype))
            names.append([name, dtype.name])
        if not self._trainer_checked:
            self._check_trainer([n for n, _ in names])
        names_json = self._names_json.get(key := tuple(map(tuple, names)))
        if names_json is None:
            names_json = self._names_json[key] = json.dumps(names, separators=(",", ":"))
        text = f'{self._header_json},"step":{step_i},"t":{t!r},"fields":{names_json},"nonce":"{message.nonce()}"}}'
        self._send(text.encode(), arrays)
        self.n_sent += 1
        self.bytes_sent += sum(a.size * dtype.itemsize for a, dtype in arrays)

    def close(self) -> None:
        """Send the end marker and wait (up to the send timeout) until everything queued has left."""
        if self._closed:
            return
        header = {"kind": "end", "campaign": self.campaign, **({"run": self.run} if self.run else {}),
                  "sim": self.sim_id, "attempt": self.attempt, "rank": self.rank, "nranks": self.nranks,
                  "n_sent": self.n_sent}
        self._send(message.header_text(header))
        self._closed = True
        self._sock.close()  # waits until the trainer took every message (at most send_timeout_s)
        if self._sock.undelivered:
            raise LaunchError(f"simulation {self.sim_id} rank {self.rank}: the trainer at {self.endpoint} had not "
                              f"taken {self._sock.undelivered} message(s) after {self.send_timeout_s:.0f} s")
        if self.rank == 0:  # what this simulation streamed, for the driver's done record
            write_stream_record(self.n_sent, self.bytes_sent, self.sim_id, self.attempt)
