"""Virtual ranks: every rank of a pipeline as a thread of one process, p2p as tensor copies.

For a machine with one device (NCCL refuses two ranks on one GPU) and for quick checks:
``run_virtual(world, fn)`` runs ``fn(rank)`` on ``world`` threads, each with its own
transport (:class:`VirtualRank`, in effect on its thread: :func:`chimera.runtime.transport.current`)
onto one in-process :class:`VirtualWorld`. The runtime code is the real one (plan, executor,
mailbox, gradient sync); only the transport differs. Messages are matched by (source,
destination, tag) and buffered, as gloo does: this checks values, not NCCL's ordering rules.
For those, ``VirtualWorld(record=True)`` logs every rank's calls and waits
(:meth:`VirtualWorld.recorded`), which :func:`chimera.check.rendezvous.replay_recorded` replays
under NCCL's strictest model (what ``benchmarks/gpu_check.py`` does with a device run).

Each call names its rank through the transport object it is made on, not the thread it runs
on: on CUDA, autograd runs a backward on its own device thread, and a gradient hook
(``GradSync``'s bucket allreduces) issues its collective there, on the transport it holds.
"""

from __future__ import annotations

import datetime
import functools
import threading
from collections import defaultdict, deque
from typing import Callable

import torch

from chimera.runtime.transport import ReduceOp, Transport, local_store, using

__all__ = ["VirtualAbort", "VirtualRank", "VirtualWorld", "run_virtual"]


class VirtualAbort(RuntimeError):
    """Another virtual rank failed; this one stops waiting."""


class _Work:
    def __init__(self, world: "VirtualWorld", rank: int, done: bool = False,
                 call: int | None = None):
        self.world, self.rank, self.done = world, rank, done
        self.call = call  # index of the call in its rank's record (VirtualWorld(record=True))

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self.call is not None:
            self.world.record(self.rank, "wait", target=self.call)
        limit = None if timeout is None else timeout.total_seconds()
        with self.world.cond:
            ok = self.world.cond.wait_for(lambda: self.done or self.world.failed, limit)
            if self.world.failed and not self.done:
                raise VirtualAbort("a virtual rank failed")
        return bool(ok)

    def is_completed(self) -> bool:
        return self.done


class _Group:
    def __init__(self, key: int, ranks: list[int]):
        self.key, self.ranks = key, sorted(ranks)

    @property
    def group_name(self) -> str:  # as a ProcessGroup's: the same on every member
        return f"virtual-{self.key}"


class VirtualWorld:
    """The shared state of ``world`` virtual ranks: messages in flight, collectives waiting
    for their members, the record. :meth:`rank` gives rank r's transport."""

    def __init__(self, world: int, record: bool = False):
        self.world = world
        self.log: list[list[tuple]] | None = [[] for _ in range(world)] if record else None
        self.cond = threading.Condition()
        self.failed = False
        self.sent: dict[tuple, deque] = defaultdict(deque)  # (src, dst, tag) -> tensors
        self.posted: dict[tuple, deque] = defaultdict(deque)  # (src, dst, tag) -> (buf, work)
        self.calls: dict[tuple, int] = defaultdict(int)  # (rank, group key) -> collectives
        self.pending: dict[tuple, list] = {}  # (group key, seq) -> [(rank, payload, work)]
        self.group_count: dict[int, int] = defaultdict(int)
        self.everyone = _Group(-1, list(range(world)))
        self.shared_store = local_store()  # one store for every rank, as a process group's
        self.ranks = [VirtualRank(self, r) for r in range(world)]

    def rank(self, r: int) -> "VirtualRank":
        return self.ranks[r]

    # -- the record -------------------------------------------------------------------
    def record(self, rank: int, kind: str, **fields) -> int | None:
        """Log a call (or a wait) of ``rank``; its index in the rank's record."""
        if self.log is None:
            return None
        mine = self.log[rank]
        mine.append((kind, fields))
        return len(mine) - 1

    def recorded(self) -> list[list[tuple]]:
        """Per rank, its calls in issue order: (kind, fields); kinds ``isend``/``irecv``
        (peer, tag, size), ``collective`` (name, group key, ranks, size), ``wait`` (target)."""
        return [list(r) for r in self.log or []]

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()


