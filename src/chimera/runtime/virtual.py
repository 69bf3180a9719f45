"""Virtual ranks: every rank of a pipeline as a thread of one process, p2p as tensor copies.

For a machine with one device (NCCL refuses two ranks on one GPU) and for quick checks:
``run_virtual(world, fn)`` runs ``fn(rank)`` on ``world`` threads while the runtime's
``torch.distributed`` calls go to an in-process stand-in. The runtime code is the real one
(plan, executor, mailbox, gradient sync); only the transport differs. Messages are matched
by (source, destination, tag) and buffered, as gloo does: this checks values, not NCCL's
ordering rules. For those, ``VirtualWorld(record=True)`` logs every rank's calls and waits
(:meth:`VirtualWorld.recorded`), which :func:`chimera.check.rendezvous.replay_recorded` replays
under NCCL's strictest model (what ``benchmarks/gpu_check.py`` does with a device run).

Thread identity: each rank is a thread, and a call to ``dist`` finds its rank in
thread-local state. On CUDA, autograd runs a backward on its own device thread, so a
gradient hook (``GradSync``'s bucket allreduces) would call ``dist`` from a thread that is
no rank; a hook registered by a rank's thread therefore runs as that rank (:func:`patched`).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import sys
import threading
from collections import defaultdict, deque
from typing import Callable
from unittest import mock

import torch

# Modules whose ``dist`` the runtime (and the trainer) call through.
PATCHED = ("chimera.api", "chimera.runtime.p2p", "chimera.runtime.sync", "chimera.runtime.pipeline",
           "chimera.runtime.shard", "chimera.runtime.shared", "chimera.runtime.nccl_emulation",
           "chimera.runtime.grid", "chimera.train.loop", "chimera.train.faults",
           "chimera.train.equivalence")


class VirtualAbort(RuntimeError):
    """Another virtual rank failed; this one stops waiting."""


class _Work:
    def __init__(self, world: "VirtualWorld", done: bool = False, call: int | None = None):
        self.world, self.done = world, done
        self.call = call  # index of the call in its rank's record (VirtualWorld(record=True))

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self.call is not None:
            self.world.record("wait", target=self.call)
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


class VirtualWorld:
    """The shared state of ``world`` virtual ranks; methods mirror ``torch.distributed``."""

    class ReduceOp:
        SUM, MAX = "sum", "max"

    def __init__(self, world: int, record: bool = False):
        self.world, self.local = world, threading.local()
        self.log: list[list[tuple]] | None = [[] for _ in range(world)] if record else None
        self.cond = threading.Condition()
        self.failed = False
        self.sent: dict[tuple, deque] = defaultdict(deque)  # (src, dst, tag) -> tensors
        self.posted: dict[tuple, deque] = defaultdict(deque)  # (src, dst, tag) -> (buf, work)
        self.calls: dict[tuple, int] = defaultdict(int)  # (rank, group key) -> collectives
        self.pending: dict[tuple, list] = {}  # (group key, seq) -> [(rank, payload, work)]
        self.group_count: dict[int, int] = defaultdict(int)
        self.everyone = _Group(-1, list(range(world)))

    # -- the record -------------------------------------------------------------------
    def record(self, kind: str, **fields) -> int | None:
        """Log a call (or a wait) of the calling rank; its index in the rank's record."""
        if self.log is None:
            return None
        mine = self.log[self.local.rank]
        mine.append((kind, fields))
        return len(mine) - 1

    def recorded(self) -> list[list[tuple]]:
        """Per rank, its calls in issue order: (kind, fields); kinds ``isend``/``irecv``
        (peer, tag, size), ``collective`` (name, group key, ranks, size), ``wait`` (target)."""
        return [list(r) for r in self.log or []]

    def _collective_call(self, name: str, group, size: int) -> int | None:
        g = group or self.everyone
        return self.record("collective", name=name, group=g.key, ranks=tuple(g.ranks), size=size)

    # -- who am I ---------------------------------------------------------------------
    def get_rank(self, group=None) -> int:
        return self.local.rank

    def get_world_size(self, group=None) -> int:
        return self.world if group is None else len(group.ranks)

    def is_initialized(self) -> bool:
        return True

    def get_backend(self, group=None) -> str:
        return "virtual"

    def get_process_group_ranks(self, group) -> list[int]:
        return list((group or self.everyone).ranks)

    def new_group(self, ranks, **_) -> _Group:
        rank = self.local.rank
        self.group_count[rank] += 1  # every rank creates groups in one order: same key
        return _Group(self.group_count[rank], list(ranks))

    # -- p2p --------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, group=None) -> _Work:
        key = (self.local.rank, dst, tag)
        call = self.record("isend", peer=dst, tag=tag, size=tensor.numel())
        with self.cond:
            if self.posted[key]:
                buf, work = self.posted[key].popleft()
                buf.copy_(tensor)
                work.done = True
                self.cond.notify_all()
            else:
                self.sent[key].append(tensor.detach().clone())
        return _Work(self, done=True, call=call)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0, group=None) -> _Work:
        key = (src, self.local.rank, tag)
        call = self.record("irecv", peer=src, tag=tag, size=tensor.numel())
        with self.cond:
            if self.sent[key]:
                tensor.copy_(self.sent[key].popleft())
                return _Work(self, done=True, call=call)
            work = _Work(self, call=call)
            self.posted[key].append((tensor, work))
            return work

    def send(self, tensor, dst, tag=0, group=None) -> None:
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor, src, tag=0, group=None) -> None:
        self.irecv(tensor, src, tag).wait()

    # -- collectives ------------------------------------------------------------------
    def _collective(self, group, payload, finish, name: str = "", size: int = 0) -> _Work:
        call = self._collective_call(name, group, size)
        group = group or self.everyone
        rank = self.local.rank
        with self.cond:
            self.calls[(rank, group.key)] += 1
            key = (group.key, self.calls[(rank, group.key)])
            work = _Work(self, call=call)
            entries = self.pending.setdefault(key, [])
            entries.append((rank, payload, work))
            if len(entries) == len(group.ranks):
                finish(sorted(entries, key=lambda e: e[0]))
                for *_, w in entries:
                    w.done = True
                del self.pending[key]
                self.cond.notify_all()
        return work

    def all_reduce(self, tensor, op=None, group=None, async_op: bool = False):
        def finish(entries):
            values = [t.detach().clone() for _, t, _ in entries]
            total = functools.reduce(torch.maximum, values) if op == self.ReduceOp.MAX \
                else sum(values)
            for _, t, _ in entries:
                t.copy_(total)
        work = self._collective(group, tensor, finish, "all_reduce", tensor.numel())
        return work if async_op else work.wait()

    def reduce_scatter_single(self, output, input, op=None, group=None, async_op: bool = False):
        def finish(entries):
            total = sum(i.detach().clone() for _, (_, i), _ in entries)
            for k, (_, (o, _), _) in enumerate(entries):
                o.copy_(total[k * o.numel():(k + 1) * o.numel()])
        work = self._collective(group, (output, input), finish, "reduce_scatter", input.numel())
        return work if async_op else work.wait()

    def all_gather_single(self, output, input, group=None, async_op: bool = False):
        def finish(entries):
            whole = torch.cat([i.detach().reshape(-1) for _, (_, i), _ in entries])
            for _, (o, _), _ in entries:
                o.copy_(whole)
        work = self._collective(group, (output, input), finish, "all_gather", output.numel())
        return work if async_op else work.wait()

    reduce_scatter_tensor = reduce_scatter_single  # the names before torch 2.13
    all_gather_into_tensor = all_gather_single

    def broadcast(self, tensor, src: int, group=None, async_op: bool = False):
        def finish(entries):
            source = next(t for r, t, _ in entries if r == src).detach().clone()
            for _, t, _ in entries:
                t.copy_(source)
        work = self._collective(group, tensor, finish, "broadcast", tensor.numel())
        return work if async_op else work.wait()

    def broadcast_object_list(self, objects: list, src: int = 0, group=None, **_) -> None:
        def finish(entries):
            source = list(next(o for r, o, _ in entries if r == src))
            for _, o, _ in entries:
                o[:] = source
        self._collective(group, objects, finish, "broadcast_object_list").wait()

    def all_gather_object(self, out: list, obj, group=None) -> None:
        def finish(entries):
            values = [o for _, (o, _), _ in entries]
            for _, (_, target), _ in entries:
                target[:] = values
        self._collective(group, (obj, out), finish, "all_gather_object").wait()

    def barrier(self, group=None, **_) -> None:
        self._collective(group, None, lambda entries: None, "barrier").wait()

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()


