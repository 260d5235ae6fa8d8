"""The streaming path in one process: a real ZeroMQ server thread fed by real producers over
loopback (assembly, dedup, retries, backpressure, state and restores). The wire format is
tested in test_stream_message.py, the buffers in test_stream_buffer.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hpcml.stream import Buffer, BufferConfig, Producer, message, route, write_endpoints
from hpcml.contract import DoneRecord
from hpcml.errors import ConfigError, LaunchError
from hpcml.stream.sender import Sender
from hpcml.stream.server import ServerConfig, StreamServer
from tests.unit.test_stream_message import CAMPAIGN, SECRET, _header


def _server(n_trainers=1, rank=0, policy="fifo", capacity=64, watermark=1):
    buf = Buffer(BufferConfig(policy=policy, capacity=capacity, watermark=watermark))
    srv = StreamServer(campaign=CAMPAIGN, secret=SECRET, rank=rank, n_trainers=n_trainers, buffer=buf,
                       config=ServerConfig(param_names=("alpha",), field_names=("T",), end_grace_s=5))
    return srv.start()


def _producers(srv, sim, attempt, field, nranks=2, axis=0):
    """One producer per simulation rank, splitting ``field`` (any rank) along ``axis``."""
    n = field.shape[axis]
    out = []
    for r in range(nranks):
        x0, x1 = r * n // nranks, (r + 1) * n // nranks
        offset, local = [0] * field.ndim, list(field.shape)
        offset[axis], local[axis] = x0, x1 - x0
        p = Producer(endpoint=srv.endpoint, secret=SECRET, campaign=CAMPAIGN, sim_id=sim, attempt=attempt, rank=r,
                     nranks=nranks, params={"alpha": 0.5}, global_shape=field.shape, offset=tuple(offset),
                     local_shape=tuple(local))
        out.append((p, tuple(slice(o, o + s) for o, s in zip(offset, local))))
    return out


def _wait(cond, timeout=10.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.01)


def _send_all(prods, steps, field):
    for step in steps:
        for p, sl in prods:
            p.send(step, 0.1 * step, {"T": field[sl] + step})


def test_server_assembles_dedups_retries_and_ends():
    srv = _server()
    try:
        field = np.random.default_rng(0).random((6, 5)).astype(np.float32)
        # attempt 0 sends steps 1, 2 whole and only rank 0's half of step 3, then "dies"
        a0 = _producers(srv, 0, 0, field)
        _send_all(a0, (1, 2), field)
        a0[0][0].send(3, 0.3, {"T": field[a0[0][1]] + 3})
        _wait(lambda: srv.counters["samples"] == 2 and srv.counters["messages"] == 5)
        assert len(srv.ingest.assembly) == 1
        # attempt 1 re-sends everything: steps 1, 2 are duplicates, the half of step 3 is discarded
        a1 = _producers(srv, 0, 1, field)
        _send_all(a1, (1, 2, 3), field)
        for p, _ in a1:
            p.close()
        _wait(lambda: srv.counters["samples"] == 3 and srv.counters["messages"] == 13)  # sockets interleave
        a0[1][0].send(3, 0.3, {"T": field[a0[1][1]] + 3})  # a late fragment of the dead attempt
        _wait(lambda: srv.counters["samples"] == 3 and srv.dropped.get("stale_attempt") == 1)
        assert srv.counters["duplicates"] == 2 and srv.counters["partial_discarded"] == 1
        assert sorted(srv.seen) == [(0, 1), (0, 2), (0, 3)]
        got = {s.step: s for s in srv.buffer.get(3)}
        for step in (1, 2, 3):  # assembled from both halves, bit for bit
            np.testing.assert_array_equal(got[step].fields[0], field + step)
            assert got[step].params.tolist() == [0.5] and got[step].t == pytest.approx(0.1 * step)
        assert not srv.buffer.ended
        srv.campaign_done(DoneRecord(completed=[0], failed=[], streamed={0: 3}))  # all 3 in: it ends at once
        _wait(lambda: srv.buffer.ended, timeout=2)
        assert srv.accounting() == {"expected": {0: 3}, "ingested": {0: 3}, "silent": []}
    finally:
        srv.stop()


def test_server_counts_and_survives_bad_messages():
    srv = _server()
    try:
        push = Sender(SECRET)
        push.connect(srv.endpoint)
        good = [bytes(f) for f in message.encode(SECRET, _header(sim=0, nranks=1), [np.ones((4, 3), np.float32)])]
        push.send_multipart([b"garbage"])                                            # malformed
        push.send_multipart(good[:2] + [b"\0" * 48, good[-1]])                       # tampered: unauthenticated
        push.send_multipart([bytes(f) for f in message.encode(b"z" * 32, _header(sim=0),
                                                              [np.ones((4, 3), np.float32)])])
        push.send_multipart([bytes(f) for f in message.encode(SECRET, _header(sim=0), [np.ones((2, 3), np.float32)])])
        push.send_multipart(good)
        _wait(lambda: srv.counters["samples"] == 1)
        assert srv.dropped == {"malformed": 1, "unauthenticated": 2, "truncated": 1}
        np.testing.assert_array_equal(srv.buffer.get(1)[0].fields[0], np.ones((4, 3)))
        push.close()
    finally:
        srv.stop()


def test_backpressure_blocks_producers_and_memory_stays_bounded():
    srv = _server(policy="fifo", capacity=2, watermark=1)
    try:
        field = np.zeros((512, 512), np.float32)  # 1 MiB messages
        p = _producers(srv, 0, 0, field, nranks=1)[0][0]
        p.send_timeout_s = 0.5
        p._sock.timeout_s = 0.5
        sent = 0
        with pytest.raises(LaunchError, match="took no data"):
            for step in range(200):
                p.send(step, 0.0, {"T": field})
                sent += 1
        # blocked after: buffer (2) + the server's held sample (1) + the producer's hwm of unacknowledged
        # messages (4), some of them in the kernel's loopback socket buffers
        assert len(srv.buffer) == 2 and sent < 24, sent
        assert srv.buffer.get(2) is not None  # room again: the stream resumes
        _wait(lambda: len(srv.buffer) == 2)
    finally:
        srv.stop()


def test_state_round_trip_and_rebalance_to_fewer_trainers():
    srvs = [_server(n_trainers=2, rank=r, policy="firo", capacity=16, watermark=16) for r in range(2)]
    try:
        sims = [s for s in range(8)]
        for s in sims:
            srv = srvs[route(s, 2)]
            field = np.full((4, 4), s, np.float32)
            _send_all(_producers(srv, s, 0, field, nranks=1), (1, 2), field)
        _wait(lambda: sum(v.counters["samples"] for v in srvs) == 16)
        states = [v.state() for v in srvs]
        assert sum(len(st["seen"]) for st in states) == 16
        one = _server(n_trainers=1, rank=0, policy="firo", capacity=32, watermark=1)
        try:
            one.load_state(states)
            assert len(one.seen) == 16 and len(one.buffer) == 16
            field = np.full((4, 4), 3, np.float32)
            _send_all(_producers(one, 3, 1, field, nranks=1), (1, 2, 3), field)  # a retry after the restart
            _wait(lambda: len(one.buffer) == 17)
            assert one.counters.get("duplicates", 0) == 2
            keys = sorted((s.sim, s.step) for s in one.buffer.get(17))
            assert keys == sorted([(s, k) for s in sims for k in (1, 2)] + [(3, 3)])
        finally:
            one.stop()
    finally:
        for v in srvs:
            v.stop()


def test_quiesce_takes_in_what_was_sent_past_capacity_before_a_stop_save():
    """A stop save must hold every sample a finished simulation sent: those still queued
    in the socket when the buffer is full are taken in, past its capacity."""
    srv = _server(policy="fifo", capacity=2, watermark=1)
    try:
        field = np.zeros((64, 64), np.float32)
        p = _producers(srv, 0, 0, field, nranks=1)[0][0]
        for step in range(6):  # 6 samples into a buffer of 2: 4 wait in the sockets
            p.send(step, 0.0, {"T": field + step})
        closing = threading.Thread(target=p.close)  # returns once the trainer took everything
        closing.start()
        _wait(lambda: len(srv.buffer) == 2)
        time.sleep(0.3)
        assert closing.is_alive()  # backpressure: the trainer has not taken the last ones
        srv.quiesce(quiet_s=0.3, timeout_s=10)
        closing.join(timeout=10)
        assert not closing.is_alive() and p._sock.undelivered == 0
        assert len(srv.buffer) == 6 and srv.counters["samples"] == 6
        assert sorted(s.step for s in srv.buffer.get(6)) == list(range(6))
    finally:
        srv.stop()


def _two_ranks_state(n_sims: int, shape: tuple[int, ...], capacity: int) -> list:
    """The states of two trainer ranks that took 2 outputs of each of ``n_sims`` simulations."""
    srvs = [_server(n_trainers=2, rank=r, policy="fifo", capacity=capacity, watermark=capacity) for r in range(2)]
    try:
        for s in range(n_sims):
            field = np.full(shape, s, np.float32)
            _send_all(_producers(srvs[route(s, 2)], s, 0, field, nranks=1), (1, 2), field)
        _wait(lambda: sum(len(v.buffer) for v in srvs) == 2 * n_sims)
        return [v.state() for v in srvs]
    finally:
        for v in srvs:
            v.stop()


def test_restore_never_drops_samples_to_fit_the_capacity():
    """Two trainer ranks' buffers restored onto one rank with room for fewer: all come back."""
    states = _two_ranks_state(4, (4, 4), 8)
    one = _server(n_trainers=1, rank=0, policy="fifo", capacity=4, watermark=1)
    try:
        one.load_state(states)
        assert len(one.buffer) == 8 and one.counters["samples"] == 8  # counters follow what this rank owns
    finally:
        one.stop()
    again = [_server(n_trainers=2, rank=r, policy="fifo", capacity=8, watermark=8) for r in range(2)]
    try:
        for v in again:  # the same trainer count: each rank's own counters continue
            v.load_state(states)
        assert [v.counters["samples"] for v in again] == [4, 4]  # sims {0, 2} and {1, 3}, 2 outputs each
    finally:
        for v in again:
            v.stop()


