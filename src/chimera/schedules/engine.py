"""A slot-level list scheduler that turns a placement plus rules into per-rank programs.

Chimera's schedule is defined in the paper as two 1F1B pipelines merged per worker. Rather
than encode that merge (and its N > D variants) as hand-written loops, generators describe
the work as tasks with dependencies, a per-replica limit on micro-batches in flight (the
1F1B window, which bounds activation memory) and a priority, and this engine plays them out
in time with the given shaping costs. The result is only an *order* per rank; timing is the
simulator's job.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Sequence

from chimera.ir import Action, Op, Placement, ScheduleError


@dataclass
class Task:
    """A slot on one rank: one or more actions of one replica run back to back."""

    id: int
    rank: int
    op: Op
    pipe: int
    stage: int
    micros: tuple[int, ...]
    duration: float
    deps: list[int] = field(default_factory=list)
    succs: list[int] = field(default_factory=list)

    @property
    def actions(self) -> list[Action]:
        return [Action(self.op, self.pipe, self.stage, m) for m in self.micros]


@dataclass(frozen=True)
class Costs:
    """Shaping costs per op for one full-size micro-batch on one stage."""

    f: float = 1.0
    b: float = 1.0
    i: float = 0.5
    w: float = 0.5

    def of(self, op: Op) -> float:
        return {Op.F: self.f, Op.B: self.b, Op.I: self.i, Op.W: self.w}[op]


Priority = Callable[[Task], tuple]


def build_tasks(
    placement: Placement,
    micro_pipe: Sequence[int],
    costs: Costs,
    split: bool = False,
    forward_groups: Sequence[Sequence[int]] | None = None,
    scale: float = 1.0,
) -> list[Task]:
    """Tasks for every (pipe, stage, micro): F down the stages, then B (or I, W) back up.

    ``forward_groups`` lists micro-batches whose forwards share one slot (forward doubling);
    a group's micro-batches must belong to the same pipe.
    """
    groups = [tuple(g) for g in forward_groups] if forward_groups else [(m,) for m in range(len(micro_pipe))]
    tasks: list[Task] = []

    def add(op: Op, pipe: int, stage: int, micros: tuple[int, ...], deps: list[int]) -> int:
        task = Task(len(tasks), placement.rank_of(pipe, stage), op, pipe, stage, micros,
                    costs.of(op) * scale * len(micros), list(deps))
        tasks.append(task)
        for d in deps:
            tasks[d].succs.append(task.id)
        return task.id

    stages = placement.stages
    for group in groups:
        pipe = micro_pipe[group[0]]
        if any(micro_pipe[m] != pipe for m in group):
            raise ScheduleError(f"forward group {group} mixes pipes")
        prev: list[int] = []
        fwd = []
        for s in range(stages):
            prev = [add(Op.F, pipe, s, group, prev)]
            fwd.append(prev[0])
        for m in group:
            prev = [fwd[-1]]
            for s in reversed(range(stages)):
                if split:
                    prev = [add(Op.I, pipe, s, (m,), prev + [fwd[s]])]
                    add(Op.W, pipe, s, (m,), prev)
                else:
                    prev = [add(Op.B, pipe, s, (m,), prev + [fwd[s]])]
    return tasks


def list_schedule(
    tasks: list[Task],
    ranks: int,
    priority: Priority,
    window: Callable[[int, int], int],
    free_on: Op = Op.B,
) -> list[list[Action]]:
    """Play the tasks out greedily; return each rank's actions in start order.

    A rank that is idle takes the ready task of least ``priority``; a forward on replica
    (pipe, stage) may start only while fewer than ``window(pipe, stage)`` micro-batches of
    that replica hold activations (freed by ``free_on``).
    """
    missing = [len(t.deps) for t in tasks]
    ready: list[list[Task]] = [[] for _ in range(ranks)]
    for t in tasks:
        if not t.deps:
            ready[t.rank].append(t)
    held: dict[tuple[int, int], int] = {}
    busy_until = [0.0] * ranks
    programs: list[list[Action]] = [[] for _ in range(ranks)]
    running: list[tuple[float, int]] = []
    now, done = 0.0, 0
    while done < len(tasks):
        for r in range(ranks):
            if busy_until[r] <= now:
                task = _pick(ready[r], priority, window, held)
                if task is not None:
                    ready[r].remove(task)
                    if task.op is Op.F:
                        key = (task.pipe, task.stage)
                        held[key] = held.get(key, 0) + len(task.micros)
                    busy_until[r] = now + task.duration
                    programs[r].extend(task.actions)
                    heapq.heappush(running, (busy_until[r], task.id))
        if not running:
            stuck = [t for r in ready for t in r]
            raise ScheduleError(f"list scheduler is stuck at t={now} with {len(stuck)} ready tasks "
                                f"blocked by their windows (e.g. {stuck[0].actions[0] if stuck else '-'})")
        now = running[0][0]
        while running and running[0][0] <= now:
            _, tid = heapq.heappop(running)
            done += 1
            _finish(tasks[tid], tasks, missing, ready, held, free_on)
    return programs


def _pick(ready: list[Task], priority: Priority, window, held) -> Task | None:
    best, best_key = None, None
    for t in ready:
        if t.op is Op.F and held.get((t.pipe, t.stage), 0) + len(t.micros) > window(t.pipe, t.stage):
            continue
        key = priority(t)
        if best_key is None or key < best_key:
            best, best_key = t, key
    return best


def _finish(task: Task, tasks, missing, ready, held, free_on: Op) -> None:
    if task.op is free_on:
        held[(task.pipe, task.stage)] -= len(task.micros)
    for s in task.succs:
        missing[s] -= 1
        if missing[s] == 0:
            ready[tasks[s].rank].append(tasks[s])
