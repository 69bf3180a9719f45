"""The work of a split-backward schedule as a task graph, and chimera-zb's greedy play over it.

:func:`build_dag` lists F down the stages, I back up and a W after each I, for every
micro-batch on its pipe. :class:`Play` list-schedules that graph on the ranks under a per-rank
activation cap (the priority rules are in :mod:`chimera.schedules.chimera_zb`):

- at each event (a task ends, or an input arrives at a free rank) every free rank, in rank
  order, starts the best task whose input is there and that fits;
- a rank's ready tasks wait in a heap by arrival until their input is there; then forwards
  (few, and whether one fits depends on its replica) go to a list, inputs and weight
  gradients (always fit; the latter pile up by the dozen) to a heap by priority each;
- each rank keeps the sum of its replicas' reserve deficits, so whether a forward fits is O(1);
- when every task takes as long and no hop is paid (the planner's unit costs), what starts
  together ends together, and the events are rounds: no heap of times is kept.

It plays what rescanning every ready task at every event played (as it was first written;
``tests/test_golden_schedules.py`` pins the output), only faster: a priority is never tied on
one rank (a rank holds one stage of a pipe, a micro-batch one pipe, and F, I, W of one
micro-batch and stage are never ready together), so the order waiting tasks are kept in
cannot change the choice.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

from chimera.ir import Op, OpTimes, Placement, ScheduleError

EPS = 1e-9
Rule = Callable[["Dag", bool], list]  # (dag, blocked) -> each task's priority key


# -- the work: F down the stages, I back up, W after each I ------------------------------------
@dataclass
class Dag:
    """Tasks as parallel lists (index = task id)."""

    op: list[Op]
    pipe: list[int]
    stage: list[int]
    micro: list[int]
    rank: list[int]
    dur: list[float]
    succs: list[list[int]]
    npred: list[int]

    def __len__(self) -> int:
        return len(self.op)

    @cached_property
    def layout(self) -> Layout:
        """What every play of this (finished) graph looks up per task, computed once."""
        return Layout.of(self)


@dataclass(frozen=True)
class Layout:
    """Per task: is it an F, a W, and its replica's number (replicas numbered by first F);
    per replica: its (pipe, stage) and forwards; per rank: the replicas it holds."""

    is_f: list[bool]
    is_w: list[bool]
    replica: list[int]
    keys: list[tuple[int, int]]
    forwards: list[int]
    held: list[list[int]]

    @classmethod
    def of(cls, dag: Dag) -> Layout:
        ids: dict[tuple[int, int], int] = {}
        is_f = [op is Op.F for op in dag.op]
        forwards: list[int] = []
        held: list[list[int]] = [[] for _ in range(max(dag.rank, default=-1) + 1)]
        for t in range(len(dag)):
            if is_f[t]:
                key = (dag.pipe[t], dag.stage[t])
                if key not in ids:
                    ids[key] = len(ids)
                    held[dag.rank[t]].append(ids[key])
                    forwards.append(0)
                forwards[ids[key]] += 1
        replica = [ids.get(key, -1) for key in zip(dag.pipe, dag.stage)]
        return cls(is_f, [op is Op.W for op in dag.op], replica, list(ids), forwards, held)


def priorities(rule: Rule, dag: Dag) -> tuple[list, list]:
    """Each task's priority key under ``rule`` while no forward is blocked, and while one is."""
    return rule(dag, False), rule(dag, True)


def first_hop(times: OpTimes) -> float:
    """The one hop time the play charges for every message: stage 0's (a uniform link)."""
    return times.hop[0] if times.hop else 0.0


def build_dag(placement: Placement, micro_pipe, times: OpTimes) -> Dag:
    """Per micro-batch: F of stages 0 .. S-1, then I, W of stages S-1 .. 0 (task ids in that
    order). F(s) feeds F(s+1) and I(s); I(s) feeds W(s) and I(s-1)."""
    dag = Dag([], [], [], [], [], [], [], [])
    stages = placement.stages
    down, up = range(stages), range(stages - 1, -1, -1)
    back_stage = [s for s in up for _ in (Op.I, Op.W)]
    back_dur = [d for s in up for d in (times.of(Op.I, s), times.of(Op.W, s))]
    npred = [0] + [1] * (stages - 1) + [n for s in up for n in (1 if s == stages - 1 else 2, 1)]
    for m, p in enumerate(micro_pipe):
        row, base = placement.table[p], len(dag.op)
        i_of = [base + stages + 2 * (stages - 1 - s) for s in down]  # the id of I(s)
        dag.op.extend([Op.F] * stages + [Op.I, Op.W] * stages)
        dag.pipe.extend([p] * (3 * stages))
        dag.stage.extend([*down, *back_stage])
        dag.micro.extend([m] * (3 * stages))
        dag.rank.extend([row[s] for s in down] + [row[s] for s in back_stage])
        dag.dur.extend([times.of(Op.F, s) for s in down] + back_dur)
        dag.succs.extend([[base + s + 1, i_of[s]] for s in range(stages - 1)] + [[i_of[-1]]])
        dag.succs.extend(x for s in up for x in ([i_of[s] + 1] + ([i_of[s - 1]] if s else []), []))
        dag.npred.extend(npred)
    return dag