@pytest.mark.parametrize("policy", ["fifo", "firo", "reservoir"])
def test_a_stop_keeps_the_batch_a_rank_held(policy):
    """The loader stops on a request (in its per-step agreement; here one rank, COMM_SELF)
    and the batch it had taken goes back into the buffer: the stop save holds it."""
    from mpi4py import MPI

    from hpcml.stream import StreamLoader

    srv = _server(policy=policy, capacity=8, watermark=1)
    try:
        field = np.zeros((4, 4), np.float32)
        _send_all(_producers(srv, 0, 0, field, nranks=1), (1, 2, 3, 4, 5), field)
        _wait(lambda: len(srv.buffer) == 5)
        asked = {"stop": False}
        loader = StreamLoader(srv, MPI.COMM_SELF, 2, should_stop=lambda: asked["stop"])
        trained = loader.next_batch()
        assert trained is not None and not loader.stopped
        asked["stop"] = True
        assert loader.next_batch() is None and loader.stopped  # a stream that has not ended
        kept = {(s.sim, s.step) for s in srv.buffer._items}
        left = {(0, k) for k in range(1, 6)} - ({(s.sim, s.step) for s in trained} if policy != "reservoir" else set())
        assert kept == left  # nothing taken and untrained is lost
        assert srv.buffer.stats.served == 2 and srv.buffer.stats.batches == 1
    finally:
        srv.stop()


