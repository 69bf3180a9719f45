"""Event simulator: executes per-rank programs with the dependency rules the runtime obeys.

Each rank runs its program in order on one compute stream. A compute action starts when the
previous action of its rank has ended and what it needs (:func:`chimera.ir.needs`) has run.
A cross-rank input arrives one p2p hop after its producer ended. In a lowered program the
hop is paid by the RECV action (the runtime waits there); SEND is asynchronous. SYNC starts
the allreduce of one replica's gradients once every replica of that stage has issued it;
STEP waits for all of the rank's allreduces.

Because programs are fixed, the simulation is a longest-path computation in two parts.
Whether an action may run depends only on *which* actions ran before, never on *when*, so
:func:`compile_schedule` sweeps the ranks once to find an execution order and each action's
producers (a sweep that makes no progress is a deadlock); :meth:`CompiledSchedule.run` then
times that order under a cost model in one linear pass. A planner that prices one schedule
under many cost models compiles it once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from functools import cache, cached_property

from chimera.ir import (COMPUTE_OPS, GRADIENT_ENDS, Action, Op, Schedule, ScheduleError, needs,
                        other_end)
from chimera.sim.cost import CostModel
from chimera.sim.timeline import Event, RankStats, Timeline

_COMPUTE, _SEND, _RECV, _SYNC, _STEP = range(5)
_KIND = {Op.F: _COMPUTE, Op.B: _COMPUTE, Op.I: _COMPUTE, Op.W: _COMPUTE,
         Op.SEND_F: _SEND, Op.SEND_B: _SEND, Op.RECV_F: _RECV, Op.RECV_B: _RECV,
         Op.SYNC: _SYNC, Op.STEP: _STEP}
# Hot loops key dicts by these ints: an Enum member hashes in Python (slow), id() does not.
_CODE = {id(op): i for i, op in enumerate(Op)}
_KIND_OF = [_KIND[op] for op in Op]  # by code
_DONE_CODE = [_CODE[id({Op.I: Op.B}.get(op, op))] for op in Op]  # I finishes what B would


class Deadlock(ScheduleError):
    """No rank can make progress: ``blocked[rank] = (index, action)`` it waits at."""

    def __init__(self, schedule: Schedule, blocked: dict[int, tuple[int, Action]]):
        self.schedule, self.blocked = schedule, blocked
        first = min(blocked)
        idx, action = blocked[first]
        super().__init__(f"deadlock: {len(blocked)} ranks blocked; rank {first} waits at "
                         f"action {idx} ({action})")


@dataclass(frozen=True)
class Times:
    """What one timed pass produced; ``start[i]``/``end[i]`` follow ``CompiledSchedule.order``."""

    start: list[float]
    end: list[float]
    makespan: float
    busy: list[float]  # compute time per rank, its optimizer step included
    compute_end: float  # end of the last compute action (what follows is gradient sync)
    collectives: list[tuple[int, int, float, float]]
    optimizer: list[float]  # per rank: its optimizer step (0 without a STEP)


def simulate(schedule: Schedule, cost: CostModel | None = None) -> Timeline:
    """Run ``schedule`` under ``cost`` (unit times 1:1 by default) and return its Timeline."""
    cost = cost or CostModel.unit()
    return compile_schedule(schedule, blocking_sync=not cost.overlap_allreduce).run(cost)


def compile_schedule(schedule: Schedule, blocking_sync: bool = False) -> "CompiledSchedule":
    """Find the cost-independent execution order of ``schedule`` (raises :class:`Deadlock`).

    ``blocking_sync``: a SYNC holds its rank until every replica of the stage has issued
    (the order for ``CostModel(overlap_allreduce=False)``).
    """
    return CompiledSchedule(schedule, blocking_sync)


class CompiledSchedule:
    """A schedule's actions in a valid execution order, each with the indices of its inputs."""

    def __init__(self, schedule: Schedule, blocking_sync: bool = False):
        self.schedule, self.blocking_sync = schedule, blocking_sync
        self.order: list[tuple[int, Action]] = []  # (rank, action)
        # deps[i]: ((index of producer, stage whose hop is paid or -1), ...)
        self.deps: list[tuple[tuple[int, int], ...]] = []
        self.kinds: list[int] = []
        self.total_syncs = sum(a.op is Op.SYNC for prog in schedule.programs for a in prog)
        self._last_grad: dict[tuple[int, int], int] | None = None
        _Sweep(self).run()

    @property
    def ranks(self) -> int:
        return self.schedule.ranks

    @cached_property
    def slots(self) -> tuple[list[tuple[Op, int]], list[int]]:
        """The (op, stage) pairs of the compute actions, and per action of :attr:`order` the
        index of its pair plus one (0: not a compute action): durations are priced per pair."""
        index: dict[tuple[int, int], int] = {}
        pairs: list[tuple[Op, int]] = []
        out = [0] * len(self.order)
        for i, (_, a) in enumerate(self.order):
            if self.kinds[i] == _COMPUTE:
                key = (_CODE[id(a.op)], a.stage)
                if key not in index:
                    pairs.append((a.op, a.stage))
                    index[key] = len(pairs)
                out[i] = index[key]
        return pairs, out

    def run(self, cost: CostModel) -> Timeline:
        """Time every action under ``cost``: the full Timeline (events, stats, memory)."""
        s, t = self.schedule, self.times(cost)
        events = [Event(rank, a, t.start[i], t.end[i]) for i, (rank, a) in enumerate(self.order)]
        events.sort(key=lambda e: (e.rank, e.start, e.end))
        stats = [RankStats(r, t.busy[r], *_memory(s, r, cost.w_keeps)) for r in range(s.ranks)]
        return Timeline(s, events, t.makespan, stats, collectives=t.collectives)

    def times(self, cost: CostModel, eager_sync: bool = False) -> Times:
        """One linear pass over :attr:`order`; no events are built (what a planner needs).

        ``eager_sync`` on an *unlowered* schedule prices gradient sync and the step exactly as
        ``passes.lower(schedule, "eager")`` would place them (a replica's allreduce issued at
        the end of its last gradient action, each rank's STEP after its last action and its
        stages' allreduces; unlowered hops equal lowered SEND/RECV pairs) without building
        the communication actions: a third of the actions to time (allreduce overlapped).
        """
        if eager_sync and (self.schedule.lowered or not cost.overlap_allreduce):
            raise ScheduleError("eager_sync prices an unlowered schedule with overlapped allreduce")
        if cost.overlap_allreduce == self.blocking_sync and self.total_syncs:
            raise ScheduleError("compiled with blocking_sync={} but the cost model has "
                                "overlap_allreduce={}".format(self.blocking_sync, cost.overlap_allreduce))
        s = self.schedule
        dur = _durations(self, cost)
        hop = [cost.hop(k, s.stages, s.micro_scale) for k in range(s.stages)]
        n = len(self.order)
        start, end = [0.0] * n, [0.0] * n
        clock, busy = [0.0] * s.ranks, [0.0] * s.ranks
        sync = _SyncState(self, cost)
        kinds, deps, order = self.kinds, self.deps, self.order
        compute_end = 0.0
        for i in range(n):
            rank, kind = order[i][0], kinds[i]
            t = clock[rank]
            if kind == _COMPUTE:
                for j, stage in deps[i]:
                    e = end[j] + hop[stage] if stage >= 0 else end[j]
                    if e > t:
                        t = e
                start[i] = t
                t += dur[i]
                busy[rank] += dur[i]
                if t > compute_end:
                    compute_end = t
            elif kind == _RECV:
                j, stage = deps[i][0]
                start[i] = t
                t = max(t, end[j] + hop[stage])
            elif kind == _SEND:
                start[i] = t
            elif kind == _SYNC:
                start[i] = t
                t = sync.issue(i, t, clock)
            else:  # STEP
                start[i] = t
                t = sync.step(rank, t)
            end[i] = clock[rank] = t
        makespan = max(end, default=0.0)
        if eager_sync:
            makespan = max([makespan] + sync.after_program(self.last_gradients(), end, clock))
        optimizer = sync.updates if eager_sync or Op.STEP in s.ops else [0.0] * s.ranks
        busy = [x + y for x, y in zip(busy, optimizer)]  # the optimizer's work is not a bubble
        return Times(start, end, makespan, busy, compute_end, sync.collectives, optimizer)

    def last_gradients(self) -> dict[tuple[int, int], int]:
        """(pipe, stage) replica -> index of its last gradient action (B, or W if split)."""
        if self._last_grad is None:
            self._last_grad = {(a.pipe, a.stage): i for i, (_, a) in enumerate(self.order)
                               if a.op in GRADIENT_ENDS}
        return self._last_grad