# -- the greedy play ------------------------------------------------------------------------
class Play:
    """One list-scheduling run of a Dag on D ranks under a per-rank activation cap."""
    def __init__(self, dag: Dag, ranks: int, cap: float, size: float, hop: float,
                 prio: tuple[list, list]):
        """``prio``: :func:`priorities` of the rule; a rule's ``blocked`` may reorder ops but
        never two tasks of one op (so one heap per op serves both)."""
        self.dag, self.cap, self.size, self.hop, self.prio = dag, cap, size, hop, prio
        lay = dag.layout
        self.is_f, self.is_w, self.replica = lay.is_f, lay.is_w, lay.replica
        self.missing = list(dag.npred)
        self.arrival = [0.0] * len(dag)
        self.pending: list[list[tuple[float, int]]] = [[] for _ in range(ranks)]  # by arrival
        for t in range(len(dag)):
            if not dag.npred[t]:
                self.pending[dag.rank[t]].append((0.0, t))
        self.forwards: list[list[int]] = [[] for _ in range(ranks)]  # arrived F
        self.heaps: list[list[list[tuple]]] = [[[], []] for _ in range(ranks)]  # arrived [I, W]
        self.forwards_left = list(lay.forwards)  # per replica
        self.in_flight = [0] * len(lay.keys)
        self.reserve = [1] * len(lay.keys)
        self.owed = [0] * ranks  # per rank: the sum of its replicas' deficits
        self.held = [0.0] * ranks
        self.free_at = [0.0] * ranks
        self.order: list[list[int]] = [[] for _ in range(ranks)]
        self.running: list[tuple[float, int]] = []
        self.makespan = 0.0

    def set_reserve(self, want: Callable[[int, int], int]) -> None:
        """Keep room for ``want(pipe, stage)`` micro-batches per replica, granted smallest first
        (replicas near the end of their pipe need few, and their pipe stalls without them) while
        a rank's reserves fit under its cap; every replica keeps at least one."""
        keys = self.dag.layout.keys
        for reps in self.dag.layout.held:
            left = int(self.cap / self.size + EPS)
            for n, y in enumerate(sorted(reps, key=lambda y: (want(*keys[y]), keys[y]))):
                self.reserve[y] = max(1, min(want(*keys[y]), left - (len(reps) - 1 - n)))
                left -= self.reserve[y]

    def run(self) -> "Play":
        for r, reps in enumerate(self.dag.layout.held):
            self.owed[r] = sum(self._deficit(y) for y in reps)
        durations = set(self.dag.dur)
        if self.hop == 0 and len(durations) == 1 and min(durations) > EPS:
            return self._run_rounds()
        return self._run_events()

    def _run_events(self) -> "Play":
        now, finished = 0.0, 0
        while finished < len(self.dag):
            self._start_all(now)
            now = self._next_time(now)
            finished += self._complete(now)
        return self

    def _start_all(self, now: float) -> None:
        """Every free rank, in rank order, starts its best task that is there and fits."""
        limit = now + EPS
        free_at, pending, forwards, heaps = self.free_at, self.pending, self.forwards, self.heaps
        for r in range(len(free_at)):
            if free_at[r] <= limit:
                if pending[r] and pending[r][0][0] <= limit:
                    self._arrive(r, limit)
                if forwards[r] or heaps[r][0] or heaps[r][1]:
                    t = self._take(r)
                    if t is not None:
                        self._start(t, now)

    def _start(self, t: int, now: float) -> None:
        """Run t; its successors learn now when their input will arrive (times are exact)."""
        dag, r = self.dag, self.dag.rank[t]
        self._begin(t)
        end = self.free_at[r] = now + dag.dur[t]
        heapq.heappush(self.running, (end, t))
        rank, arrival, missing, remote = dag.rank, self.arrival, self.missing, end + self.hop
        for u in dag.succs[t]:
            arrival[u] = max(arrival[u], remote if rank[u] != r else end)
            missing[u] -= 1
            if not missing[u]:
                heapq.heappush(self.pending[rank[u]], (arrival[u], u))

    def _next_time(self, now: float) -> float:
        """The next end of a task, or arrival of an input at a rank that is free now."""
        limit = now + EPS
        times = [self.running[0][0]] if self.running else []
        for r, pending in enumerate(self.pending):
            if pending and self.free_at[r] <= limit:
                if pending[0][0] <= limit:
                    self._arrive(r, limit)
                if pending:
                    times.append(pending[0][0])
        if not times:  # cannot happen with the reservation rule; kept as a loud guard
            raise ScheduleError(f"chimera-zb list scheduler is stuck at t={now:g}")
        return min(times)

    def _complete(self, now: float) -> int:
        """Finish what ends by ``now``: a W frees its micro-batch's activations."""
        n, running, limit = 0, self.running, now + EPS
        while running and running[0][0] <= limit:
            end, t = heapq.heappop(running)
            n += 1
            self.makespan = max(self.makespan, end)
            if self.is_w[t]:
                self._free(t)
        return n

    def _run_rounds(self) -> "Play":
        """The same play when every task takes as long and no hop is paid (the planner's unit
        costs): all ranks are free at once, and what starts together ends together, when its
        successors' inputs are there; so the events are rounds, and no heap of times is kept."""
        now, finished, ranks, dur = 0.0, 0, range(len(self.free_at)), self.dag.dur[0]
        for r in ranks:
            self._arrive(r, EPS)
        forwards, heaps = self.forwards, self.heaps
        while finished < len(self.dag):
            started = []
            for r in ranks:
                if forwards[r] or heaps[r][0] or heaps[r][1]:
                    t = self._take(r)
                    if t is not None:
                        started.append(t)
            if not started:  # cannot happen with the reservation rule; kept as a loud guard
                raise ScheduleError(f"chimera-zb list scheduler is stuck at t={now:g}")
            for t in started:
                self._begin(t)
            now = self.makespan = now + dur
            finished += len(started)
            self._end_round(started)
        return self

    def _end_round(self, ended: list[int]) -> None:
        """What ``ended``: a W frees its activations; a successor whose inputs are all there
        waits (this and :meth:`_wait` written out: it runs for every task)."""
        rank, succs, missing = self.dag.rank, self.dag.succs, self.missing
        is_f, is_w, prio, forwards, heaps = self.is_f, self.is_w, self.prio[0], self.forwards, self.heaps
        for t in ended:
            if is_w[t]:
                self._free(t)
            for u in succs[t]:
                missing[u] -= 1
                if not missing[u]:
                    if is_f[u]:
                        forwards[rank[u]].append(u)
                    else:
                        heapq.heappush(heaps[rank[u]][is_w[u]], (prio[u], u))

    def _arrive(self, r: int, limit: float) -> None:
        """Take in rank r's tasks whose input is there by ``limit``."""
        pending = self.pending[r]
        while pending and pending[0][0] <= limit:
            self._wait(r, heapq.heappop(pending)[1])

    def _wait(self, r: int, t: int) -> None:
        if self.is_f[t]:
            self.forwards[r].append(t)
        else:
            heapq.heappush(self.heaps[r][self.is_w[t]], (self.prio[0][t], t))

    def _take(self, r: int) -> int | None:
        """Take the best waiting task (one does) that fits; W ranks differently while a forward
        is blocked."""
        forwards, heaps = self.forwards[r], self.heaps[r]
        if not forwards:  # the common case: I or W, each heap is in the order of prio[0]
            i, w = heaps
            return heapq.heappop(i if i and (not w or i[0] < w[0]) else w)[1]
        fits = [t for t in forwards if self._fits(t)]
        prio = self.prio[len(fits) < len(forwards)]
        fits += [heap[0][1] for heap in heaps if heap]
        if not fits:
            return None
        t = min(fits, key=prio.__getitem__)
        if self.is_f[t]:
            forwards.remove(t)
        else:
            heapq.heappop(heaps[self.is_w[t]])
        return t

    def _fits(self, t: int) -> bool:
        """F fits under the cap while leaving every replica of the rank room for its reserve."""
        r, y = self.dag.rank[t], self.replica[t]
        reserve, left, flight = self.reserve[y], self.forwards_left[y], self.in_flight[y]
        before, after = max(0, min(reserve, left) - flight), max(0, min(reserve, left - 1) - flight - 1)
        return self.held[r] + self.size * (1 + self.owed[r] - before + after) <= self.cap + EPS

    def _begin(self, t: int) -> None:
        """t joins its rank's order; an F takes a micro-batch's activations."""
        r = self.dag.rank[t]
        self.order[r].append(t)
        if self.is_f[t]:
            self.held[r] += self.size
            self._account(r, self.replica[t], 1, -1)

    def _free(self, t: int) -> None:
        r = self.dag.rank[t]
        self.held[r] -= self.size
        self._account(r, self.replica[t], -1, 0)

    def _account(self, r: int, y: int, flight: int, forwards: int) -> None:
        """Change replica y's micro-batches in flight and forwards left; keep r's owed sum
        (the deficits written out: this runs for every F and W)."""
        reserve, left, in_flight = self.reserve[y], self.forwards_left, self.in_flight
        before = max(0, min(reserve, left[y]) - in_flight[y])
        in_flight[y] += flight
        left[y] += forwards
        self.owed[r] += max(0, min(reserve, left[y]) - in_flight[y]) - before

    def _deficit(self, y: int, extra: int = 0) -> int:
        """Micro-batches replica y is still owed of its reserve (after ``extra`` more start)."""
        return max(0, min(self.reserve[y], self.forwards_left[y] - extra) - self.in_flight[y] - extra)
