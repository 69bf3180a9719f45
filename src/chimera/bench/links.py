"""Slower links and priced gradient collectives for the emulated bench (issue 36).

The bench's ranks share one machine: their p2p is loopback and their gradients a few floats,
so Chimera's replica allreduce is nearly free there and a slow link costs nothing. What a
cluster charges is added here, as the emulated layers add compute, on our rows and torch's
alike:

- :class:`LateSends`: every p2p send is issued ``link_s`` after the call, by one thread per
  process in call order (so messages between two ranks keep their order); the caller goes on
  at once, as with an asynchronous send, and its work completes once the late send has.
  Ours gets it through its transport (:class:`PricedTransport`); torch's pipelining calls
  ``torch.distributed.isend`` itself, so :func:`late_torch_sends` swaps that function for
  the length of a step;
- :class:`PricedTransport` also prices an asynchronous allreduce on a group (the runtime's
  gradient sync over a stage's replicas): it completes ``seconds_per_float`` per float after
  the real one completed, one after another on the rank's channel, as the simulator's
  ``CostModel.reduce`` times them; a reduce-scatter or an all-gather (ZeRO-1's halves of
  it) half of that per float of the whole buffer, as the simulator counts them.

Each simulated column of the bench adds the same prices (:mod:`chimera.bench.prices`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from chimera.runtime.transport import ReduceOp, Wrapping


class _LateWork:
    """The work of a send issued later: done when it was issued and its own work is done."""

    def __init__(self):
        self.issued = threading.Event()
        self.work = None
        self.error: BaseException | None = None

    def wait(self, timeout=None) -> bool:
        if not self.issued.wait(None if timeout is None else timeout.total_seconds()):
            return False
        if self.error is not None:
            raise RuntimeError(f"late send failed: {self.error}") from self.error
        return self.work.wait() if timeout is None else self.work.wait(timeout)

    def is_completed(self) -> bool:
        return self.issued.is_set() and (self.error is not None or self.work.is_completed())


class LateSends:
    """One thread that issues each submitted send ``link_s`` after its call, in call order."""

    def __init__(self, link_s: float):
        self.link_s = link_s
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="late-sends", daemon=True)
        self.thread.start()

    def submit(self, send) -> _LateWork:
        late = _LateWork()
        self.queue.put((time.perf_counter() + self.link_s, send, late))
        return late

    def _run(self) -> None:
        while True:
            due, send, late = self.queue.get()
            left = due - time.perf_counter()
            if left > 0:
                time.sleep(left)
            try:
                late.work = send()
            except BaseException as exc:  # noqa: BLE001 -- handed to the waiter
                late.error = exc
            late.issued.set()


class _PricedWork:
    """A collective that ends ``seconds`` after its real one completed, or after the rank's
    previous priced collective ended (one channel per rank). A work without a future (gloo's
    reduce-scatter and all-gather) is priced from its issue instead: loopback moves the
    real bytes in well under a millisecond."""

    def __init__(self, work, seconds: float, channel: "_Channel"):
        self.work, self.due = work, None
        self.done = threading.Event()

        def completed(_):
            self.due = channel.take(seconds)
            self.done.set()
        try:
            future = work.get_future()
        except RuntimeError:  # "Work::getFuture not implemented"
            completed(None)
            return
        future.add_done_callback(completed)

    def wait(self, timeout=None) -> bool:
        ok = self.work.wait() if timeout is None else self.work.wait(timeout)
        if ok is False:
            return False
        self.done.wait()
        left = self.due - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return True

    def is_completed(self) -> bool:
        return self.done.is_set() and time.perf_counter() >= self.due


class _Channel:
    def __init__(self):
        self.lock, self.free = threading.Lock(), 0.0

    def take(self, seconds: float) -> float:
        with self.lock:
            self.free = max(self.free, time.perf_counter()) + seconds
            return self.free


class PricedTransport(Wrapping):
    """``inner`` with late p2p sends (``sends``, or None) and asynchronous group allreduces
    priced at ``seconds_per_float``."""

    def __init__(self, inner, sends: LateSends | None, seconds_per_float: float = 0.0):
        super().__init__(inner)
        self.sends, self.seconds_per_float, self.channel = sends, seconds_per_float, _Channel()

    def isend(self, tensor, dst, tag=0, group=None):
        if self.sends is None:
            return self.inner.isend(tensor, dst, tag, group)
        return self.sends.submit(lambda: self.inner.isend(tensor, dst, tag, group))

    def all_reduce(self, tensor, op=ReduceOp.SUM, group=None, async_op=False):
        work = self.inner.all_reduce(tensor, op=op, group=group, async_op=async_op)
        return self._priced(work, tensor.numel(), group, async_op)

    def reduce_scatter_single(self, output, input, group=None, async_op=False):
        work = self.inner.reduce_scatter_single(output, input, group=group, async_op=async_op)
        return self._priced(work, input.numel() / 2, group, async_op)

    def all_gather_single(self, output, input, group=None, async_op=False):
        work = self.inner.all_gather_single(output, input, group=group, async_op=async_op)
        return self._priced(work, output.numel() / 2, group, async_op)

    def _priced(self, work, floats: float, group, async_op: bool):
        """A gradient collective's work, priced: asynchronous on a group (the loss's
        allreduce and the blocking ones pass as they are)."""
        if not (async_op and group is not None and self.seconds_per_float):
            return work
        return _PricedWork(work, floats * self.seconds_per_float, self.channel)


@contextlib.contextmanager
def late_torch_sends(sends: LateSends | None):
    """``torch.distributed.isend`` issues through ``sends`` while inside: torch's pipelining
    looks it up at each call (``dist.P2POp(dist.isend, ...)``), and ``P2POp`` checks its op
    against the module's own ``isend``, so both names are swapped."""
    if sends is None:
        yield
        return
    real = c10d.isend

    def isend(tensor, *args, **kw):
        return sends.submit(lambda: real(tensor, *args, **kw))
    dist.isend = c10d.isend = isend
    try:
        yield
    finally:
        dist.isend = c10d.isend = real