@pytest.mark.parametrize("shape, axis, nranks, dtype", [
    ((128,), 0, 2, np.float32),       # a 1-D solver's field, split in two
    ((4, 6, 5), 2, 2, np.float32),    # 3-D, split along the last axis
    ((4, 6, 5), 0, 2, np.float64),
    ((128,), 0, 1, np.float64),       # one rank: the whole field in one message (the no-copy path)
])
def test_fields_of_any_rank_assemble_bit_for_bit(shape, axis, nranks, dtype):
    srv = _server()
    try:
        field = np.random.default_rng(1).random(shape).astype(dtype)
        _send_all(_producers(srv, 0, 0, field, nranks=nranks, axis=axis), (1, 2), field)
        _wait(lambda: len(srv.buffer) == 2)
        for s in sorted(srv.buffer.get(2), key=lambda s: s.step):
            assert s.fields.shape == (1, *shape) and s.fields.dtype == np.float32
            np.testing.assert_array_equal(s.fields[0], (field + s.step).astype(np.float32))
        assert srv.dropped == {}
    finally:
        srv.stop()


def test_three_1d_simulations_reach_both_trainer_ranks_through_from_campaign(tmp_path, monkeypatch):
    """The reported case: a 1-D solver, 3 simulations, 2 trainer ranks, producers built from
    the campaign's contract in the environment; an earlier run's endpoints file is never used."""
    from mpi4py import MPI

    from hpcml.contract import Contract

    srvs = [_server(n_trainers=2, rank=r) for r in range(2)]
    try:
        write_endpoints(tmp_path / "endpoints.json", CAMPAIGN, [v.endpoint for v in srvs], run="old-run")
        (tmp_path / "stream.key").write_text(SECRET.hex())
        contract = Contract(run_dir=str(tmp_path), campaign=CAMPAIGN, run="r1",
                            secret_file=str(tmp_path / "stream.key"),
                            endpoints_file=str(tmp_path / "endpoints.json"))
        for k, v in contract.to_env().items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("HPCML_STREAM_WAIT_S", "0.3")
        with pytest.raises(LaunchError, match="earlier run's .*'old-run'.* did not publish its own within 0.3 s"):
            Producer.from_campaign(comm=MPI.COMM_SELF, params={"alpha": 0.1}, global_shape=(128,), offset=(0,),
                                   local_shape=(128,), sim_id=0)
        write_endpoints(tmp_path / "endpoints.json", CAMPAIGN, [v.endpoint for v in srvs], run="r1")
        u = np.sin(np.linspace(0, 2 * np.pi, 128, dtype=np.float32))
        for sim in range(3):
            p = Producer.from_campaign(comm=MPI.COMM_SELF, params={"alpha": 0.1 * sim}, global_shape=(128,),
                                       offset=(0,), local_shape=(128,), fields=("T",), sim_id=sim)
            p.send(1, 0.1, {"T": u + sim})
            p.close()
        _wait(lambda: [len(v.buffer) for v in srvs] == [2, 1])
        for r, v in enumerate(srvs):
            for s in v.buffer.get(len(v.buffer)):
                assert route(s.sim, 2) == r and s.fields.shape == (1, 128)
                np.testing.assert_array_equal(s.fields[0], u + s.sim)
            assert v.dropped == {}
    finally:
        for v in srvs:
            v.stop()