def _durations(c: CompiledSchedule, cost: CostModel) -> list[float]:
    """Each action's duration, priced once per (op, stage) pair."""
    s, (pairs, slot) = c.schedule, c.slots
    table = [0.0] + [cost.compute(op, stage, s.stages, s.ranks, s.micro_scale) for op, stage in pairs]
    return [table[k] for k in slot]


class _Sweep:
    """Finds an execution order: a rank runs as far as its inputs allow, then waits on the
    one input it lacks and is woken when that input is produced (each action is looked at
    O(1) times). Any valid order gives the same times, since each rank keeps its program
    order and every action starts at the max of its inputs' ends."""

    def __init__(self, c: CompiledSchedule):
        self.c, self.s = c, c.schedule
        self.lowered = self.s.lowered
        self.table = self.s.placement.table
        self.waits = _waits_table(self.s.stages, self.s.split_backward)
        # (code, pipe, stage, micro) -> index: F/B/W done (I counts as B), or a SEND's
        self.produced: dict[tuple, int] = {}
        self.waiters: dict[object, list[int]] = {}
        self.reached: dict[int, list[int]] = {}  # stage -> ranks waiting at a blocking SYNC
        self.issued = 0
        self.pos = [0] * self.s.ranks
        self.ready = deque(range(self.s.ranks))
        self.queued = [True] * self.s.ranks

    def run(self) -> None:
        progs = self.s.programs
        while self.ready:
            rank = self.ready.popleft()
            self.queued[rank] = False
            self.advance(rank, progs[rank])
        blocked = {r: (self.pos[r], progs[r][self.pos[r]])
                   for r in range(self.s.ranks) if self.pos[r] < len(progs[r])}
        if blocked:
            raise Deadlock(self.s, blocked)

    def advance(self, rank: int, prog: tuple[Action, ...]) -> None:
        """Place rank's actions in program order until one lacks an input, which it then
        waits for."""
        while self.pos[rank] < len(prog):
            a = prog[self.pos[rank]]
            code = _CODE[id(a.op)]
            if _KIND_OF[code] == _COMPUTE:  # most actions: placed here, without step()
                deps, missing = self.inputs(rank, a, code)
                if missing is None:
                    self.place(rank, a, deps, (_DONE_CODE[code], a.pipe, a.stage, a.micro))
                    continue
            else:
                missing = self.step(rank, a)
                if missing is None:
                    continue
            self.waiters.setdefault(missing, []).append(rank)
            return

    def wake(self, key: object) -> None:
        for rank in self.waiters.pop(key, ()):
            if not self.queued[rank]:
                self.queued[rank] = True
                self.ready.append(rank)

    def place(self, rank: int, a: Action, deps: tuple = (), key: tuple | None = None) -> None:
        index = len(self.c.order)
        self.c.order.append((rank, a))
        self.c.kinds.append(_KIND_OF[_CODE[id(a.op)]])
        self.c.deps.append(deps)
        self.pos[rank] += 1
        if key is not None:
            self.produced[key] = index
            self.wake(key)

    def step(self, rank: int, a: Action) -> object | None:
        """Place communication action ``a``; or return the key of what it waits for."""
        code = _CODE[id(a.op)]
        kind = _KIND_OF[code]
        if kind == _SEND:
            self.place(rank, a, (), (code, a.pipe, a.stage, a.micro))
        elif kind == _RECV:
            send, src = self.waits[code][a.stage][0]
            key = (send, a.pipe, src, a.micro)
            index = self.produced.get(key)
            if index is None:
                return key
            self.place(rank, a, ((index, a.stage if src > a.stage else src),))
        elif kind == _SYNC:
            return self.sync(rank, a)
        else:  # STEP
            if self.issued < self.c.total_syncs:
                return "all syncs"
            self.place(rank, a)
        return None

    def issue(self) -> None:
        self.issued += 1
        if self.issued == self.c.total_syncs:
            self.wake("all syncs")

    def sync(self, rank: int, a: Action) -> object | None:
        if not self.c.blocking_sync:
            self.place(rank, a)
            self.issue()
            return None
        waiting = self.reached.setdefault(a.stage, [])
        if rank not in waiting:
            waiting.append(rank)
            self.issue()
        if len(waiting) < len(self.s.placement.replicas(a.stage)):
            return ("sync", a.stage)
        for r in waiting:  # all replicas issued: the allreduce runs, every replica goes on
            self.place(r, self.s.programs[r][self.pos[r]])
        self.wake(("sync", a.stage))
        return None

    def inputs(self, rank: int, a: Action, code: int) -> tuple[tuple, tuple | None]:
        """(producers of a compute action's inputs, None), or ((), key of one not run yet)."""
        pipe, at, micro = a.pipe, a.stage, a.micro
        deps = []
        produced, row = self.produced, self.table[pipe]
        for need, stage in self.waits[code][at]:
            key = (need, pipe, stage, micro)
            index = produced.get(key)
            if index is None:
                return (), key
            remote = not self.lowered and row[stage] != rank
            deps.append((index, (stage if stage < at else at) if remote else -1))
        return tuple(deps), None


