"""The wire format of streamed simulation data: JSON header + raw arrays + HMAC, never pickle.

A message is a list of frames (one framed message on the wire, :mod:`hpcml.stream.framing`;
one multipart message on the zmtp wire)::

    [b"hpcml-stream/2", header (UTF-8 JSON), payload_0, ..., payload_{k-1}, mac (16 bytes)]

The ``mac`` frame may be left out on a connection whose peer answered the framed wire's
challenge (``ServerConfig(integrity="connection")``, the default: :func:`decode` with
``authenticated=True``); one that is there is checked all the same.

``mac`` is a GMAC tag (AES-256-GCM over authenticated data only, 16 bytes) over the frame
count and every frame's length, then every frame before it, so frames cannot be moved
between messages or re-split. Its one-time key is HMAC-SHA256(secret, header), and every
header carries a fresh random 128-bit ``nonce``, so no key is ever used twice (which is
what makes the fixed GCM IV safe) -- the construction of NaCl's secretbox and of
ChaCha20-Poly1305, with HMAC as the key derivation and GMAC as the one-time MAC. GMAC
(OpenSSL, AES-NI and carry-less multiply) runs at ~19 GB/s here, Poly1305 at ~12 GB/s,
HMAC-SHA256 at ~1.8 GB/s: authentication stays far below the cost of moving the bytes. Payloads
are the C-order bytes of one field of one rank's subdomain, dtype float32 or float64 as
the header says; fields have 1 to ``MAX_DIMS`` dimensions (1-D, 2-D and 3-D solvers). A
receiver checks the MAC first (where it is required) and then every number in the header against the payload
sizes before it touches the arrays: anything malformed or unauthenticated raises
:class:`MessageError`, which the server counts and drops.

Kinds: ``data`` (one rank's subdomain of one output step) and ``end`` (a simulation rank is
done: how many messages it sent). The end of the campaign is not a message: the driver
writes it into the run directory (:class:`hpcml.contract.DoneRecord`).
Importing this module must stay cheap (no torch): simulations import it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import struct
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from hpcml.errors import ConfigError, HpcmlError
from hpcml.numeric import is_int, is_real

MAGIC = b"hpcml-stream/2"
"""Version 2: GMAC tags (version 1 had Poly1305)."""
MAC_BYTES = 16
_DTYPES = {"float32": np.float32, "float64": np.float64}
#: Largest header frame (JSON) a receiver reads.
MAX_HEADER_BYTES = 64 * 1024
MAX_FIELDS = 16
MAX_DIMS = 3
#: magic, header, one payload per field, MAC: a longer message is refused before decoding.
MAX_FRAMES = MAX_FIELDS + 3
#: Simulation ids, attempts, steps and counts: what JSON, int64 state arrays and float64 all hold exactly.
MAX_ID = 2**53 - 1
#: Ranks of one simulation.
MAX_RANKS = 2**20
#: Largest frame a server reads by default (``ZMQ_MAXMSGSIZE``): one field of one rank's block.
MAX_FRAME_BYTES = 1 << 30
KINDS = ("data", "end")


class MessageError(HpcmlError, ValueError):
    """A message failed authentication or validation; ``reason`` is a short counter key."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


_IV = bytes(12)
"""GCM's IV may be fixed: every message has a key of its own (HMAC of a header with a fresh nonce)."""


def mac(secret: bytes, frames) -> bytes:
    """GMAC tag over the frame count, every frame length (one block up front) and the frames,
    under the one-time key HMAC(secret, header frame)."""
    bufs = [f if type(f) is bytes else memoryview(f).cast("B") for f in frames]
    key = hmac.new(secret, bufs[1], hashlib.sha256).digest()
    tagger = Cipher(algorithms.AES(key), modes.GCM(_IV)).encryptor()
    add = tagger.authenticate_additional_data
    add(struct.pack(f"<{len(bufs) + 1}Q", len(bufs), *[len(b) for b in bufs]))
    for b in bufs:
        add(b)
    tagger.finalize()
    return tagger.tag