def test_restore_onto_more_trainers_follows_the_routing():
    """Two trainer ranks' state restored onto three: each rank holds exactly the simulations s % 3 == rank."""
    states = _two_ranks_state(6, (4, 2), 16)
    three = [_server(n_trainers=3, rank=r, policy="fifo", capacity=16, watermark=1) for r in range(3)]
    try:
        for r, v in enumerate(three):
            v.load_state(states)
            assert {s.sim for s in v.buffer._items} == {r, r + 3} and {k[0] for k in v.seen} == {r, r + 3}
            assert all(s.fields.shape == (1, 4, 2) for s in v.buffer._items)
    finally:
        for v in three:
            v.stop()


def test_file_source_gives_each_trainer_rank_its_1d_simulations(tmp_path):
    import h5py

    from hpcml.stream.files import FileSource

    for sim in range(3):
        with h5py.File(tmp_path / f"sim_{sim}.h5", "w") as f:
            f["fields/u"], f["time"], f["step"] = np.full((2, 16), sim, np.float32), [0.0, 1.0], [0, 10]
            f.attrs["sim_id"], f.attrs["params"] = sim, '{"nu": 0.01}'
    got = []
    for rank in range(2):
        src = FileSource(sorted(tmp_path.glob("*.h5")), rank=rank, n_trainers=2, buffer=Buffer(BufferConfig(
            policy="fifo", capacity=8, watermark=1)), field_names=("u",), param_names=("nu",)).start()
        _wait(lambda: src.buffer.ended)
        got.append(sorted((s.sim, s.step, s.fields.shape) for s in src.buffer._items))
        src.stop()
    assert got == [[(0, 0, (1, 16)), (0, 10, (1, 16)), (2, 0, (1, 16)), (2, 10, (1, 16))],
                   [(1, 0, (1, 16)), (1, 10, (1, 16))]]


def test_restored_buffer_counters_are_the_own_rank_s_once():
    """Each saved rank's counters were added to every restored rank (the summary's per-rank
    buffer statistics came out inflated after a resume)."""
    from hpcml.stream.source import pack_state, unpack_states

    states = []
    for r, (ingested, served) in enumerate(((20, 800), (30, 500))):
        b = Buffer(BufferConfig(policy="fifo", capacity=8, watermark=1))
        b.stats.ingested, b.stats.served, b.stats.batches, b.stats.reuse_hist = ingested, served, served // 4, {0: 5}
        states.append(pack_state(b, [(r, 0)], {}))
    for rank, expect in ((0, (20, 800, 200)), (1, (30, 500, 125))):
        fresh = Buffer(BufferConfig(policy="fifo", capacity=8, watermark=1))
        seen: set = set()
        unpack_states(states, fresh, seen, keep=lambda sim: True, rank=rank, n_ranks=2)
        assert (fresh.stats.ingested, fresh.stats.served, fresh.stats.batches) == expect
        assert fresh.stats.reuse_hist == {0: 5} and seen == {(0, 0), (1, 0)}
    # onto one rank: it takes both histories, each once (before: rank 1's was lost)
    fresh, seen = Buffer(BufferConfig(policy="fifo", capacity=8, watermark=1)), set()
    unpack_states(states, fresh, seen, keep=lambda sim: True, rank=0, n_ranks=1)
    assert (fresh.stats.ingested, fresh.stats.served, fresh.stats.batches, fresh.stats.reuse_hist) == (
        50, 1300, 325, {0: 10})


def test_server_counters_survive_restores_onto_any_trainer_count():
    """Issue 12: the summary's sample counts after restarts must equal the checkpointed
    stream state on any number of trainer ranks; histories (duplicates, drops) once each."""
    srvs = [_server(n_trainers=2, rank=r, policy="fifo", capacity=16, watermark=16) for r in range(2)]
    try:
        for s in range(4):
            field = np.full((4, 4), s, np.float32)
            _send_all(_producers(srvs[route(s, 2)], s, 0, field, nranks=1), (1, 2, 3), field)
        _wait(lambda: sum(v.counters["samples"] for v in srvs) == 12)
        for v in srvs:
            v.counters["duplicates"], v.dropped["stale_attempt"] = 1 + v.rank, 10 * (1 + v.rank)
        states = [v.state() for v in srvs]
    finally:
        for v in srvs:
            v.stop()
    for n in (1, 2, 3):  # restart on 1, the same 2, or 3 trainer ranks, twice in a row
        again = states
        for _ in range(2):
            new = [_server(n_trainers=n, rank=r, policy="fifo", capacity=16, watermark=16) for r in range(n)]
            try:
                for v in new:
                    v.load_state(again)
                assert sum(v.counters["samples"] for v in new) == 12 == sum(len(v.seen) for v in new)
                assert [v.counters["samples"] for v in new] == [len(v.seen) for v in new]
                assert sum(v.counters["duplicates"] for v in new) == 3
                assert sum(v.dropped.get("stale_attempt", 0) for v in new) == 30
                again = [v.state() for v in new]
            finally:
                for v in new:
                    v.stop()


