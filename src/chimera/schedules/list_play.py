"""The package's list scheduler: a pipeline's work as a task graph, played greedily on the ranks.

Chimera with Q > 2 pipes and GEMS are 1F1B pipelines merged per rank, chimera-zb fills the
bubbles of a split backward by time; rather than hand-written loops, their generators describe
the work as a task graph (:func:`build_dag`, from the dependency rule :func:`chimera.ir.needs`)
and a priority, and :class:`Play` plays it out. The result is only an *order* per rank; timing
is the simulator's job. What differs between the generators is a parameter of the play:

- admission of a forward (it takes its micro-batches' activations): a per-replica :class:`Window` of
  micro-batches in flight (1F1B's bound), or a per-rank :class:`Cap` that keeps room for each
  replica's reserve; the finishing op (:func:`chimera.ir.finishing_op`) frees them;
- the hop time of a message between ranks, and forward groups (forward doubling: the
  forwards of a group of micro-batches share one slot);
- the priority: a key per task (least first), and another while an arrived forward is
  blocked (a rule may reorder ops then, never two tasks of one op).

How the play runs, and why it is fast:

- at each event (a task ends, or an input arrives at a free rank) every free rank, in rank
  order, starts the best task whose input is there and that is admitted;
- a rank's ready tasks wait in a heap by arrival until their input is there; then forwards go
  to a heap by priority per (replica, slot size), as whether one is admitted depends only on
  those; the rest (always admitted; weight gradients pile up by the dozen) to a heap by
  priority per op kind (B or I, and W);
- when every task takes as long and no hop is paid (Chimera's and GEMS's shaping costs, the
  planner's unit costs), what starts together ends together, and the events are rounds: no
  heap of times is kept.

It plays what rescanning every ready task at every event played (as the schedulers were first
written; ``tests/test_golden_schedules.py`` pins the output), only faster: a priority is never
tied on one rank (a rank holds one stage of a pipe, a micro-batch one pipe, and F, I, W of one
micro-batch and stage are never ready together), so the order waiting tasks are kept in
cannot change the choice.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property, lru_cache
from itertools import compress
from typing import Callable, Sequence

from chimera.ir import Action, Op, OpTimes, Placement, ScheduleError, finishing_op, needs

EPS = 1e-9
Rule = Callable[["Dag", bool], list]  # (dag, blocked) -> each task's priority key


# -- the work -----------------------------------------------------------------------------------
@dataclass
class Dag:
    """Tasks as parallel lists (index = task id); a task is one or more actions of one replica
    run back to back on its rank (a forward group's forwards), otherwise one action."""

    split_backward: bool
    op: list[Op]
    pipe: list[int]
    stage: list[int]
    micros: list[tuple[int, ...]]
    rank: list[int]
    dur: list[float]
    succs: list[list[int]]
    npred: list[int]

    def __len__(self) -> int:
        return len(self.op)

    @cached_property
    def micro(self) -> list[int]:
        """Each task's (first) micro-batch: what priorities order by."""
        return [ms[0] for ms in self.micros]

    @cached_property
    def layout(self) -> Layout:
        """What every play of this (finished) graph looks up per task, computed once."""
        return Layout.of(self)

    def programs(self, order: list[list[int]]) -> list[list[Action]]:
        """Per-rank task ids as per-rank actions."""
        op, pipe, stage, micros = self.op, self.pipe, self.stage, self.micros
        return [[Action(op[t], pipe[t], stage[t], m) for t in ts for m in micros[t]] for ts in order]

    def makespan(self, order: list[list[int]], hop: float) -> float:
        """The makespan of per-rank task orders (a play's) when every task starts as soon as
        its rank is free and its inputs are there, a cross-rank input ``hop`` after its
        producer ends: the simulator's timing of those programs, here so a play made blind to
        the hop can be priced with it."""
        return max(self.ends(order, hop), default=0.0)

    def ends(self, order: list[list[int]], hop: float) -> list[float]:
        """Each task's end under :meth:`makespan`'s timing (index = task id): Kahn's order over
        the graph's edges and each rank's order, O(tasks + edges)."""
        n = len(self)
        after = [-1] * n  # the next task on the same rank
        waiting = list(self.npred)
        for ts in order:
            for a, b in zip(ts, ts[1:]):
                after[a] = b
                waiting[b] += 1
        ready = [ts[0] for ts in order if ts and waiting[ts[0]] == 0]
        start = [0.0] * n  # the earliest start known so far
        end = [0.0] * n
        done = 0
        while ready:
            t = ready.pop()
            end[t] = start[t] + self.dur[t]
            done += 1
            r = self.rank[t]
            for u in self.succs[t]:
                at = end[t] + (hop if self.rank[u] != r else 0.0)
                if at > start[u]:
                    start[u] = at
                waiting[u] -= 1
                if not waiting[u]:
                    ready.append(u)
            u = after[t]
            if u >= 0:
                if end[t] > start[u]:
                    start[u] = end[t]
                waiting[u] -= 1
                if not waiting[u]:
                    ready.append(u)
        if done < sum(len(ts) for ts in order):
            raise ScheduleError("a play's order deadlocks when timed")
        return end


def first_hop(times: OpTimes) -> float:
    """The one hop time the play charges for every message: stage 0's (a uniform link)."""
    return times.hop[0] if times.hop else 0.0


def build_dag(placement: Placement, micro_pipe: Sequence[int], times: OpTimes, split_backward: bool = True,
              groups: Sequence[Sequence[int]] | None = None) -> Dag:
    """Per forward group (default: each micro-batch alone), task ids in this order: F of stages
    0 .. S-1 (one slot for the group, as long as its forwards), then per micro-batch its
    backward of stages S-1 .. 0 (I then W when split, else B); dependencies by :func:`needs`.
    A group's micro-batches must share a pipe."""
    dag = Dag(split_backward, [], [], [], [], [], [], [], [])
    stages, durations = placement.stages, {}
    for group in [tuple(g) for g in groups] if groups else [(m,) for m in range(len(micro_pipe))]:
        pipe = micro_pipe[group[0]]
        if any(micro_pipe[m] != pipe for m in group):
            raise ScheduleError(f"forward group {group} mixes pipes")
        ops, stage, local, succs, npred = _template(stages, split_backward, len(group))
        if len(group) not in durations:
            durations[len(group)] = [times.of(op, s) * (len(group) if op is Op.F else 1)
                                     for op, s in zip(ops, stage)]
        row, base = placement.table[pipe], len(dag.op)
        micros = [(m,) for m in group] + [group]  # as _template numbers them
        dag.op.extend(ops)
        dag.pipe.extend([pipe] * len(ops))
        dag.stage.extend(stage)
        dag.micros.extend([micros[m] for m in local])
        dag.rank.extend([row[s] for s in stage])
        dag.dur.extend(durations[len(group)])
        dag.succs.extend([[base + u for u in us] for us in succs])
        dag.npred.extend(npred)
    return dag


@lru_cache(maxsize=None)
def _template(stages: int, split_backward: bool, width: int) -> tuple:
    """The tasks of one group of ``width`` micro-batches (numbered 0 .. width-1), in
    :func:`build_dag`'s order: op, stage, micro-batches (m: micro-batch m alone; width: all
    of the group), successors and number of predecessors of each."""
    back = (Op.I, Op.W) if split_backward else (Op.B,)
    tasks = [(Op.F, s, width) for s in range(stages)]
    tasks += [(op, s, m) for m in range(width) for s in reversed(range(stages)) for op in back]
    members = [(m,) for m in range(width)] + [range(width)]
    task_of = {(op, s, m): t for t, (op, s, k) in enumerate(tasks) for m in members[k]}
    succs: list[list[int]] = [[] for _ in tasks]
    npred = []
    for t, (op, s, k) in enumerate(tasks):
        deps = {task_of[a.op, a.stage, a.micro] for m in members[k]
                for a in needs(Action(op, 0, s, m), stages, split_backward)}
        for d in sorted(deps):
            succs[d].append(t)
        npred.append(len(deps))
    ops, stage, micros = zip(*tasks)
    return ops, stage, micros, tuple(map(tuple, succs)), tuple(npred)


@dataclass(frozen=True)
class Layout:
    """Per task: is it an F, a W, does it free its activations, how many micro-batches it
    carries, its replica's number (replicas numbered by first F) and, for an F, its group's
    (replica and slot size); per replica: its (pipe, stage) and forwards; per rank: the
    replicas it holds."""

    is_f: list[bool]
    is_w: list[bool]
    frees: list[bool]
    width: list[int]
    replica: list[int]
    group: list[int]
    keys: list[tuple[int, int]]
    forwards: list[int]
    held: list[list[int]]

    @classmethod
    def of(cls, dag: Dag) -> Layout:
        ids: dict[tuple[int, int], int] = {}
        groups: dict[tuple[int, int], int] = {}
        is_f = [op is Op.F for op in dag.op]
        width = [len(ms) for ms in dag.micros]
        forwards: list[int] = []
        held: list[list[int]] = [[] for _ in range(max(dag.rank, default=-1) + 1)]
        group = [-1] * len(dag)
        for t in compress(range(len(dag)), is_f):
            key = (dag.pipe[t], dag.stage[t])
            y = ids.get(key)
            if y is None:
                y = ids[key] = len(ids)
                held[dag.rank[t]].append(y)
                forwards.append(0)
            forwards[y] += 1
            group[t] = groups.setdefault((y, width[t]), len(groups))
        replica = [ids.get(key, -1) for key in zip(dag.pipe, dag.stage)]
        frees = finishing_op(dag.split_backward)
        return cls(is_f, [op is Op.W for op in dag.op], [op is frees for op in dag.op], width,
                   replica, group, list(ids), forwards, held)


def priorities(rule: Rule, dag: Dag) -> tuple[list, list]:
    """Each task's priority key under ``rule`` while no forward is blocked, and while one is."""
    return rule(dag, False), rule(dag, True)


# -- admission of forwards --------------------------------------------------------------------
class Window:
    """A forward may start while fewer than ``limit(pipe, stage)`` micro-batches of its replica
    hold activations (1F1B's window, which bounds activation memory)."""

    def __init__(self, dag: Dag, limit: Callable[[int, int], int]):
        lay = dag.layout
        self.replica, self.width = lay.replica, lay.width
        self.limit = [limit(*key) for key in lay.keys]
        self.held = [0] * len(lay.keys)

    def fits(self, t: int) -> bool:
        y = self.replica[t]
        return self.held[y] + self.width[t] <= self.limit[y]

    def hold(self, t: int, sign: int) -> None:
        """A forward t starts (sign 1), or a finishing op t ends (sign -1)."""
        self.held[self.replica[t]] += sign * self.width[t]


class Cap:
    """A rank holds at most ``cap`` Ma (``size`` per micro-batch), and keeps room for the
    reserve of every replica it holds that still has forwards to do: ``want(pipe, stage)``
    micro-batches, granted smallest first (replicas near the end of their pipe need few, and
    their pipe stalls without them) while a rank's reserves fit under its cap; every replica
    keeps at least one. Then the oldest micro-batch of every pipe can always advance. Each rank
    keeps the sum of its replicas' reserve deficits, so whether a forward fits is O(1).
    Forwards carry one micro-batch each."""

    def __init__(self, dag: Dag, cap: float, size: float,
                 want: Callable[[int, int], int] = lambda pipe, stage: 1):
        lay = dag.layout
        self.rank, self.replica, self.cap, self.size = dag.rank, lay.replica, cap, size
        self.forwards_left = list(lay.forwards)  # per replica
        self.in_flight = [0] * len(lay.keys)
        self.reserve = [1] * len(lay.keys)
        self.held = [0.0] * len(lay.held)  # per rank
        for reps in lay.held:
            left = int(cap / size + EPS)
            for n, y in enumerate(sorted(reps, key=lambda y: (want(*lay.keys[y]), lay.keys[y]))):
                self.reserve[y] = max(1, min(want(*lay.keys[y]), left - (len(reps) - 1 - n)))
                left -= self.reserve[y]
        self.owed = [sum(self._deficit(y) for y in reps) for reps in lay.held]  # per rank

    def fits(self, t: int) -> bool:
        """F fits under the cap while leaving every replica of the rank room for its reserve."""
        r, y = self.rank[t], self.replica[t]
        reserve, left, flight = self.reserve[y], self.forwards_left[y], self.in_flight[y]
        before, after = max(0, min(reserve, left) - flight), max(0, min(reserve, left - 1) - flight - 1)
        return self.held[r] + self.size * (1 + self.owed[r] - before + after) <= self.cap + EPS

    def hold(self, t: int, sign: int) -> None:
        """A forward t starts (sign 1: one more in flight, one fewer to do), or a finishing op t
        ends (sign -1); keep the rank's owed sum (the deficits written out: this runs for every
        F and W)."""
        r, y = self.rank[t], self.replica[t]
        reserve, left, in_flight = self.reserve[y], self.forwards_left, self.in_flight
        before = max(0, min(reserve, left[y]) - in_flight[y])
        self.held[r] += sign * self.size
        in_flight[y] += sign
        if sign > 0:
            left[y] -= 1
        self.owed[r] += max(0, min(reserve, left[y]) - in_flight[y]) - before

    def _deficit(self, y: int) -> int:
        """Micro-batches replica y is still owed of its reserve."""
        return max(0, min(self.reserve[y], self.forwards_left[y]) - self.in_flight[y])


Admission = Window | Cap


# -- the greedy play ----------------------------------------------------------------------------
class Play:
    """One list-scheduling run of a Dag on D ranks: ``prio`` is :func:`priorities` of a rule,
    ``admit`` says whether a forward may start, ``hop`` is the time of a message between ranks."""

    def __init__(self, dag: Dag, ranks: int, prio: tuple[list, list], admit: Admission,
                 hop: float = 0.0):
        self.dag, self.prio, self.admit, self.hop = dag, prio, admit, hop
        lay = dag.layout
        self.is_f, self.is_w, self.frees, self.group = lay.is_f, lay.is_w, lay.frees, lay.group
        self.missing = list(dag.npred)
        self.arrival = [0.0] * len(dag)
        self.pending: list[list[tuple[float, int]]] = [[] for _ in range(ranks)]  # by arrival
        for t in range(len(dag)):
            if not dag.npred[t]:
                self.pending[dag.rank[t]].append((0.0, t))
        self.forwards = [defaultdict(list) for _ in range(ranks)]  # arrived F: a heap per group
        self.heaps: list[list[list[tuple]]] = [[[], []] for _ in range(ranks)]  # arrived [B or I, W]
        self.free_at = [0.0] * ranks
        self.order: list[list[int]] = [[] for _ in range(ranks)]
        self.running: list[tuple[float, int]] = []
        self.makespan = 0.0

    def run(self) -> Play:
        durations = set(self.dag.dur)
        if self.hop == 0 and len(durations) == 1 and min(durations) > EPS:
            return self._run_rounds()
        return self._run_events()

    def _run_events(self) -> Play:
        now, finished = 0.0, 0
        while finished < len(self.dag):
            self._start_all(now)
            now = self._next_time(now)
            finished += self._complete(now)
        return self

    def _start_all(self, now: float) -> None:
        """Every free rank, in rank order, starts its best task that is there and admitted."""
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
        if not times:
            raise self._stuck(now)
        return min(times)

    def _complete(self, now: float) -> int:
        """Finish what ends by ``now``: a finishing op frees its micro-batch's activations."""
        n, running, limit = 0, self.running, now + EPS
        while running and running[0][0] <= limit:
            end, t = heapq.heappop(running)
            n += 1
            self.makespan = max(self.makespan, end)
            if self.frees[t]:
                self.admit.hold(t, -1)
        return n

    def _run_rounds(self) -> Play:
        """The same play when every task takes as long and no hop is paid: all ranks are free
        at once, and what starts together ends together, when its successors' inputs are
        there; so the events are rounds, and no heap of times is kept."""
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
            if not started:
                raise self._stuck(now)
            for t in started:
                self._begin(t)
            now = self.makespan = now + dur
            finished += len(started)
            self._end_round(started)
        return self

    def _end_round(self, ended: list[int]) -> None:
        """What ``ended``: a finishing op frees its activations; a successor whose inputs are
        all there waits (this and :meth:`_wait` written out: it runs for every task)."""
        rank, succs, missing, hold = self.dag.rank, self.dag.succs, self.missing, self.admit.hold
        is_f, is_w, frees, group = self.is_f, self.is_w, self.frees, self.group
        prio, forwards, heaps = self.prio[0], self.forwards, self.heaps
        for t in ended:
            if frees[t]:
                hold(t, -1)
            for u in succs[t]:
                missing[u] -= 1
                if not missing[u]:
                    if is_f[u]:
                        heapq.heappush(forwards[rank[u]][group[u]], (prio[u], u))
                    else:
                        heapq.heappush(heaps[rank[u]][is_w[u]], (prio[u], u))

    def _arrive(self, r: int, limit: float) -> None:
        """Take in rank r's tasks whose input is there by ``limit``."""
        pending = self.pending[r]
        while pending and pending[0][0] <= limit:
            self._wait(r, heapq.heappop(pending)[1])

    def _wait(self, r: int, t: int) -> None:
        if self.is_f[t]:
            heapq.heappush(self.forwards[r][self.group[t]], (self.prio[0][t], t))
        else:
            heapq.heappush(self.heaps[r][self.is_w[t]], (self.prio[0][t], t))

    def _take(self, r: int) -> int | None:
        """Take the best waiting task (one does) that is admitted; the blocked priority while
        a forward is not. Each heap's top is its best under either priority."""
        forwards, heaps = self.forwards[r], self.heaps[r]
        if not forwards:  # the common case: no forward waits, each heap is in the order of prio[0]
            i, w = heaps
            return heapq.heappop(i if i and (not w or i[0] < w[0]) else w)[1]
        fits = [heap[0][1] for heap in forwards.values() if self.admit.fits(heap[0][1])]
        prio = self.prio[len(fits) < len(forwards)]
        fits += [heap[0][1] for heap in heaps if heap]
        if not fits:
            return None
        t = min(fits, key=prio.__getitem__)
        if self.is_f[t]:
            heap = forwards[self.group[t]]
            heapq.heappop(heap)
            if not heap:
                del forwards[self.group[t]]
        else:
            heapq.heappop(heaps[self.is_w[t]])
        return t

    def _begin(self, t: int) -> None:
        """t joins its rank's order; an F takes its micro-batches' activations."""
        self.order[self.dag.rank[t]].append(t)
        if self.is_f[t]:
            self.admit.hold(t, 1)

    def _stuck(self, now: float) -> ScheduleError:
        """Cannot happen with the windows and reserves the generators set; kept as a loud guard."""
        waiting = [t for groups in self.forwards for heap in groups.values() for _, t in heap]
        example = self.dag.programs([waiting[:1]])[0][0] if waiting else "-"
        return ScheduleError(f"list scheduler is stuck at t={now:g} with {len(waiting)} ready "
                             f"forwards not admitted (e.g. {example})")
