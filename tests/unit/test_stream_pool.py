"""The framed wire's message buffers, used again only once nothing refers to them: the pool on
its own, then a real server whose buffer holds samples while later messages arrive."""

from __future__ import annotations

import gc
import sys

import numpy as np
import torch

from hpcml.stream import Buffer, BufferConfig, Producer
from hpcml.stream.pool import MIN_BYTES, BufferPool
from hpcml.stream.server import ServerConfig, StreamServer
from tests.unit.test_stream import _wait
from tests.unit.test_stream_message import CAMPAIGN, SECRET


def test_a_buffer_comes_back_only_when_no_array_view_or_tensor_refers_to_it():
    pool = BufferPool()
    a = pool.take(MIN_BYTES)
    first = a.ctypes.data
    holders = [lambda x: x[8:].reshape(-1, 8), memoryview, lambda x: torch.from_numpy(x[:64]),
               lambda x: np.frombuffer(memoryview(x), np.float32)]
    for hold in holders:
        h = hold(a)
        del a
        b = pool.take(MIN_BYTES)
        assert b.ctypes.data != first, f"handed out again while {type(h).__name__} held it"
        del h, b
        gc.collect()
        a = pool.take(MIN_BYTES)
        assert a.ctypes.data == first and pool.reused >= 1
    assert pool.bytes == 2 * MIN_BYTES  # the one taken while the first was held is pooled too


def test_the_pool_is_bounded_and_small_buffers_are_left_to_the_allocator():
    pool = BufferPool(max_bytes=3 * MIN_BYTES)
    held = [pool.take(MIN_BYTES) for _ in range(5)]
    assert pool.bytes == 3 * MIN_BYTES and all(a.nbytes == MIN_BYTES for a in held)
    small = pool.take(MIN_BYTES - 1)
    assert pool.bytes == 3 * MIN_BYTES and small.nbytes == MIN_BYTES - 1
    assert all(a.ctypes.data % 64 == 0 for a in (*held, small))  # frames on 64-byte boundaries
    del held[:3]  # the pooled ones (taken first) are free; the two past the bound were never kept
    again = {pool.take(MIN_BYTES).ctypes.data for _ in range(3)}
    assert len(again) == 3 and pool.reused == 3 and pool.bytes == 3 * MIN_BYTES


def test_samples_held_in_the_buffer_keep_their_bytes_while_later_messages_are_read():
    """Messages of 1 MiB: the first 24 stay in the trainer's buffer while 24 more arrive (so
    no buffer of theirs may be read into again); then they are taken and dropped, and the last
    24 are read into their buffers -- every sample bit for bit what was sent."""
    shape = (512, 512)
    buf = Buffer(BufferConfig(policy="fifo", capacity=64, watermark=1))
    srv = StreamServer(campaign=CAMPAIGN, secret=SECRET, rank=0, n_trainers=1, buffer=buf,
                       config=ServerConfig(param_names=("alpha",), field_names=("T",), shape=shape)).start()
    rng = np.random.default_rng(3)
    sent = {}

    def send(steps):
        p = Producer(endpoint=srv.endpoint, secret=SECRET, campaign=CAMPAIGN, sim_id=1, attempt=0, rank=0, nranks=1,
                     params={"alpha": 0.5}, global_shape=shape, offset=(0, 0), local_shape=shape)
        for step in steps:
            sent[step] = rng.random(shape, dtype=np.float32)
            p.send(step, float(step), {"T": sent[step]})
        p.close()

    try:
        send(range(48))
        _wait(lambda: srv.counters["samples"] == 48)
        for s in buf.get(48):
            np.testing.assert_array_equal(s.fields[0], sent[s.step])
        pooled = srv._rx._pool.reused
        send(range(48, 72))  # the first 48 dropped: their buffers are read into again
        _wait(lambda: srv.counters["samples"] == 72)
        assert srv._rx._pool.reused - pooled == 24 and srv.dropped == {}
        for s in buf.get(24):
            np.testing.assert_array_equal(s.fields[0], sent[s.step])
    finally:
        srv.stop()


def test_a_pool_built_under_a_debugger_reuses_nothing():
    """A trace function reading a frame's locals (pdb, an IDE's debugger) held one reference more
    while the pool measured a free buffer's count (CPython <= 3.12): buffers holding one sample
    read as free and were read into again. Built while traced, the pool reuses nothing."""
    def tracer(frame, event, arg):
        frame.f_locals  # what a debugger showing locals does
        return tracer

    sys.settrace(tracer)
    try:
        traced = BufferPool()
    finally:
        sys.settrace(None)
    a = traced.take(MIN_BYTES)
    held = a[:16]  # one sample's view: one reference from outside
    del a
    assert traced.take(MIN_BYTES).ctypes.data != held.ctypes.data
    del held
    gc.collect()
    b = traced.take(MIN_BYTES)
    assert traced.reused == 0 and b.nbytes == MIN_BYTES
