"""NCCL's p2p and collective semantics emulated on gloo (``--emulate-nccl pair|rank|strict``,
or ``CHIMERA_EMULATE_NCCL``: the run context's ``RuntimeOptions.emulate_nccl``).

gloo matches messages by tag and lets either end run ahead, so a p2p order that hangs on
GPUs can train fine on CPU. :class:`NcclEmulation` is a :class:`~chimera.runtime.transport.Transport`
that wraps another (``torch.distributed`` on gloo, or a virtual rank) and makes the runtime's
``isend``/``irecv`` complete only as NCCL would let them:

- **Streams.** Each rank runs its p2p on FIFO streams: one per peer, shared by both
  directions (``pair``: NCCL's default, a communicator per pair of ranks), or one for all
  of the rank's p2p (``rank``: one communicator with ``device_id``); its collectives on one
  more. ``strict``: one stream per rank for p2p and collectives together, the strictest
  model (:mod:`chimera.check.comm_plan` proves its order safe there); the runtime then shares one
  emulation between its Mailboxes and its collectives. A daemon thread per stream takes the
  operations in issue order; an operation not at the head does not start.
- **No buffering, matching by order.** The k-th send from A to B matches the k-th receive
  at B from A (counted per ordered pair over the transport's life, across iterations). The
  two complete together, once both are at the head of their streams: each end, at its head,
  publishes a key in the rendezvous store and polls for the other end's key. The key holds
  the tag and size; if the k-th send and the k-th receive disagree, both fail (NCCL would
  deliver the wrong tensor, or hang on a size mismatch, where gloo's tags hide the bug).
- **Data** still moves through gloo's tagged ``isend``/``irecv``, issued at once; a stream
  waits for the gloo operation only after the rendezvous (both ends are issued by then, so
  it cannot block on anything else). A failed gloo operation fails its work and every later
  one on the stream (a broken communicator). Work objects answer ``wait(timeout)`` (True,
  or False on timeout, as gloo's) and ``is_completed()``; a stuck operation therefore ends
  in :func:`chimera.runtime.p2p.wait_work`'s CommTimeout naming rank, action and peer.

Not emulated:

- Real NCCL sends small messages eagerly (below ``NCCL_BUFFSIZE``, about 4 MiB per
  connection), so an order that hangs here may pass on GPUs with small activations: this
  is the worst case, which is what a schedule must survive (large models, large batches).
- Collectives: :meth:`NcclEmulation.all_reduce`, :meth:`~NcclEmulation.reduce_scatter_single`
  and :meth:`~NcclEmulation.all_gather_single` gate gloo's async collectives the same way, on one
  collective stream per rank shared by every group (the worst case of NCCL's rule that
  communicators used concurrently see their operations in one order): one completes when
  every member has it at the head. The runtime routes the stage allreduces and, with a
  sharded optimizer, the reduce-scatters and the prefetched parameter all-gathers through
  it (:func:`emulation`), buckets included, and so do the tensor-parallel layers (the API
  makes the stream with their TP group and hands it to the runtime): with the device plan forced a CPU run
  issues the device path's collectives (:func:`chimera.runtime.sync.comm_choices`). In
  ``strict`` mode the tie and buffer syncs and the API's batch fingerprint and loss take
  the same stream (``PipelineRuntime.all_reduce``). The trainer's loss and norm
  allreduces, checkpoints, communicator creation and ``grid.warm_up``'s exchange go
  straight to gloo: they are blocking and issued in one program order on every rank; a
  recorded virtual run (:func:`chimera.check.rendezvous.replay_recorded`) replays them with the
  rest (the emulation passes every call it does not gate to the transport it wraps). p2p
  and collectives are separate streams except in ``strict`` mode.
- **Start-up.** :func:`agree` refuses, in one line on every rank, an emulation mode or
  device plan that differs across ranks (it would only show as a timeout).
- Timing: a rendezvous costs a few store round trips (microseconds on one host) and a
  thread hand-off, and the polling backs off to :data:`POLL_MAX_S`; CUDA stream semantics
  (a wait that only orders streams) do not exist on CPU.

Every rank must create its transports in the same order (the runtime makes one per Mailbox,
on every rank alike): the n-th transport of each rank shares a namespace of store keys with
the n-th of the others, so a transport abandoned after a timeout cannot confuse the next.
Transports are independent streams: right for Mailboxes used one after another (each
iteration drains its messages), not for two used within one iteration.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from chimera.errors import UserError
from chimera.runtime.context import ENV as OPTION_ENV, EMULATION_MODES, RuntimeOptions
from chimera.runtime.transport import ReduceOp, Transport, Wrapping

__all__ = ["ENV", "MODES", "EmulatedWork", "NcclEmulation", "agree", "emulation", "p2p_transport"]

MODES = EMULATION_MODES  # strictest last
ENV, DEVICE_PLAN_ENV = OPTION_ENV["emulate_nccl"], OPTION_ENV["device_plan"]
PREFIX = "chimera-nccl-emulation"
POLL_MIN_S, POLL_MAX_S = 1e-4, 2e-3  # store polling backs off from min to max while it waits


def p2p_transport(inner: Transport, options: RuntimeOptions) -> Transport:
    """The transport of a Mailbox: ``inner`` itself, or the emulation wrapping it when
    ``options.emulate_nccl`` names a stream mode."""
    return NcclEmulation(inner, options.emulate_nccl) if options.emulate_nccl else inner


def emulation(inner: Transport, options: RuntimeOptions) -> "NcclEmulation | None":
    """The emulation's collective stream (wrapping ``inner``) for the stage collectives
    (GradSync, the shards), or None (no emulation); in ``strict`` mode also the transport of
    every Mailbox (one stream for everything). Create it at the same point on every rank (its
    store keys count)."""
    return NcclEmulation(inner, options.emulate_nccl) if options.emulate_nccl else None


def agree(transport: Transport, options: RuntimeOptions, failed: str | None = None) -> None:
    """Refuse, on every rank and in one line, an NCCL emulation or device plan that differs
    across ranks: one rank emulating NCCL (or bucketing) while its peer does not would only
    show as a communication timeout. ``failed``: why this rank could not build its stages
    (the first failing rank's message is raised on every rank). One small collective at
    start-up."""
    every: list = [None] * transport.get_world_size()
    transport.all_gather_object(every, (options.emulate_nccl, options.device_plan, failed))
    errors = [(r, e[2]) for r, e in enumerate(every) if e[2] is not None]
    if errors:
        rank, why = errors[0]
        raise UserError(why if rank == transport.get_rank() else f"rank {rank}: {why}")
    every = [e[:2] for e in every]
    if len(set(map(tuple, every))) > 1:
        seen = "; ".join(f"rank {r}: {ENV}={e[0]!r} {DEVICE_PLAN_ENV}={e[1]!r}"
                         for r, e in enumerate(every))
        raise UserError(f"rank {transport.get_rank()}: the NCCL emulation and device plan must "
                        f"be set alike on every rank ({seen})")


class EmulatedWork:
    """What the emulation's isend/irecv return: done once the operation met its match."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: str | None = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """True when complete, False on timeout (as gloo's); raises if the operation failed."""
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            return False
        if self._error is not None:
            raise RuntimeError(self._error)
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def finish(self, error: str | None = None) -> None:
        self._error = error
        self._done.set()


@dataclass
class _P2P:
    """One send (``src`` is this rank) or receive (``dst`` is this rank) on a stream."""

    is_send: bool
    src: int
    dst: int
    k: int  # the k-th message from src to dst: NCCL's matching rule
    tag: int
    numel: int
    gloo: object  # the gloo work that moves the data
    work: EmulatedWork = field(default_factory=EmulatedWork)

    def key(self, send_side: bool) -> str:
        return f"{self.src}>{self.dst}#{self.k}/{'send' if send_side else 'recv'}"

    def stamp(self) -> str:
        return f"{self.tag}:{self.numel}"

    def meet(self, emulation: "NcclEmulation") -> None:
        emulation.match(self)

    def __str__(self) -> str:
        if self.is_send:
            return f"send #{self.k} from rank {self.src} to rank {self.dst} (tag {self.tag})"
        return f"receive #{self.k} at rank {self.dst} from rank {self.src} (tag {self.tag})"


@dataclass
class _Collective:
    """One collective (``kind``: allreduce, reduce-scatter, all-gather) on group ``name``
    over ``ranks``, the k-th collective on that group."""

    kind: str
    name: str  # the same on every member: groups are created in one order everywhere
    ranks: tuple[int, ...]
    k: int
    gloo: object
    work: EmulatedWork = field(default_factory=EmulatedWork)

    def key(self) -> str:
        return f"{self.kind}/{self.name}#{self.k}"

    def meet(self, emulation: "NcclEmulation") -> None:
        emulation.gather(self)

    def __str__(self) -> str:
        return f"{self.kind} #{self.k} on group {self.name} (ranks {', '.join(map(str, self.ranks))})"


_Op = _P2P | _Collective  # what a stream holds


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class _Closed(Exception):
    """The transport was closed while an operation waited for its match."""


class _Stream:
    """One FIFO stream: a daemon thread completing its operations in issue order."""

    def __init__(self, owner: "NcclEmulation", name: str):
        self.owner = owner
        self.ops: deque[_Op] = deque()
        self.ready = threading.Condition()
        self.thread = threading.Thread(target=self._serve, name=f"nccl-emulation {name}",
                                       daemon=True)  # never keeps a failed process alive
        self.thread.start()

    def put(self, op: _Op) -> None:
        with self.ready:
            self.ops.append(op)
            self.ready.notify()

    def wake(self) -> None:
        with self.ready:
            self.ready.notify_all()

    def _next(self) -> _Op | None:
        with self.ready:
            while not self.ops and not self.owner.stop.is_set():
                self.ready.wait()
            return None if self.owner.stop.is_set() else self.ops.popleft()

    def _serve(self) -> None:
        failure: str | None = None  # after a failure the stream is broken, like a communicator
        while (op := self._next()) is not None:
            if failure is None:
                failure = self._complete(op)
            else:
                op.work.finish(f"{op}: an earlier operation on its stream failed: {failure}")
            _settle(op)
        for op in self._drain():
            op.work.finish(f"{op}: the NCCL emulation was closed")
            _settle(op)

    def _complete(self, op: _Op) -> str | None:
        """Rendezvous, then let gloo finish; the failure that breaks the stream, if any."""
        try:
            op.meet(self.owner)
            op.gloo.wait()  # both ends are issued: gloo completes unless a peer died
            op.gloo = None
        except _Closed:
            op.work.finish(f"{op}: the NCCL emulation was closed")
            return "closed"
        except Exception as exc:  # noqa: BLE001 - any error fails the work, never the thread
            op.work.finish(f"{op}: {_first_line(exc)}")
            return f"{op}: {_first_line(exc)}"
        op.work.finish()
        return None

    def _drain(self) -> list[_Op]:
        with self.ready:
            rest, self.ops = list(self.ops), deque()
        return rest


def _settle(op: _Op) -> None:
    """Wait for the gloo operation of a finished op, failed or not. gloo must never see an
    issued buffer freed: an abandoned receive leaves its message unread in the pair's TCP
    stream, which blocks every later message between the two ranks (seen as a hung barrier
    with gloo's loop spinning). Blocks until the peer issues its end, or the group dies."""
    if op.gloo is None:
        return
    try:
        op.gloo.wait()
    except Exception:  # noqa: BLE001 - already reported, or the group is being torn down
        pass
    op.gloo = None


class NcclEmulation(Wrapping):
    """The p2p and async collectives of the transport ``inner`` (``isend``, ``irecv``,
    ``all_reduce``, ``reduce_scatter_single``, ``all_gather_single``) under NCCL's rendezvous
    semantics (see the module docstring); every other call goes to ``inner`` as it is.

    ``mode``: ``pair`` (one stream per peer), ``rank`` (one stream for all p2p) or
    ``strict`` (one stream for p2p and collectives together).
    ``store``: the rendezvous store (default: ``inner``'s).
    """

    def __init__(self, inner: Transport, mode: str = "pair", store=None):
        if mode not in MODES:
            raise UserError(f"NCCL emulation mode {mode!r}: choose one of {', '.join(MODES)}")
        super().__init__(inner)
        self.rank, self.mode = inner.get_rank(), mode
        self.rendezvous = store if store is not None else inner.store()
        instance = self.rendezvous.add(f"{PREFIX}/instances/{self.rank}", 1)  # same n on every rank
        self.namespace = f"{PREFIX}/{instance}/"
        self.stop = threading.Event()
        self.sent: dict[int, int] = {}  # per destination: sends issued so far
        self.received: dict[int, int] = {}  # per source: receives issued so far
        self.reduced: dict[str, int] = {}  # per group name: collectives issued so far
        self.kinds: dict[str, int] = {}  # per kind (allreduce, reduce-scatter, all-gather)
        self.streams: dict[object, _Stream] = {}
        self.issuing = threading.Lock()  # issue order is the streams' order, whatever the thread

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, group=None) -> EmulatedWork:
        with self.issuing:
            k = self.sent.get(dst, 0)
            self.sent[dst] = k + 1
            gloo = self.inner.isend(tensor, dst=dst, tag=tag)
            op = _P2P(True, self.rank, dst, k, tag, tensor.numel(), gloo)
            return self._issue(op, self._p2p_stream(dst))

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0, group=None) -> EmulatedWork:
        with self.issuing:
            k = self.received.get(src, 0)
            self.received[src] = k + 1
            gloo = self.inner.irecv(tensor, src=src, tag=tag)
            op = _P2P(False, src, self.rank, k, tag, tensor.numel(), gloo)
            return self._issue(op, self._p2p_stream(src))

    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
        """The inner transport's async allreduce on ``group`` (default: every rank), complete
        only once every member has it at the head of its collective stream (see the module
        docstring)."""
        return self._collective("allreduce", group, async_op, lambda: self.inner.all_reduce(
            tensor, op=op, group=group, async_op=True))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, group=None,
                              async_op: bool = False):
        """The inner transport's async reduce-scatter (sum), gated as :meth:`all_reduce`."""
        return self._collective("reduce-scatter", group, async_op,
                                lambda: self.inner.reduce_scatter_single(output, input, group=group,
                                                                         async_op=True))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, group=None,
                          async_op: bool = False):
        """The inner transport's async all-gather into one tensor, gated as :meth:`all_reduce`."""
        return self._collective("all-gather", group, async_op,
                                lambda: self.inner.all_gather_single(output, input, group=group,
                                                                     async_op=True))

    def _collective(self, kind: str, group, async_op: bool, issue) -> EmulatedWork | None:
        with self.issuing:
            name = "world" if group is None else group.group_name
            ranks = range(self.inner.get_world_size()) if group is None else \
                self.inner.get_process_group_ranks(group)
            k = self.reduced.get(name, 0)
            self.reduced[name] = k + 1
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            op = _Collective(kind, name, tuple(ranks), k, issue())
            work = self._issue(op, "all" if self.mode == "strict" else "collectives")
        if async_op:
            return work
        work.wait()
        return None

    def _p2p_stream(self, peer: int) -> int | str:
        return {"pair": peer, "rank": "p2p", "strict": "all"}[self.mode]

    def _issue(self, op: _Op, stream: int | str) -> EmulatedWork:
        """Queue ``op`` on ``stream``: a peer's rank (pair mode), "p2p", "collectives" or, in
        strict mode, "all"."""
        if self.stop.is_set():
            raise RuntimeError(f"rank {self.rank}: the NCCL emulation is closed")
        if stream not in self.streams:
            label = f"rank {self.rank} with {stream}" if isinstance(stream, int) else \
                f"rank {self.rank} {stream}"
            self.streams[stream] = _Stream(self, label)
        self.streams[stream].put(op)
        return op.work

    def match(self, op: _P2P) -> None:
        """Called by ``op``'s stream when ``op`` is at its head: returns once the matching
        operation is at the head of the peer's stream (raises on a mismatch)."""
        store, mine, theirs = self.rendezvous, op.key(op.is_send), op.key(not op.is_send)
        store.set(self.namespace + mine, op.stamp())
        self._poll(self.namespace + theirs)
        stamp = store.get(self.namespace + theirs).decode()
        store.delete_key(self.namespace + theirs)  # each key has exactly one reader: this one
        if stamp != op.stamp():
            tag, numel = stamp.split(":")
            raise RuntimeError(f"NCCL would match it with tag {tag} ({numel} elements, ours "
                               f"{op.numel}): the two ranks order their messages differently")

    def gather(self, op: _Collective) -> None:
        """Called when ``op`` is at the head of this rank's collective stream: returns once
        every member of its group has it at the head of theirs."""
        key, members = self.namespace + op.key(), len(op.ranks)
        store = self.rendezvous
        store.add(key, 1)
        self._poll(key, lambda: store.add(key, 0) >= members)
        if store.add(key + "/seen", 1) == members:  # the last to see it: nobody polls now
            store.delete_key(key)
            store.delete_key(key + "/seen")

    def _poll(self, key: str, ready=None) -> None:
        """Until ``key`` exists (or ``ready()``); check, not wait: a blocking wait would hold
        the store client that the other streams share."""
        ready = ready or (lambda: self.rendezvous.check([key]))
        delay = POLL_MIN_S
        while not ready():
            if self.stop.is_set():
                raise _Closed
            time.sleep(delay)
            delay = min(2 * delay, POLL_MAX_S)

    def close(self) -> None:
        """Stop the streams; operations still waiting fail (for tests that abandon a hang)."""
        self.stop.set()
        for stream in self.streams.values():
            stream.wake()
        for stream in self.streams.values():
            stream.thread.join(timeout=1.0)

    def __repr__(self) -> str:
        return (f"NcclEmulation({self.inner!r}, rank={self.rank}, mode={self.mode!r}, "
                f"streams={len(self.streams)})")