def box_problem(global_shape, offset, shape, shape_name: str = "shape") -> str | None:
    """Why a block (``offset``, ``shape``) of a field of ``global_shape`` cannot be assembled,
    or None: one rule for the decoder and the Producer, so a sender refuses what a receiver would drop."""
    g, o, s = (tuple(x) for x in (global_shape, offset, shape))
    if not 1 <= len(g) <= MAX_DIMS:
        return f"global_shape {g} has {len(g)} dimensions, expected 1 to {MAX_DIMS}"
    if len(o) != len(g) or len(s) != len(g):
        return f"offset {o} and {shape_name} {s} need {len(g)} entries like global_shape {g}"
    if min(g + s) < 1 or min(o) < 0:
        return f"global_shape {g} and {shape_name} {s} need entries >= 1, offset {o} entries >= 0"
    if any(a + b > c for a, b, c in zip(o, s, g)):
        return f"the block at offset {o} of {shape_name} {s} lies outside global_shape {g}"
    return None


def encode(secret: bytes, header: dict, payloads: list[np.ndarray] = (), *, sealed: bool = True) -> list:
    """Frames of one message (a fresh nonce goes into the header). Payloads are passed as buffers, not copied.
    A header the receiver would refuse for its size is a ConfigError here, at the sender."""
    return seal(secret, header_text(header), payloads, sealed=sealed)


def header_text(header: dict) -> bytes:
    """A header as a message carries it: compact JSON with a fresh nonce."""
    return json.dumps({**header, "nonce": nonce()}, separators=(",", ":")).encode()


def nonce() -> str:
    """A fresh random 128-bit nonce, as a header carries it."""
    return os.urandom(16).hex()


def seal(secret: bytes, text: bytes, payloads=(), *, sealed: bool = True) -> list:
    """Frames of one message whose header is already JSON text (with its nonce): the
    Producer serialises the parts of its header that never change once. ``sealed=False``:
    no MAC frame, for a connection that proved the secret (``decode(authenticated=True)``)."""
    check_header(text)
    frames = [MAGIC, text] + [memoryview(np.ascontiguousarray(p)).cast("B") for p in payloads]
    if sealed:
        frames.append(mac(secret, frames))
    return frames


def check_header(text: bytes) -> None:
    """A header the receiver would refuse for its size is a ConfigError at the sender."""
    if len(text) > MAX_HEADER_BYTES:
        raise ConfigError(f"message header of {len(text)} bytes, expected at most {MAX_HEADER_BYTES} (fewer or "
                          f"shorter params, field names or simulation ids)")


@dataclass
class Message:
    """A validated message: the header and, for ``data``, the named local arrays (views of the frames)."""

    header: dict
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.header["kind"]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def _need(cond: bool, reason: str, detail) -> None:
    """``detail``: the text, or a function making it (only a refusal pays for the message)."""
    if not cond:
        raise MessageError(reason, detail() if callable(detail) else detail)


def _is_int(x, lo: int = 0, hi: int = MAX_ID) -> bool:
    return is_int(x) and lo <= x <= hi


def _ints(h: dict, key: str, n: int | None, lo: int = 0, hi: int = MAX_ID) -> list[int]:
    v = h.get(key)
    if n is None:
        _need(_is_int(v, lo, hi), "bad_header", lambda: f"{key}={_short(v)}, expected an integer in {lo}..{hi}")
        return [v]
    _need(isinstance(v, list) and len(v) == n and all(_is_int(x, lo, hi) for x in v), "bad_header",
          lambda: f"{key}={_short(v)}, expected {n} integers in {lo}..{hi}")
    return v


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


_JSON = json.JSONDecoder(parse_constant=_no_constant)
"""One decoder for every header (``json.loads`` with an option builds one a call)."""


