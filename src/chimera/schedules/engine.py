"""A slot-level list scheduler that turns a placement plus rules into per-rank programs.

Chimera with Q > 2 pipes and GEMS are defined as 1F1B pipelines merged per worker (two-pipe
Chimera follows the paper code's slot rule instead, :mod:`chimera.schedules.chimera_slots`).
Rather than encode such a merge as hand-written loops, generators describe
the work as tasks with dependencies, a per-replica limit on micro-batches in flight (the
1F1B window, which bounds activation memory) and a priority, and this engine plays them out
in time with the given shaping costs. The result is only an *order* per rank; timing is the
simulator's job.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Sequence

from chimera.ir import Action, Op, OpTimes, Placement, ScheduleError


@dataclass
class Tasks:
    """Slots as parallel lists (index = task id); a slot is one or more actions of one
    replica run back to back on its rank."""

    op: list[Op] = field(default_factory=list)
    pipe: list[int] = field(default_factory=list)
    stage: list[int] = field(default_factory=list)
    micros: list[tuple[int, ...]] = field(default_factory=list)
    rank: list[int] = field(default_factory=list)
    duration: list[float] = field(default_factory=list)
    deps: list[list[int]] = field(default_factory=list)
    succs: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.op)

    def add(self, rank: int, op: Op, pipe: int, stage: int, micros: tuple[int, ...],
            duration: float, deps: list[int]) -> int:
        t = len(self.op)
        for column, value in ((self.op, op), (self.pipe, pipe), (self.stage, stage),
                              (self.micros, micros), (self.rank, rank), (self.duration, duration),
                              (self.deps, deps), (self.succs, [])):
            column.append(value)
        for d in deps:
            self.succs[d].append(t)
        return t

    def actions(self, t: int) -> list[Action]:
        op, pipe, stage = self.op[t], self.pipe[t], self.stage[t]
        return [Action(op, pipe, stage, m) for m in self.micros[t]]


Priority = Callable[[Tasks], list]  # every task's priority key (least first)


def build_tasks(
    placement: Placement,
    micro_pipe: Sequence[int],
    times: OpTimes,
    split: bool = False,
    forward_groups: Sequence[Sequence[int]] | None = None,
    scale: float = 1.0,
) -> Tasks:
    """Tasks for every (pipe, stage, micro): F down the stages, then B (or I, W) back up,
    each lasting its ``times`` (of one full-size micro-batch) times ``scale``.

    ``forward_groups`` lists micro-batches whose forwards share one slot (forward doubling);
    a group's micro-batches must belong to the same pipe.
    """
    groups = [tuple(g) for g in forward_groups] if forward_groups else [(m,) for m in range(len(micro_pipe))]
    tasks, table = Tasks(), placement.table
    stages = placement.stages
    cost = {op: [times.of(op, s) * scale for s in range(stages)] for op in (Op.F, Op.B, Op.I, Op.W)}
    for group in groups:
        pipe = micro_pipe[group[0]]
        if any(micro_pipe[m] != pipe for m in group):
            raise ScheduleError(f"forward group {group} mixes pipes")
        row, prev, fwd = table[pipe], [], []
        for s in range(stages):
            prev = [tasks.add(row[s], Op.F, pipe, s, group, cost[Op.F][s] * len(group), prev)]
            fwd.append(prev[0])
        for m in group:
            prev = [fwd[-1]]
            for s in reversed(range(stages)):
                if split:
                    prev = [tasks.add(row[s], Op.I, pipe, s, (m,), cost[Op.I][s], prev + [fwd[s]])]
                    tasks.add(row[s], Op.W, pipe, s, (m,), cost[Op.W][s], prev)
                else:
                    prev = [tasks.add(row[s], Op.B, pipe, s, (m,), cost[Op.B][s], prev + [fwd[s]])]
    return tasks


def list_schedule(
    tasks: Tasks,
    ranks: int,
    priority: Priority,
    window: Callable[[int, int], int],
    free_on: Op = Op.B,
) -> list[list[Action]]:
    """Play the tasks out greedily; return each rank's actions in start order.

    A rank that is idle takes the ready task of least ``priority``; a forward on replica
    (pipe, stage) may start only while fewer than ``window(pipe, stage)`` micro-batches of
    that replica hold activations (freed by ``free_on``). When every task takes as long
    (Chimera's and GEMS's shaping costs), what starts together ends together: the play is a
    sequence of rounds, with no heap of end times.
    """
    play = _Slots(tasks, ranks, priority(tasks), window, free_on)
    durations = set(tasks.duration)
    if len(durations) == 1 and min(durations) > 0:
        _rounds(play, ranks, min(durations))
    else:
        _events(play, ranks)
    return play.programs


def _events(play: _Slots, ranks: int) -> None:
    now, done, running, busy_until = 0.0, 0, [], [0.0] * ranks
    while done < len(play.tasks):
        for r in range(ranks):
            if busy_until[r] <= now and (play.forwards[r] or play.others[r]):
                t = play.pick(r)
                if t is not None:
                    busy_until[r] = now + play.tasks.duration[t]
                    heapq.heappush(running, (busy_until[r], t))
        if not running:
            raise play.stuck(now)
        now = running[0][0]
        while running and running[0][0] <= now:
            done += 1
            play.finish(heapq.heappop(running)[1])


def _rounds(play: _Slots, ranks: int, duration: float) -> None:
    now, done = 0.0, 0
    while done < len(play.tasks):
        started = [t for r in range(ranks) if play.forwards[r] or play.others[r]
                   for t in (play.pick(r),) if t is not None]
        if not started:
            raise play.stuck(now)
        now = now + duration
        done += len(started)
        for t in sorted(started):  # as the heap of (end, id) would pop them
            play.finish(t)


class _Slots:
    """The state of one :func:`list_schedule` play. Ready forwards wait in heaps by priority,
    one per (replica, slot size), as whether one may start depends only on those; the rest,
    which always may, in one heap per rank. A priority is never tied on one rank, so this
    picks what a scan of every ready task would."""

    def __init__(self, tasks: Tasks, ranks: int, prio: list, window, free_on: Op):
        self.tasks, self.prio, self.window = tasks, prio, window
        self.missing = [len(d) for d in tasks.deps]
        self.frees = [op is free_on for op in tasks.op]
        self.group = [((p, s), len(ms)) if op is Op.F else None
                      for op, p, s, ms in zip(tasks.op, tasks.pipe, tasks.stage, tasks.micros)]
        self.forwards: list[dict[tuple, list]] = [{} for _ in range(ranks)]  # heaps of (prio, id)
        self.others: list[list[tuple]] = [[] for _ in range(ranks)]
        self.held: dict[tuple[int, int], int] = {}
        self.programs: list[list[Action]] = [[] for _ in range(ranks)]
        for t, missing in enumerate(self.missing):
            if not missing:
                self.ready(t)

    def ready(self, t: int) -> None:
        group, rank = self.group[t], self.tasks.rank[t]
        if group is None:
            heapq.heappush(self.others[rank], (self.prio[t], t))
        else:
            heapq.heappush(self.forwards[rank].setdefault(group, []), (self.prio[t], t))

    def pick(self, r: int) -> int | None:
        """Take rank r's best ready task that its window allows, if any, into its program."""
        held, groups, others = self.held, self.forwards[r], self.others[r]
        best = others[0] if others else None
        best_group = None
        for group, heap in groups.items():  # the window is asked only of a would-be best
            (pipe, stage), size = replica, _ = group
            if (best is None or heap[0] < best) and held.get(replica, 0) + size <= self.window(pipe, stage):
                best, best_group = heap[0], group
        if best is None:
            return None
        if best_group is None:
            heapq.heappop(others)
        else:
            heap = groups[best_group]
            heapq.heappop(heap)
            if not heap:
                del groups[best_group]
            replica, size = best_group
            held[replica] = held.get(replica, 0) + size
        t = best[1]
        self.programs[r].extend(self.tasks.actions(t))
        return t

    def finish(self, t: int) -> None:
        tasks = self.tasks
        if self.frees[t]:
            replica = (tasks.pipe[t], tasks.stage[t])
            self.held[replica] -= len(tasks.micros[t])
        for s in tasks.succs[t]:
            self.missing[s] -= 1
            if self.missing[s] == 0:
                self.ready(s)

    def stuck(self, now: float) -> ScheduleError:
        waiting = [i for r in self.forwards for heap in r.values() for _, i in heap]
        example = self.tasks.actions(waiting[0])[0] if waiting else "-"
        return ScheduleError(f"list scheduler is stuck at t={now} with {len(waiting)} ready tasks "
                             f"blocked by their windows (e.g. {example})")