_Keys = tuple[tuple[int, int], ...]  # (code, stage) of keys in _Sweep.produced


@cache
def _waits_table(stages: int, split_backward: bool) -> tuple[tuple[_Keys, ...], ...]:
    """``table[code][stage]``: what an action of that op and stage waits for, derived once per
    pipe shape from the rule in :mod:`chimera.ir` (the sweep looks it up per action instead of
    building the actions it needs)."""
    waits = COMPUTE_OPS | {Op.RECV_F, Op.RECV_B}
    return tuple(tuple(_wait_keys(Action(op, 0, s, 0), stages, split_backward) for s in range(stages))
                 if op in waits else () for op in Op)


def _wait_keys(action: Action, stages: int, split_backward: bool) -> _Keys:
    """A compute action waits for what it :func:`~chimera.ir.needs` (I done counts as B done),
    a RECV for the SEND at its :func:`~chimera.ir.other_end`."""
    if action.op.is_compute:
        needed = needs(action, stages, split_backward)
        return tuple((_DONE_CODE[_CODE[id(n.op)]], n.stage) for n in needed)
    end = other_end(action, stages)
    return ((_CODE[id(end.op)], end.stage),) if end else ((-1, -1),)  # no sender: a deadlock


class _SyncState:
    """Allreduce bookkeeping of one timed pass: SYNC issue times, then one reduction plan."""

    def __init__(self, c: CompiledSchedule, cost: CostModel):
        self.c, self.s, self.cost = c, c.schedule, cost
        self.issued: dict[int, list[float]] = {}  # stage -> SYNC issue times
        self.reduced: dict[int, float] | None = None
        self.collectives: list[tuple[int, int, float, float]] = []

    def issue(self, i: int, t: float, clock: list[float]) -> float:
        stage = self.c.order[i][1].stage
        if not self.c.blocking_sync:
            self.issued.setdefault(stage, []).append(t)
            return t
        if stage not in self.issued:  # the replicas were placed together, each at its SYNC
            ranks = [r for r, _ in self.c.order[i:i + len(self.s.placement.replicas(stage))]]
            self.issued[stage] = [clock[r] for r in ranks]
        times = self.issued[stage]
        return max(times) + self.cost.sync(stage, self.s.stages, self.group(stage), self.s.ranks)

    def after_program(self, last_grad: dict, end: list[float], clock: list[float]) -> list[float]:
        """Eager sync of an unlowered schedule: issue at each replica's last gradient action,
        then each rank's STEP; returns the STEP end of every rank."""
        for (_, stage), i in sorted(last_grad.items(), key=lambda item: item[1]):
            self.issued.setdefault(stage, []).append(end[i])
        return [self.step(rank, clock[rank]) for rank in range(self.s.ranks)]

    def group(self, stage: int) -> int:
        return len(self.s.placement.replicas(stage)) * self.cost.data_parallel

    def step(self, rank: int, t: float) -> float:
        """The end of ``rank``'s STEP: its stages' allreduces, then its optimizer updates, and
        with a sharded optimizer the all-gather its next iteration's first forward waits for."""
        reduced = self.reduce_all()
        held = [reduced[stage] for _, stage in self.s.placement.held(rank) if stage in reduced]
        return max([t] + held) + self.updates[rank] + self.first_gather(rank)

    def first_gather(self, rank: int) -> float:
        """Sharded: the all-gather of the stage ``rank`` runs first, waited for before it."""
        if not self.cost.shard_optimizer:  # (the planner times thousands of unsharded runs)
            return 0.0
        first = next((a.stage for a in self.s.programs[rank] if a.op is Op.F), None)
        if first is None:
            return 0.0
        return self.cost.gather(first, self.s.stages, self.group(first), self.s.ranks)

    @cached_property
    def updates(self) -> list[float]:
        """Per rank, its optimizer's time: one update per replica it holds."""
        s, cost = self.s, self.cost
        if not any(cost.optimizer):
            return [0.0] * s.ranks
        return [sum(cost.step_time(stage, s.stages, s.ranks, self.group(stage))
                    for _, stage in s.placement.held(rank)) for rank in range(s.ranks)]

    def reduce_all(self) -> dict[int, float]:
        """Allreduce ends once every SYNC is issued: stages in order of readiness, each rank's
        collectives one after another on its communication channel (as NCCL/gloo run them)."""
        if self.reduced is not None:
            return self.reduced
        self.reduced, channel = {}, [0.0] * self.s.ranks
        for ready, stage in sorted((max(times), stage) for stage, times in self.issued.items()):
            members = set(self.s.placement.replicas(stage))
            start = max([ready] + [channel[r] for r in members])
            end = start + self.cost.sync(stage, self.s.stages, self.group(stage), self.s.ranks)
            self.reduced[stage] = end
            if end > start:
                for r in members:
                    channel[r] = end
                    self.collectives.append((r, stage, start, end))
        return self.reduced


def _memory(s: Schedule, rank: int, w_keeps: float = 1.0) -> tuple[float, float]:
    """(peak activations in Ma, weights in Mθ) for one rank. F takes a micro-batch's
    activations; B frees them; I frees what W does not need (``1 - w_keeps`` of them), W
    the rest."""
    size = s.ranks / s.stages * s.micro_scale  # a stage is this many D-ths of the model
    freed = {Op.B: size, Op.I: size * (1.0 - w_keeps), Op.W: size * w_keeps}
    held, peak = 0.0, 0.0
    for action in s.programs[rank]:
        if action.op is Op.F:
            held += size
            peak = max(peak, held)
        else:
            held -= freed.get(action.op, 0.0)
    return peak, len(s.placement.held(rank)) * s.ranks / s.stages