class VirtualRank(Transport):
    """Rank ``rank``'s transport onto a :class:`VirtualWorld`."""

    def __init__(self, world: VirtualWorld, rank: int):
        self.world, self.rank = world, rank

    def __repr__(self) -> str:
        return f"VirtualRank({self.rank} of {self.world.world})"

    # -- who am I ---------------------------------------------------------------------
    def get_rank(self, group=None) -> int:
        return self.rank

    def get_world_size(self, group=None) -> int:
        return self.world.world if group is None else len(group.ranks)

    def is_initialized(self) -> bool:
        return True

    def get_backend(self, group=None) -> str:
        return "virtual"

    def get_process_group_ranks(self, group) -> list[int]:
        return list((group or self.world.everyone).ranks)

    def new_group(self, ranks) -> _Group:
        counts = self.world.group_count
        counts[self.rank] += 1  # every rank creates groups in one order: same key
        return _Group(counts[self.rank], list(ranks))

    def store(self):
        return self.world.shared_store

    # -- p2p --------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, group=None) -> _Work:
        w, key = self.world, (self.rank, dst, tag)
        call = w.record(self.rank, "isend", peer=dst, tag=tag, size=tensor.numel())
        with w.cond:
            if w.posted[key]:
                buf, work = w.posted[key].popleft()
                buf.copy_(tensor)
                work.done = True
                w.cond.notify_all()
            else:
                w.sent[key].append(tensor.detach().clone())
        return _Work(w, self.rank, done=True, call=call)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0, group=None) -> _Work:
        w, key = self.world, (src, self.rank, tag)
        call = w.record(self.rank, "irecv", peer=src, tag=tag, size=tensor.numel())
        with w.cond:
            if w.sent[key]:
                tensor.copy_(w.sent[key].popleft())
                return _Work(w, self.rank, done=True, call=call)
            work = _Work(w, self.rank, call=call)
            w.posted[key].append((tensor, work))
            return work

    # -- collectives ------------------------------------------------------------------
    def _collective(self, group, payload, finish, name: str = "", size: int = 0) -> _Work:
        w, g = self.world, group or self.world.everyone
        call = w.record(self.rank, "collective", name=name, group=g.key, ranks=tuple(g.ranks),
                        size=size)
        with w.cond:
            w.calls[(self.rank, g.key)] += 1
            key = (g.key, w.calls[(self.rank, g.key)])
            work = _Work(w, self.rank, call=call)
            entries = w.pending.setdefault(key, [])
            entries.append((self.rank, payload, work))
            if len(entries) == len(g.ranks):
                finish(sorted(entries, key=lambda e: e[0]))
                for *_, done in entries:
                    done.done = True
                del w.pending[key]
                w.cond.notify_all()
        return work

    @staticmethod
    def _finish(work: _Work, async_op: bool):
        return work if async_op else work.wait()

    def all_reduce(self, tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
        def finish(entries):
            values = [t.detach().clone() for _, t, _ in entries]
            total = functools.reduce(torch.maximum, values) if op == ReduceOp.MAX else sum(values)
            for _, t, _ in entries:
                t.copy_(total)
        return self._finish(self._collective(group, tensor, finish, "all_reduce", tensor.numel()),
                            async_op)

    def reduce_scatter_single(self, output, input, group=None, async_op: bool = False):
        def finish(entries):
            total = sum(i.detach().clone() for _, (_, i), _ in entries)
            for k, (_, (o, _), _) in enumerate(entries):
                o.copy_(total[k * o.numel():(k + 1) * o.numel()])
        work = self._collective(group, (output, input), finish, "reduce_scatter", input.numel())
        return self._finish(work, async_op)

    def all_gather_single(self, output, input, group=None, async_op: bool = False):
        def finish(entries):
            whole = torch.cat([i.detach().reshape(-1) for _, (_, i), _ in entries])
            for _, (o, _), _ in entries:
                o.copy_(whole)
        work = self._collective(group, (output, input), finish, "all_gather", output.numel())
        return self._finish(work, async_op)

    def all_gather(self, tensor_list, tensor, group=None, async_op: bool = False):
        def finish(entries):
            for _, (out, _), _ in entries:
                for o, (_, (_, t), _) in zip(out, entries):
                    o.copy_(t)
        work = self._collective(group, (tensor_list, tensor), finish, "all_gather", tensor.numel())
        return self._finish(work, async_op)

    def broadcast(self, tensor, src: int, group=None, async_op: bool = False):
        def finish(entries):
            source = next(t for r, t, _ in entries if r == src).detach().clone()
            for _, t, _ in entries:
                t.copy_(source)
        return self._finish(self._collective(group, tensor, finish, "broadcast", tensor.numel()),
                            async_op)

    def broadcast_object_list(self, object_list: list, src: int = 0, group=None) -> None:
        def finish(entries):
            source = list(next(o for r, o, _ in entries if r == src))
            for _, o, _ in entries:
                o[:] = source
        self._collective(group, object_list, finish, "broadcast_object_list").wait()

    def all_gather_object(self, object_list: list, obj, group=None) -> None:
        def finish(entries):
            values = [o for _, (o, _), _ in entries]
            for _, (_, target), _ in entries:
                target[:] = values
        self._collective(group, (obj, object_list), finish, "all_gather_object").wait()

    def gather_object(self, obj, object_gather_list=None, dst: int = 0, group=None) -> None:
        def finish(entries):
            target = next(t for r, (_, t), _ in entries if r == dst)
            target[:] = [o for _, (o, _), _ in entries]
        self._collective(group, (obj, object_gather_list), finish, "gather_object").wait()

    def barrier(self, group=None, device_ids=None) -> None:
        self._collective(group, None, lambda entries: None, "barrier").wait()


def run_virtual(world: int, fn: Callable[[int], object], vw: VirtualWorld | None = None) -> list:
    """``fn(rank)`` for every rank on its own thread, with that rank's transport in effect
    (``vw.rank(rank)``: :func:`chimera.runtime.transport.current` on the thread); their
    results, by rank. The first failure is raised here (the other ranks stop waiting).
    ``vw``: the world to use (one made with ``record=True`` keeps every call for a replay)."""
    vw = vw or VirtualWorld(world)
    results: list = [None] * world
    errors: list = [None] * world

    def body(rank: int) -> None:
        try:
            with using(vw.rank(rank)):
                results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors[rank] = exc
            vw.fail()

    threads = [threading.Thread(target=body, args=(r,), name=f"virtual-rank-{r}")
               for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    root = [e for e in errors if e is not None and not isinstance(e, VirtualAbort)]
    if root or any(errors):
        raise (root or [e for e in errors if e is not None])[0]
    return results