def _finite(v) -> bool:
    return is_real(v) and math.isfinite(v)


def decode(secret: bytes, frames: list, campaign: str, run: str | None = None, *,
           authenticated: bool = False) -> Message:
    """Authenticate and validate ``frames`` (bytes or zmq Frames) of ``campaign`` (and, given,
    ``run``: a message that names another run is refused): a :class:`Message`, or
    :class:`MessageError` -- never another exception, whatever the input.

    ``authenticated``: the frames came over a connection whose peer proved the secret (the
    framed wire's challenge, :mod:`hpcml.stream.handshake`), so a message may come without a
    MAC frame (:func:`seal` with ``sealed=False``); one that has a MAC frame is checked all the
    same. Otherwise the MAC frame is required and checked before anything else is parsed."""
    try:
        return _decode(secret, frames, campaign, run, authenticated)
    except MessageError:
        raise
    except Exception as e:  # a check this module missed: still a drop with a reason, never a dead server
        raise MessageError("bad_header", f"{type(e).__name__}: {_short(str(e))}") from None


def _check_mac(secret: bytes, raw: list) -> None:
    _need(memoryview(raw[-1]).nbytes == MAC_BYTES, "malformed", "no MAC frame")
    _need(hmac.compare_digest(mac(secret, raw[:-1]), bytes(raw[-1])), "unauthenticated", "MAC mismatch")


def _decode(secret: bytes, frames: list, campaign: str, run: str | None, authenticated: bool) -> Message:
    raw = [f.buffer if hasattr(f, "buffer") else f for f in frames]
    lo = 2 if authenticated else 3
    _need(lo <= len(raw) <= MAX_FRAMES, "malformed", lambda: f"{len(raw)} frames, expected {lo} to {MAX_FRAMES}")
    _need(raw[0] == MAGIC, "malformed", "wrong magic")
    _need(memoryview(raw[1]).nbytes <= MAX_HEADER_BYTES, "malformed", "header too large")
    if not authenticated:
        _check_mac(secret, raw)
    try:
        h = _JSON.decode(str(raw[1], "utf-8"))
    except ValueError as e:  # UnicodeDecodeError too
        raise MessageError("bad_header", f"not JSON: {e}") from None
    _need(isinstance(h, dict) and h.get("kind") in KINDS, "bad_header",
          lambda: f"kind={h.get('kind') if isinstance(h, dict) else h!r}")
    if authenticated:  # sealed or not: the frames the header announces tell
        fields = h.get("fields")
        k = 2 + (len(fields) if h["kind"] == "data" and type(fields) is list else 0)
        if len(raw) == k + 1:
            _check_mac(secret, raw)
        else:
            raw = raw + [b""]  # the payloads are raw[2:-1] either way
    _need(h.get("campaign") == campaign, "wrong_campaign", lambda: f"campaign={_short(h.get('campaign'))}")
    _need(not run or h.get("run", "") == run, "wrong_campaign", lambda: f"run={_short(h.get('run'))}, "
          f"not this run's {run!r} (a message of an earlier run, or of none: "
          "a server tied to a run takes only its own)")
    payloads = raw[2:-1]
    if h["kind"] == "data" and _data_ok(h, payloads):  # the common case, checked at once
        shape = h["shape"]
        return Message(h, {f[0]: np.frombuffer(b, _DTYPES[f[1]]).reshape(shape) for f, b in zip(h["fields"], payloads)})
    return _checked(h, payloads)


def _data_ok(h: dict, payloads: list) -> bool:
    """Whether a data header passes every check of :func:`_checked` (which names what failed)."""
    try:
        return _data_fits(h, payloads)
    except Exception:  # a missing key, an unhashable dtype, an int too large for a float: _checked says
        return False


