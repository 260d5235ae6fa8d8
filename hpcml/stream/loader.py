"""What the training loop iterates: batches from this rank's buffer, agreed over data-parallel ranks.

Before each step the dp ranks agree with one small all-reduce (``[ready, not exhausted,
not stopping, source alive, nothing novel]``, MIN): a step happens only when every rank has a
batch, so no rank enters the gradient all-reduce alone; the stream ends for all as soon as
one rank's buffer is exhausted (its simulations are done and drained), so nobody waits for
ever. A batch taken while others
were not ready is held for the next round, never lost.

Time accounting, after the first batch (i.e. once the buffer passed its watermark):
``starved_s`` -- this rank had no batch ready (the stream did not keep up): the trainer-idle
time; ``agree_s`` -- in the agreement all-reduce (its latency plus waiting for slower ranks
to finish their step, which is load imbalance, not starvation).
A rank that waits for the others in the agreement sleeps between tests of a non-blocking
all-reduce instead of spinning in a blocking one: MPICH busy-polls, and a trainer that shares
its cores with the simulations that feed it (one node, or an oversubscribed laptop) would
otherwise starve them -- it waits for their data at full speed.
``novel(batch)`` (optional) says a batch holds something the trainer wants to look at before
it trains on it (a simulation never trained on: :mod:`hpcml.train.feedback`); after the
agreement ``novel`` is whether any rank's batch does, so every rank takes the same extra
forward at the same step (collective under FSDP) and no rank pays one otherwise.
A source that died (:meth:`Buffer.fail <hpcml.stream.buffer.Buffer.fail>`) fails every rank
at the same round with :class:`~hpcml.errors.LaunchError`: loud, and no rank left waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from hpcml import waiting
from hpcml.errors import LaunchError
from hpcml.stream.buffer import Sample
from hpcml.stream.source import SampleSource


def agree_min(comm, flags: np.ndarray) -> None:
    """``flags`` <- their MIN over ``comm``, in place, waiting without spinning a core."""
    flags[:] = waiting.allreduce(comm, flags, "min")


class StreamLoader:
    """``next_batch()`` -> list of ``batch_size`` samples, or None once the stream has ended
    or a stop was asked on any rank (collective; ``stopped`` tells which)."""

    def __init__(self, server: SampleSource, comm, batch_size: int, poll_s: float = 0.05,
                 should_stop: Callable[[], bool] = lambda: False,
                 novel: Callable[[list[Sample]], bool] | None = None) -> None:
        self.server, self.comm, self.batch_size, self.poll_s = server, comm, batch_size, poll_s
        self.should_stop, self._novel = should_stop, novel
        self.novel = False
        """Whether the last batch of any rank held something ``novel`` (agreed: the same on every rank)."""
        self.stopped = False
        self._held: list[Sample] | None = None
        self.starved_s = 0.0
        self.agree_s = 0.0
        self.t_first_batch: float | None = None
        self.rounds = 0

    def next_batch(self) -> list[Sample] | None:
        buf = self.server.buffer
        flags = np.zeros(5, np.int32)
        starved = agree = 0.0
        while True:
            t0 = time.perf_counter()
            if self._held is None:
                self._held = buf.get(self.batch_size, timeout=self.poll_s)
            ready = self._held is not None
            novel = ready and self._novel is not None and self._novel(self._held)
            flags[:] = (int(ready), int(ready or not buf.exhausted(self.batch_size)), int(not self.should_stop()),
                        int(buf.error is None), int(not novel))
            t1 = time.perf_counter()
            agree_min(self.comm, flags)
            starved += t1 - t0
            agree += time.perf_counter() - t1
            self.rounds += 1
            if flags[3] == 0:
                raise LaunchError(f"the sample source of a trainer rank died, so training stops on every rank; this "
                                  f"rank's: {buf.error or 'alive'} (see the trainer log of the rank that says why)")
            if flags[1] == 0 or flags[2] == 0:  # some rank's stream is over, or asked to stop: everyone stops
                self.stopped = flags[2] == 0
                if self._held is not None:  # untrained: back into the buffer (and the checkpoint)
                    buf.unget(self._held)
                    self._held = None
                batch = None
                break
            if flags[0] == 1:
                batch, self._held = self._held, None
                self.novel = flags[4] == 0
                break
        if self.t_first_batch is None:
            self.t_first_batch = time.perf_counter()
        else:
            self.starved_s += starved
            self.agree_s += agree
        return batch

    def unused(self) -> int:
        """Samples ingested here that no step used (still in the buffer, or taken but not trained on)."""
        return self.server.buffer.unused() + (len(self._held) if self._held else 0)
