"""The stream's wire format and routing, and what a Producer refuses before anything is sent."""

from __future__ import annotations

import numpy as np
import pytest

from hpcml.errors import ConfigError
from hpcml.stream import Producer, message, route

SECRET = b"k" * 32
CAMPAIGN = "test-campaign"


def _header(**kw):
    h = {"kind": "data", "campaign": CAMPAIGN, "sim": 3, "attempt": 0, "rank": 0, "nranks": 1, "step": 5, "t": 0.5,
         "global_shape": [4, 3], "offset": [0, 0], "shape": [4, 3], "fields": [["T", "float32"]],
         "params": {"alpha": 0.1}}
    h.update(kw)
    return h


def test_message_round_trip_is_exact():
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    frames = message.encode(SECRET, _header(), [a])
    msg = message.decode(SECRET, [bytes(f) for f in frames], CAMPAIGN)
    assert msg.kind == "data" and msg.header["step"] == 5
    np.testing.assert_array_equal(msg.arrays["T"], a)
    assert msg.nbytes == 48


@pytest.mark.parametrize("mutate, reason", [
    (lambda f: f[:2] + [f[-1]], "unauthenticated"),  # a payload frame dropped: the MAC covers every frame
    (lambda f: [f[0], f[1], b"x" * 48, f[-1]], "unauthenticated"),      # payload tampered
    (lambda f: [b"nope"] + f[1:], "malformed"),
    (lambda f: f[:-1] + [b"short"], "malformed"),
])
def test_tampered_messages_are_rejected_with_a_reason(mutate, reason):
    frames = [bytes(f) for f in message.encode(SECRET, _header(), [np.zeros((4, 3), np.float32)])]
    with pytest.raises(message.MessageError) as e:
        message.decode(SECRET, mutate(frames), CAMPAIGN)
    assert e.value.reason == reason


@pytest.mark.parametrize("header, payload, reason", [
    (_header(), np.zeros((2, 3), np.float32), "truncated"),               # authenticated but short payload
    (_header(offset=[2, 0]), np.zeros((4, 3), np.float32), "bad_header"),  # box outside the grid
    (_header(campaign="other"), np.zeros((4, 3), np.float32), "wrong_campaign"),
    (_header(kind="exec"), np.zeros((4, 3), np.float32), "bad_header"),
    (_header(fields=[["T", "object"]]), np.zeros((4, 3), np.float32), "bad_header"),
    (_header(rank=1), np.zeros((4, 3), np.float32), "bad_header"),          # rank >= nranks
    (_header(global_shape=[], offset=[], shape=[]), np.zeros(1, np.float32), "bad_header"),  # 0-D
    (_header(global_shape=[2] * 4, offset=[0] * 4, shape=[2] * 4), np.zeros(16, np.float32), "bad_header"),  # 4-D
    (_header(offset=[0]), np.zeros((4, 3), np.float32), "bad_header"),     # offset of another rank than the field
])
def test_authenticated_but_invalid_messages_are_rejected(header, payload, reason):
    with pytest.raises(message.MessageError) as e:
        message.decode(SECRET, [bytes(f) for f in message.encode(SECRET, header, [payload])], CAMPAIGN)
    assert e.value.reason == reason


@pytest.mark.parametrize("gshape, offset, shape", [([8], [4], [4]), ([4, 6, 5], [0, 3, 0], [4, 3, 5])])
def test_message_round_trip_of_1d_and_3d_blocks(gshape, offset, shape):
    a = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    h = _header(global_shape=gshape, offset=offset, shape=shape, fields=[["T", "float64"]])
    msg = message.decode(SECRET, [bytes(f) for f in message.encode(SECRET, h, [a])], CAMPAIGN)
    assert msg.arrays["T"].shape == tuple(shape)
    np.testing.assert_array_equal(msg.arrays["T"], a)