def _data_fits(h: dict, payloads: list) -> bool:
    sim, attempt, rank, nranks, step, t = h["sim"], h["attempt"], h["rank"], h["nranks"], h["step"], h["t"]
    g, o, s, params, fields = h["global_shape"], h["offset"], h["shape"], h["params"], h["fields"]
    if not (type(sim) is int and type(attempt) is int and type(rank) is int and type(nranks) is int
            and type(step) is int and 0 <= sim <= MAX_ID and 0 <= attempt <= MAX_ID and 0 <= step <= MAX_ID
            and 0 <= rank < nranks <= MAX_RANKS and type(t) in (int, float) and math.isfinite(t)):
        return False
    if not (type(g) is list and type(o) is list and type(s) is list and 1 <= len(g) <= MAX_DIMS
            and len(o) == len(g) == len(s)):
        return False
    for a, b, c in zip(o, s, g):
        if not (type(a) is int and type(b) is int and type(c) is int and 0 <= a and 1 <= b and a + b <= c <= MAX_ID):
            return False
    if not (type(params) is dict and all(type(v) in (int, float) and math.isfinite(v) for v in params.values())):
        return False
    if not (type(fields) is list and 1 <= len(fields) <= MAX_FIELDS and len(fields) == len(payloads)):
        return False
    n = math.prod(s)
    names = set()
    for f, buf in zip(fields, payloads):
        if not (type(f) is list and len(f) == 2 and type(f[0]) is str and f[1] in _DTYPES and f[0] not in names
                and memoryview(buf).nbytes == n * (4 if f[1] == "float32" else 8)):
            return False
        names.add(f[0])
    return True


def _checked(h: dict, payloads: list) -> Message:
    """Every check of a header, each naming what it found: an end marker, or a data message
    :func:`_data_ok` refused (this says why)."""
    sim, attempt, rank = (_ints(h, k, None)[0] for k in ("sim", "attempt", "rank"))
    nranks = _ints(h, "nranks", None, 1, MAX_RANKS)[0]
    _need(rank < nranks, "bad_header", lambda: f"rank {rank} of {nranks}")
    if h["kind"] == "end":
        _ints(h, "n_sent", None)
        _need(not payloads, "malformed", "end message with payload")
        return Message(h)
    _ints(h, "step", None)
    _need(_finite(h.get("t")), "bad_header", lambda: f"t={_short(h.get('t'))}, expected a finite number")
    gshape = h.get("global_shape")
    _need(isinstance(gshape, list) and 1 <= len(gshape) <= MAX_DIMS, "bad_header",
          lambda: f"global_shape={_short(gshape)}, expected 1 to {MAX_DIMS} dimensions")
    gshape, offset, shape = (_ints(h, k, len(gshape)) for k in ("global_shape", "offset", "shape"))
    problem = box_problem(gshape, offset, shape)
    _need(problem is None, "bad_header", lambda: str(problem))
    params = h.get("params")
    _need(isinstance(params, dict) and all(_finite(v) for v in params.values()), "bad_header",
          lambda: f"params={_short(params)}, expected names mapped to finite numbers")
    fields = h.get("fields")
    _need(isinstance(fields, list) and 1 <= len(fields) <= MAX_FIELDS and len(fields) == len(payloads),
          "malformed", lambda: f"{len(payloads)} payloads for fields {_short(fields)}")
    arrays = {}
    for f, buf in zip(fields, payloads):
        _need(isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) and isinstance(f[1], str)
              and f[1] in _DTYPES, "bad_header",
              lambda: f"field entry {_short(f)}, expected [name, 'float32' or 'float64']")
        name, dtype = f
        _need(name not in arrays, "bad_header", lambda: f"field {_short(name)} named twice")
        np_t = _DTYPES[dtype]
        expect = math.prod(shape) * np.dtype(np_t).itemsize
        _need(memoryview(buf).nbytes == expect, "truncated",
              lambda: f"field {name}: {memoryview(buf).nbytes} bytes, expected {expect}")
        arrays[name] = np.frombuffer(buf, dtype=np_t).reshape(shape)
    return Message(h, arrays)