def test_from_campaign_binds_the_contracts_interface_and_a_relaunch_takes_its_published_port(tmp_path):
    """The stream on the fast network without reading a workflow's source: the contract names
    the interface (``hsn0`` on a cluster; ``lo`` here), the server binds its address; a
    relaunch within the run takes the port this run published."""
    from hpcml.contract import Contract

    (tmp_path / "stream.key").write_text(SECRET.hex())
    c = Contract(run_dir=str(tmp_path), campaign=CAMPAIGN, run="r1", secret_file=str(tmp_path / "stream.key"),
                 endpoints_file=str(tmp_path / "endpoints.json"), done_file=str(tmp_path / "sims_done.json"),
                 stream_interface="lo")
    buf = Buffer(BufferConfig(policy="fifo", capacity=4, watermark=1))
    first = StreamServer.from_campaign(buf, rank=0, n_trainers=1, param_names=("alpha",), field_names=("T",),
                                       contract=c)
    try:
        assert first.endpoint.startswith("tcp://127.0.0.1:") and first.config.done_file == c.done_file
        write_endpoints(c.endpoints_file, CAMPAIGN, [first.endpoint], run="r1")
    finally:
        first.stop()
    again = StreamServer.from_campaign(buf, rank=0, n_trainers=1, param_names=("alpha",), field_names=("T",),
                                       contract=c)
    again.stop()
    assert again.endpoint == first.endpoint
    other_run = StreamServer.from_campaign(buf, rank=0, n_trainers=1, param_names=("alpha",), field_names=("T",),
                                           contract=c.replace(run="r2"))  # an earlier run's port is not taken
    other_run.stop()
    with pytest.raises(LaunchError, match=r"network interface 'nosuch0' has no IPv4 address .*; interfaces here: "):
        StreamServer.from_campaign(buf, rank=0, n_trainers=1, param_names=("alpha",), field_names=("T",),
                                   contract=c.replace(stream_interface="nosuch0"))
    with pytest.raises(ConfigError, match=r"gives this trainer no stream"):
        StreamServer.from_campaign(buf, rank=0, n_trainers=1, field_names=("T",),
                                   contract=Contract(run_dir=str(tmp_path), campaign=CAMPAIGN))


def test_a_message_of_an_earlier_run_is_dropped_not_taken_as_this_runs(tmp_path):
    """The secret outlives a run (a resumed campaign keeps it), so a message recorded in an
    earlier run and replayed into this one authenticates: the run in its header refuses it."""
    from hpcml.contract import Contract

    (tmp_path / "stream.key").write_text(SECRET.hex())
    c = Contract(run_dir=str(tmp_path), campaign=CAMPAIGN, run="r2", secret_file=str(tmp_path / "stream.key"),
                 endpoints_file=str(tmp_path / "endpoints.json"))
    srv = StreamServer.from_campaign(Buffer(BufferConfig(policy="fifo", capacity=8, watermark=1)), rank=0,
                                     n_trainers=1, param_names=("alpha",), field_names=("T",), contract=c).start()
    replay = Sender(SECRET)
    try:
        field = np.ones((4, 3), np.float32)
        for run, sim in (("r1", 0), ("r2", 1), ("", 2)):  # an earlier run's, this run's, a producer built by hand
            p = Producer(endpoint=srv.endpoint, secret=SECRET, campaign=CAMPAIGN, run=run, sim_id=sim, attempt=0,
                         rank=0, nranks=1, params={"alpha": 1.0}, global_shape=(4, 3), offset=(0, 0),
                         local_shape=(4, 3))
            if run == "r1":  # the trainer said which run it serves at the handshake: refused at the source
                with pytest.raises(ConfigError, match=r"^simulation 0 rank 0: the trainer belongs to run 'r2' of the "
                                                      r"campaign, this simulation to run 'r1' \(trainer rank 0 at "):
                    p.send(1, 0.1, {"T": field})
                continue
            if not run:  # none named: not taken as this run's either (issue 40)
                with pytest.raises(ConfigError, match=r"^simulation 2 rank 0: the trainer belongs to run 'r2' of the "
                                                      r"campaign, this producer names no run \(build it with "
                                                      r"Producer.from_campaign, or pass run=\)"):
                    p.send(1, 0.1, {"T": field})
                continue
            p.send(1, 0.1, {"T": field})
            p.close()
        # a message of run r1 replayed by hand past that check: its header refuses it
        replay.connect(srv.endpoint)
        replay.send_multipart(message.encode(SECRET, {**_header(sim=0, step=1, nranks=1, shape=[4, 3]), "run": "r1"},
                                             [field]))
        replay.send_multipart(message.encode(SECRET, _header(sim=3, step=1, nranks=1, shape=[4, 3]), [field]))  # no run
        _wait(lambda: srv.counters["samples"] == 1 and srv.dropped.get("wrong_campaign") == 2)
        assert sorted(srv.seen) == [(1, 1)]
    finally:
        replay.close(linger=0)
        srv.stop()