def test_wrong_secret_is_unauthenticated():
    frames = [bytes(f) for f in message.encode(b"x" * 32, _header(), [np.zeros((4, 3), np.float32)])]
    with pytest.raises(message.MessageError, match="unauthenticated"):
        message.decode(SECRET, frames, CAMPAIGN)


def test_routing_gives_every_trainer_a_simulation_and_balances_exactly():
    """Simulations 0..S-1 on n <= S trainer ranks: every rank gets one, counts differ by at most 1."""
    for n_sims in range(1, 33):
        for n in range(1, n_sims + 1):
            counts = np.bincount([route(s, n) for s in range(n_sims)], minlength=n)
            assert len(counts) == n and counts.min() >= 1 and counts.max() - counts.min() <= 1, (n_sims, n, counts)
    assert [route(s, 2) for s in range(3)] == [0, 1, 0]  # the user's case: 3 simulations, 2 trainer ranks
    assert route(np.int64(7), 3) == 1                      # ids read from files are numpy integers
    with pytest.raises(ConfigError, match="n_trainers must be >= 1, got 0"):
        route(1, 0)
    with pytest.raises(ConfigError, match="^sim_id -1: expected an integer >= 0$"):
        route(-1, 2)


_BASE = dict(endpoint="tcp://127.0.0.1:9", secret=SECRET, campaign=CAMPAIGN, sim_id=0, attempt=0, rank=0, nranks=1,
             params={"alpha": 0.5}, global_shape=(8, 4), offset=(0, 0), local_shape=(8, 4))


@pytest.mark.parametrize("kw, error", [
    (dict(global_shape=(), offset=(), local_shape=()),
     "simulation 0 rank 0: global_shape () has 0 dimensions, expected 1 to 3"),
    (dict(global_shape=(2,) * 4, offset=(0,) * 4, local_shape=(2,) * 4),
     "simulation 0 rank 0: global_shape (2, 2, 2, 2) has 4 dimensions, expected 1 to 3"),
    (dict(global_shape=128, offset=(0,), local_shape=(128,)),
     "simulation 0 rank 0: global_shape=128 is not a sequence of integers, expected e.g. (nx,), (nx, ny) or "
     "(nx, ny, nz)"),
    (dict(offset=(0,)), "simulation 0 rank 0: offset (0,) and local_shape (8, 4) need 2 entries like global_shape "
                        "(8, 4)"),
    (dict(nranks=2, offset=(4, 0)),
     "simulation 0 rank 0: the block at offset (4, 0) of local_shape (8, 4) lies outside global_shape (8, 4)"),
    (dict(nranks=2, local_shape=(0, 4)),
     "simulation 0 rank 0: global_shape (8, 4) and local_shape (0, 4) need entries >= 1, offset (0, 0) entries >= 0"),
    (dict(local_shape=(4, 4)), "simulation 0 rank 0: a one-rank simulation sends the whole field: local_shape (4, 4) "
                               "must be global_shape (8, 4)"),
    (dict(rank=2, nranks=2), "simulation 0 rank 2: rank 2 of nranks 2, expected 0 <= rank < nranks <= 1048576"),
    (dict(sim_id=-1), "simulation -1 rank 0: sim_id -1, attempt 0: expected integers in 0..9007199254740991"),
    (dict(sim_id=2**64), "simulation 18446744073709551616 rank 0: sim_id 18446744073709551616, attempt 0: expected "
                         "integers in 0..9007199254740991"),
    (dict(params={"alpha": float("nan")}), "simulation 0 rank 0: params['alpha']=nan: expected a finite number"),
    (dict(params={"alpha": "fast"}), "simulation 0 rank 0: params['alpha']='fast': expected a finite number"),
    (dict(fields=("T", "T")), "simulation 0 rank 0: fields ('T', 'T'): expected 1 to 16 distinct names (strings)"),
])
def test_producer_refuses_at_construction_what_the_server_would_drop(kw, error):
    with pytest.raises(ConfigError) as e:
        Producer(**{**_BASE, **kw})
    assert str(e.value) == error