@contextlib.contextmanager
def patched(world: VirtualWorld):
    """The runtime's modules call ``world`` instead of ``torch.distributed``, and gradient
    hooks registered by a rank's thread run as that rank, whichever thread runs them."""
    with contextlib.ExitStack() as stack:
        for name in PATCHED:
            if name in sys.modules:
                stack.enter_context(mock.patch.object(sys.modules[name], "dist", world))
        original = torch.Tensor.register_post_accumulate_grad_hook
        stack.enter_context(mock.patch.object(
            torch.Tensor, "register_post_accumulate_grad_hook",
            functools.partialmethod(_register_as_rank, world, original)))
        yield


def _register_as_rank(tensor, world: VirtualWorld, original, hook):
    """``tensor.register_post_accumulate_grad_hook(hook)``, the hook bound to the registering
    rank: CUDA's autograd calls it on its device thread, shared by every virtual rank."""
    rank = getattr(world.local, "rank", None)
    if rank is None:
        return original(tensor, hook)
    return original(tensor, functools.partial(_run_as, world, rank, hook))


def _run_as(world: VirtualWorld, rank: int, hook, *args):
    saved = getattr(world.local, "rank", None)
    world.local.rank = rank
    try:
        return hook(*args)
    finally:
        if saved is None:
            del world.local.rank
        else:
            world.local.rank = saved


def run_virtual(world: int, fn: Callable[[int], object], vw: VirtualWorld | None = None) -> list:
    """``fn(rank)`` for every rank on its own thread; their results, by rank. The first
    failure is raised here (the other ranks stop waiting). ``vw``: the world to use (one
    made with ``record=True`` keeps every call for a replay)."""
    import chimera.api  # noqa: F401  (import what PATCHED names before patching)
    import chimera.runtime.pipeline  # noqa: F401
    import chimera.train.equivalence  # noqa: F401
    import chimera.train.loop  # noqa: F401

    vw = vw or VirtualWorld(world)
    results: list = [None] * world
    errors: list = [None] * world

    def body(rank: int) -> None:
        vw.local.rank = rank
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            errors[rank] = exc
            vw.fail()

    with patched(vw):
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