def test_a_trainer_restarted_on_the_same_port_gets_whole_messages_from_the_producer_it_had():
    """A server stopped while a producer's 1 MiB messages are in flight (some partly sent), a new
    one bound to the same port: the producer reconnects by itself and sends again every message
    the first server had not taken (acknowledged), so the second gets those and every later one,
    whole and bit for bit, and nothing is dropped."""
    field = np.random.default_rng(3).random((512, 512)).astype(np.float32)
    first = _server(policy="fifo", capacity=1, watermark=1)
    port = int(first.endpoint.rsplit(":", 1)[1])
    p = _producers(first, 0, 0, field, nranks=1)[0][0]
    for step in range(4):  # the buffer takes one, the server holds one, the rest is queued or in flight
        p.send(step, 0.0, {"T": field + step})
    _wait(lambda: len(first.buffer) == 1)
    first.stop()
    buf = Buffer(BufferConfig(policy="fifo", capacity=64, watermark=1))
    second = StreamServer(campaign=CAMPAIGN, secret=SECRET, rank=0, n_trainers=1, buffer=buf,
                          config=ServerConfig(param_names=("alpha",), field_names=("T",), port=port)).start()
    try:
        for step in range(4, 8):
            p.send(step, 0.0, {"T": field + step})
        _wait(lambda: {4, 5, 6, 7} <= {s for _, s in second.seen})
        assert second.dropped == {} and second._rx.admitted == 1
        # 0 is in the first's buffer; 1 was held by it (sent again if its acknowledgement had not left yet)
        assert set(range(2, 8)) <= {s for _, s in second.seen} <= set(range(1, 8))
        for s in second.buffer.get(len(second.buffer)):
            np.testing.assert_array_equal(s.fields[0], field + s.step)
        p.close()
    finally:
        second.stop()


@pytest.mark.parametrize("wire", ["framed", "zmtp"])
def test_both_wires_carry_samples_bit_for_bit_and_refuse_a_stranger(wire):
    """The default framed wire and the opt-in zmtp one (ZeroMQ's own messages, for trusted
    simulations): the same samples from a two-rank simulation, float32 and float64, the end
    marker, a stranger refused; the address says which wire a producer speaks."""
    buf = Buffer(BufferConfig(policy="fifo", capacity=16, watermark=1))
    srv = StreamServer(campaign=CAMPAIGN, secret=SECRET, rank=0, n_trainers=1, buffer=buf,
                       config=ServerConfig(param_names=("alpha",), field_names=("T", "U"), transport=wire)).start()
    try:
        assert srv.endpoint.startswith("zmtp+tcp://" if wire == "zmtp" else "tcp://")
        stranger = Producer(endpoint=srv.endpoint, secret=b"x" * 32, campaign=CAMPAIGN, sim_id=9, attempt=0, rank=0,
                            nranks=1, params={"alpha": 0.5}, global_shape=(4,), offset=(0,), local_shape=(4,),
                            send_timeout_s=1.0)
        if wire == "framed":  # its proof is refused at the handshake: a final error at the first send
            with pytest.raises(ConfigError, match=r"^simulation 9 rank 0: trainer at tcp://.*: the trainer refused "
                                                  r"this producer's proof of the campaign secret"):
                stranger.send(0, 0.0, {"T": np.ones(4), "U": np.ones(4)})
        else:  # ZeroMQ queues it, or -- its pipe torn down by the refused handshake -- times out: never delivered
            try:
                stranger.send(0, 0.0, {"T": np.ones(4), "U": np.ones(4)})
            except LaunchError:
                pass
        field = np.random.default_rng(5).random((6, 5))
        prods = _producers(srv, 1, 0, field, nranks=2)
        for step in range(3):
            for p, sl in prods:
                p.send(step, step / 10, {"T": field[sl] + step, "U": (field[sl] * step).astype(np.float32)})
        for p, _ in prods:
            p.close()
        _wait(lambda: srv.counters["samples"] == 3 and srv.ingest.ends.ends.get(1, {}).keys() == {0, 1})
        assert srv.dropped == {} and srv._rx.admitted == 2 and sorted(srv.seen) == [(1, 0), (1, 1), (1, 2)]
        for s in srv.buffer.get(3):
            np.testing.assert_array_equal(s.fields[0], (field + s.step).astype(np.float32))
            np.testing.assert_array_equal(s.fields[1], (field * s.step).astype(np.float32))
        _wait(lambda: srv._rx.refused >= 1)
        stranger._sock.close(0)
    finally:
        srv.stop()