@pytest.mark.parametrize("step, fields, error", [
    (1, {"T": np.zeros((8, 4), np.complex64)},
     "field 'T' has dtype complex64, expected real numbers (sent as float32, float64 as float64)"),
    (1, {"T": np.full((8, 4), "x")}, "field 'T' has dtype <U1, expected real numbers (sent as float32, float64 as "
                                     "float64)"),
    (1, {"U": np.zeros((8, 4))}, "fields ['U'] are not the declared fields ['T']"),
    (1, {}, "0 fields, expected 1 to 16"),
    (-1, {"T": np.zeros((8, 4))}, "step=-1: expected an integer in 0..9007199254740991"),
    (1.5, {"T": np.zeros((8, 4))}, "step=1.5: expected an integer in 0..9007199254740991"),
    (10**30, {"T": np.zeros((8, 4))}, f"step={10**30}: expected an integer in 0..9007199254740991"),
])
def test_producer_refuses_at_send_what_the_server_would_drop(step, fields, error):
    p, q = Producer(**_BASE, fields=("T",)), Producer(**_BASE)
    try:
        with pytest.raises(ConfigError) as e:
            p.send(step, 0.0, fields)
        assert str(e.value) == f"simulation 0 rank 0: {error}" and p.n_sent == 0
        with pytest.raises(ConfigError) as e:  # nothing declared: names are still checked
            q.send(1, 0.0, {"T": np.zeros((8, 4)), 3: np.zeros((8, 4))})
        assert str(e.value) == "simulation 0 rank 0: field name 3 is not a string"
    finally:
        for x in (p, q):
            x._sock.close(linger=0)


def test_a_message_without_a_mac_is_taken_only_from_an_authenticated_connection():
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    bare = [bytes(f) for f in message.encode(SECRET, _header(), [a], sealed=False)]
    assert len(bare) == 3  # magic, header, payload
    np.testing.assert_array_equal(message.decode(SECRET, bare, CAMPAIGN, authenticated=True).arrays["T"], a)
    with pytest.raises(message.MessageError, match="malformed: no MAC frame"):  # the payload is no MAC
        message.decode(SECRET, bare, CAMPAIGN)
    sealed = [bytes(f) for f in message.encode(SECRET, _header(), [a])]
    assert message.decode(SECRET, sealed, CAMPAIGN, authenticated=True).header["step"] == 5  # checked all the same
    with pytest.raises(message.MessageError, match="unauthenticated: MAC mismatch"):
        message.decode(SECRET, sealed[:-1] + [bytes(16)], CAMPAIGN, authenticated=True)
    end = [bytes(f) for f in message.encode(SECRET, {"kind": "end", "campaign": CAMPAIGN, "sim": 3, "attempt": 0,
                                                     "rank": 0, "nranks": 1, "n_sent": 2}, sealed=False)]
    assert message.decode(SECRET, end, CAMPAIGN, authenticated=True).kind == "end" and len(end) == 2
    with pytest.raises(message.MessageError, match=r"truncated: field T: 16 bytes, expected 48"):
        message.decode(SECRET, bare[:2] + [bytes(16)], CAMPAIGN, authenticated=True)  # short: no MAC, a short payload


def test_parameters_past_float32_are_refused_at_the_exact_rounding_edge():
    from hpcml.stream.schema import SampleSchema

    s = SampleSchema(("T",), ("a",))
    edge = 2.0**128 - 2.0**103  # rounds to infinity in float32; the float64 just below it to the largest float32
    assert s.params_vector({"a": np.nextafter(edge, 0)})[0] == np.finfo(np.float32).max
    assert s.params_vector({"a": -np.nextafter(edge, 0)})[0] == -np.finfo(np.float32).max
    for v in (edge, -edge, 1e300):
        with pytest.raises(message.MessageError, match="bad_header: parameters .* overflow float32"):
            s.params_vector({"a": v})