def test_an_unknown_wire_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^ServerConfig.transport='push': expected 'framed' or 'zmtp'$"):
        ServerConfig(field_names=("T",), transport="push")


@pytest.mark.parametrize("integrity", ["connection", "message"])
def test_integrity_modes_a_producer_follows_the_trainer_and_the_server_refuses_what_its_mode_does_not_take(
        integrity):
    """``connection`` (the default): the challenge is enough and Producers send no MAC;
    ``message``: every message carries one, and a message without it -- even on a connection
    that proved the secret -- is dropped. Both take a sealed message; neither takes a bad MAC."""
    buf = Buffer(BufferConfig(policy="fifo", capacity=16, watermark=1))
    srv = StreamServer(campaign=CAMPAIGN, secret=SECRET, rank=0, n_trainers=1, buffer=buf,
                       config=ServerConfig(param_names=("alpha",), field_names=("T",), integrity=integrity)).start()
    raw = Sender(SECRET)
    try:
        field = np.random.default_rng(1).random((6, 5))
        prods = _producers(srv, 1, 0, field, nranks=2)
        _send_all(prods, range(3), field)
        assert [p._sealed() for p, _ in prods] == [integrity == "message"] * 2  # what the handshake said
        for p, _ in prods:
            p.close()
        _wait(lambda: srv.counters["samples"] == 3)
        raw.connect(srv.endpoint)
        a = np.ones((6, 5), np.float32)
        raw.send_multipart(message.encode(SECRET, _header(sim=2, step=0, global_shape=[6, 5], shape=[6, 5]), [a],
                                          sealed=False))  # no MAC
        raw.send_multipart(message.encode(SECRET, _header(sim=2, step=1, global_shape=[6, 5], shape=[6, 5]), [a]))
        bad = message.encode(SECRET, _header(sim=2, step=2, global_shape=[6, 5], shape=[6, 5]), [a])
        raw.send_multipart(bad[:-1] + [bytes(16)])  # a MAC that does not verify
        _wait(lambda: srv.counters["messages"] + sum(srv.dropped.values()) == 6 + 2 + 3)  # data, ends, raw
        unsealed_taken = integrity == "connection"
        assert srv.counters["samples"] == 3 + 1 + unsealed_taken
        assert srv.dropped == ({"unauthenticated": 1} if unsealed_taken else {"unauthenticated": 1, "malformed": 1})
        assert (2, 1) in srv.seen and ((2, 0) in srv.seen) == unsealed_taken
    finally:
        raw.close(linger=0)
        srv.stop()


def test_an_unknown_integrity_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^ServerConfig.integrity='none': expected 'connection' \(a challenge per "
                                          r"connection\) or 'message' \(a MAC on every message too\)$"):
        ServerConfig(field_names=("T",), integrity="none")


def test_acknowledgements_cover_what_queued_yet_a_producer_of_one_message_in_flight_never_waits(monkeypatch):
    """The server owes a connection its count until two messages are taken (or 5 ms pass, or it
    waits for input): messages that queued while it was busy cost half the loopback sends, and a
    producer with ``hwm=1`` -- each send waiting for the last one's acknowledgement -- still
    streams. (How many pairs a free-running producer gets depends on who is faster -- on a loaded
    host the server often waits for input -- so the pairs are checked with the server held while
    199 messages queue.)"""
    import struct
    import threading

    from hpcml.stream import transport

    packed = []

    class Counting:
        def pack(self, n):
            packed.append(n)
            return struct.pack("<Q", n)

    monkeypatch.setattr(transport, "ACK", Counting())
    field = np.arange(8 * 8, dtype=np.float32).reshape(8, 8)  # 199 of them fit the socket buffers
    srv = _server(capacity=256)
    try:
        p = Producer(endpoint=srv.endpoint, secret=SECRET, campaign=CAMPAIGN, sim_id=0, attempt=0, rank=0, nranks=1,
                     params={"alpha": 0.5}, global_shape=field.shape, offset=(0, 0), local_shape=field.shape, hwm=1)
        t0 = time.monotonic()
        for step in range(30):
            p.send(step, 0.0, {"T": field + step})
        p.close()  # returns once every message is acknowledged
        assert time.monotonic() - t0 < 10
        assert packed == list(range(1, 32))  # each alone (and the end marker): one owed, then the wait
        packed.clear()
        q = Producer(endpoint=srv.endpoint, secret=SECRET, campaign=CAMPAIGN, sim_id=1, attempt=0, rank=0, nranks=1,
                     params={"alpha": 0.5}, global_shape=field.shape, offset=(0, 0), local_shape=field.shape, hwm=256)
        q.send(0, 0.0, {"T": field})  # the handshake done, the first message acknowledged
        _wait(lambda: packed == [1])
        held, rounds = threading.Event(), srv._rx._round
        monkeypatch.setattr(srv._rx, "_round", lambda: (held.wait(10), rounds())[1])
        for step in range(1, 200):
            q.send(step, 0.0, {"T": field + step})
        time.sleep(0.2)  # the server thread, held, reads nothing meanwhile
        assert packed == [1]
        held.set()
        q.close()
        assert packed[-1] == 201 and len(packed) <= 130, packed  # ~100 (pairs: one message a round), not 200
        _wait(lambda: len(srv.seen) == 230)
        assert srv.dropped == {}
    finally:
        srv.stop()


def test_a_diverged_simulations_non_finite_field_is_refused_at_the_producer(tmp_path, monkeypatch):
    """A NaN or an infinity in a sent field would make every weight of the surrogate NaN at its
    first step: the producer refuses it at the first send, naming the field, the step, the
    counts and the first point, as a deterministic error (recorded for the campaign: no
    retry); nothing of it reaches the trainer."""
    monkeypatch.setenv("HPCML_RUN_DIR", str(tmp_path))
    srv = _server()
    try:
        field = np.ones((4, 6), np.float32)
        p = Producer(endpoint=srv.endpoint, secret=SECRET, campaign=CAMPAIGN, sim_id=3, attempt=0, rank=0, nranks=1,
                     params={"alpha": 0.5}, global_shape=field.shape, offset=(0, 0), local_shape=field.shape)
        p.send(0, 0.0, {"T": field})
        bad = field.copy()
        bad[1, 2], bad[3, 0], bad[3, 5] = np.inf, np.nan, -np.inf
        with pytest.raises(ConfigError) as e:
            p.send(1, 0.1, {"T": bad})
        assert str(e.value) == ("simulation 3 rank 0: field 'T' at step 1 holds 1 NaN and 2 infinite values of 24 "
                                "(the first at (1, 2) of this rank's subdomain): the simulation diverged or left them "
                                "unset; only finite values are sent (one such sample would make every weight of the "
                                "surrogate NaN) -- mask them with finite values first (np.nan_to_num)")
        p.send(1, 0.1, {"T": np.nan_to_num(bad, posinf=0.0, neginf=0.0)})  # a finite field goes
        p.send(2, 0.2, {"T": np.arange(24, dtype=np.int64).reshape(4, 6)})  # integers are always finite
        ids = np.arange(24, dtype=np.int64).reshape(4, 6) + (1 << 24) - 23  # 2^24 the largest: exact in float32
        p.send(3, 0.3, {"T": ids})
        with pytest.raises(ConfigError) as e:  # one more would arrive rounded: 16777217.0 is 16777216.0 in float32
            p.send(4, 0.4, {"T": ids + 1})
        assert str(e.value) == ("simulation 3 rank 0: field 'T' holds integers from 16777194 to 16777217: sent as "
                                "float32, which holds integers exactly only within +-16777216 (the values would arrive "
                                "rounded) -- send them as float64 (a.astype(np.float64))")
        p.send(4, 0.4, {"T": (ids + 1).astype(np.float64)})
        p.close()
        _wait(lambda: len(srv.seen) == 5)
        assert srv.dropped == {}
    finally:
        srv.stop()


def test_a_producer_reads_acknowledgements_when_they_make_room_not_after_every_message(monkeypatch):
    """A read of the socket after every message (for acknowledgements that were mostly not there
    yet) cost ~20 us of a ~330 us send of 1 MiB: the caller reads them once ``hwm`` messages are
    held, which frees the acknowledged ones before the next send would block. Every message
    still arrives, and the producer never holds more than ``hwm``."""
    from hpcml.stream import sender

    reads, held = [], []
    take = sender.Sender._take_acks

    def counting(self):
        if threading.current_thread() is threading.main_thread():
            reads.append(len(self._items))
        return take(self)

    monkeypatch.setattr(sender.Sender, "_take_acks", counting)
    field = np.arange(8 * 8, dtype=np.float32).reshape(8, 8)
    srv = _server(capacity=256)
    try:
        p = Producer(endpoint=srv.endpoint, secret=SECRET, campaign=CAMPAIGN, sim_id=0, attempt=0, rank=0, nranks=1,
                     params={"alpha": 0.5}, global_shape=field.shape, offset=(0, 0), local_shape=field.shape, hwm=4)
        for step in range(40):
            p.send(step, 0.0, {"T": field + step})
            held.append(len(p._sock._items))
        p.close()
        _wait(lambda: len(srv.buffer) == 40)
        assert sorted(int(s.fields[0][0, 0]) for s in srv.buffer._items) == list(range(40))
    finally:
        srv.stop()
    assert max(held) <= 4 and reads and all(n >= 4 for n in reads), (held, reads)  # each when hwm were held
    # (before: one after every message, at 1, 2, 3 held ... -- 40 and more; a loaded host fills the queue more often)
