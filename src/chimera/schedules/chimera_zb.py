"""chimera-zb: split backward on Chimera's bidirectional placement, ordered by time under a cap.

Chimera's merge of two 1F1B pipelines was designed for slots of equal length. Splitting each
backward into I (the input gradient the previous stage waits for) and W (the weight
gradient, which nothing waits for) gives every rank a pile of movable work; a list scheduler
driven by the cost model then fills the bubbles with it:

- Time-aware: each task has its own duration (per stage and op), a cross-rank input arrives
  one p2p hop after its producer ends, and an idle rank starts the best *ready* task.
- Activation cap: a rank holds at most ``cap`` Ma (default D, 1F1B's peak). F takes one
  micro-batch's activations, W frees them (I does not: W still needs them).
- Deadlock freedom under the cap: a rank keeps room for the reserve (at least one
  micro-batch) of every replica it holds that still has forwards to do, and the reserves of
  a rank fit under its cap. Then the oldest unfinished micro-batch of every pipe can always
  advance (its replica is empty when it arrives, since forwards of one replica run in
  micro-batch order, and room for one is always kept), so the greedy play never gets stuck.
- Priority (``rule``), measured in ``benchmarks/zero_bubble.py`` against the lower bound of
  :mod:`chimera.bounds`: forwards before input gradients before weight gradients, oldest
  micro-batch first (micro-batches are dealt to the pipes in turn, ``m mod Q``, so both
  directions fill the pipeline together), except that while an arrived forward waits for
  memory a W goes first, as it frees that memory (``fiw-unblock``). Reserving room per replica
  for what 1F1B keeps in flight at its stage (``/1f1b``) keeps the far pipe flowing when p2p
  is slow. ``auto`` plays a few such variants and keeps the shortest.

The result is an order per rank; the simulator replays it (and can only be as fast or
faster than the list scheduler's own timing, since it starts every action as soon as it can).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

from chimera.ir import Action, Op, Placement, Schedule, ScheduleError
from chimera.schedules.registry import register


# -- costs ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpTimes:
    """Per-stage durations of F, I, W and the time of one p2p hop, as the scheduler sees them."""

    f: tuple[float, ...]
    i: tuple[float, ...]
    w: tuple[float, ...]
    hop: float = 0.0

    def of(self, op: Op, stage: int) -> float:
        return {Op.F: self.f, Op.I: self.i, Op.W: self.w}[op][stage]


def op_times(cost, stages: int, ranks: int) -> OpTimes:
    """``cost``: None (F=I=W=1), ``"F:B"`` (I = W = B/2), ``"F:I:W"``, or any object with the
    :class:`chimera.sim.CostModel` methods ``compute(op, stage, stages, ranks)`` and ``hop(stage,
    stages)`` (per-stage times and p2p, from Python). Times are per D-th of the model."""
    if cost is None:
        cost = "1:1:1"
    if isinstance(cost, str):
        parts = _parse_cost(cost)
        f, i, w = (parts[0], parts[1] / 2, parts[1] / 2) if len(parts) == 2 else parts
        size = ranks / stages
        return OpTimes((f * size,) * stages, (i * size,) * stages, (w * size,) * stages)
    per = {op: tuple(cost.compute(op, s, stages, ranks) for s in range(stages)) for op in (Op.F, Op.I, Op.W)}
    return OpTimes(per[Op.F], per[Op.I], per[Op.W], cost.hop(0, stages))


def _parse_cost(text: str) -> tuple[float, ...]:
    try:
        parts = tuple(float(x) for x in text.split(":"))
    except ValueError:
        parts = ()
    if len(parts) not in (2, 3) or not all(0 < p < float("inf") for p in parts):
        raise ScheduleError(f"cost must be F:B or F:I:W with positive numbers, got {text!r}")
    return parts


# -- the work: F down the stages, I back up, W after each I ------------------------------------
@dataclass
class Dag:
    """Tasks as parallel lists (index = task id); ``replica`` numbers the (pipe, stage) pairs."""

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

    def replica(self, t: int) -> tuple[int, int]:
        return (self.pipe[t], self.stage[t])


def build_dag(placement: Placement, micro_pipe, times: OpTimes) -> Dag:
    dag = Dag([], [], [], [], [], [], [], [])
    for m, p in enumerate(micro_pipe):
        fwd = [_add(dag, placement, times, Op.F, p, s, m) for s in range(placement.stages)]
        for a, b in zip(fwd, fwd[1:]):
            _link(dag, a, b)
        prev = fwd[-1]
        for s in reversed(range(placement.stages)):
            i = _add(dag, placement, times, Op.I, p, s, m)
            _link(dag, prev, i)
            if prev != fwd[s]:
                _link(dag, fwd[s], i)
            _link(dag, i, _add(dag, placement, times, Op.W, p, s, m))
            prev = i
    return dag


def _add(dag: Dag, placement: Placement, times: OpTimes, op: Op, p: int, s: int, m: int) -> int:
    for name, value in (("op", op), ("pipe", p), ("stage", s), ("micro", m),
                        ("rank", placement.rank_of(p, s)), ("dur", times.of(op, s))):
        getattr(dag, name).append(value)
    dag.succs.append([])
    dag.npred.append(0)
    return len(dag.op) - 1


def _link(dag: Dag, a: int, b: int) -> None:
    dag.succs[a].append(b)
    dag.npred[b] += 1


# -- priority rules -------------------------------------------------------------------------
Rule = Callable[[Dag, int, bool], tuple]
_OP_ORDER = {"ifw": {Op.I: 0, Op.F: 1, Op.W: 2}, "fiw": {Op.F: 0, Op.I: 1, Op.W: 2}}


def _tail(dag: Dag) -> list[float]:
    """Longest path from the start of each task to the end of the iteration (its 'bottom level')."""
    out = [0.0] * len(dag)
    for t in reversed(range(len(dag))):  # successors always have larger ids
        out[t] = dag.dur[t] + max((out[u] for u in dag.succs[t]), default=0.0)
    return out


def _op_rule(order: dict, unblock: bool) -> Rule:
    """By op, then oldest micro-batch first. ``unblock``: while a forward that has arrived
    waits for memory, W (which frees it) goes first."""
    first = {**order, Op.W: -1} if unblock else order
    return lambda d, t, blocked: ((first if blocked else order)[d.op[t]], d.micro[t], d.stage[t])


def _stage_rule(sign: int) -> Rule:
    """I > F > W; among forwards the shallowest (sign 1) or deepest (sign -1) stage first."""
    order = _OP_ORDER["ifw"]
    return lambda d, t, blocked: (order[d.op[t]], sign * d.stage[t] if d.op[t] is Op.F else 0, d.micro[t])


def make_rule(name: str, dag: Dag) -> Rule:
    """Priority key of a ready task on its rank (least first)."""
    if name in ("ifw", "fiw", "ifw-unblock", "fiw-unblock"):
        return _op_rule(_OP_ORDER[name[:3]], name.endswith("-unblock"))
    if name in ("ifw-shallow", "ifw-deep"):
        return _stage_rule(1 if name == "ifw-shallow" else -1)
    if name == "critical-path":  # HLFET: longest remaining path first
        tail = _tail(dag)
        return lambda d, t, blocked: (-tail[t], d.micro[t])
    raise ScheduleError(f"unknown chimera-zb rule {name!r}; choose one of {', '.join(RULES)}")


RULES = ("ifw", "fiw", "ifw-shallow", "ifw-deep", "critical-path", "ifw-unblock", "fiw-unblock")
RESERVES = ("one", "1f1b")
# the variants `auto` plays, keeping the shortest (chosen by benchmarks/zero_bubble.py)
AUTO = ("fiw-unblock/one", "fiw-unblock/1f1b", "ifw/1f1b")


# -- the greedy play ------------------------------------------------------------------------
_EPS = 1e-9


class _Play:
    """One list-scheduling run of a Dag on D ranks under a per-rank activation cap."""

    def __init__(self, dag: Dag, ranks: int, cap: float, size: float, hop: float, rule: Rule):
        self.dag, self.cap, self.size, self.hop, self.rule = dag, cap, size, hop, rule
        self.missing = list(dag.npred)
        self.arrival = [0.0] * len(dag)
        self.ready: list[list[int]] = [[] for _ in range(ranks)]
        for t in range(len(dag)):
            if not dag.npred[t]:
                self.ready[dag.rank[t]].append(t)
        self.held = [0.0] * ranks
        self.in_flight: dict[tuple[int, int], int] = {}  # replica -> micro-batches held
        self.forwards_left: dict[tuple[int, int], int] = {}
        self.replicas: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]
        for t in range(len(dag)):
            if dag.op[t] is Op.F:
                key = dag.replica(t)
                if key not in self.in_flight:
                    self.replicas[dag.rank[t]].append(key)
                self.forwards_left[key] = self.forwards_left.get(key, 0) + 1
                self.in_flight[key] = 0
        self.reserve = {y: 1 for y in self.in_flight}
        self.free_at = [0.0] * ranks
        self.order: list[list[int]] = [[] for _ in range(ranks)]
        self.running: list[tuple[float, int]] = []
        self.makespan = 0.0

    def set_reserve(self, want: Callable[[int, int], int]) -> None:
        """Keep room for ``want(pipe, stage)`` micro-batches per replica, granted smallest first
        (replicas near the end of their pipe need few, and their pipe stalls without them) while
        a rank's reserves fit under its cap; every replica keeps at least one."""
        for reps in self.replicas:
            left = int(self.cap / self.size + _EPS)
            for n, y in enumerate(sorted(reps, key=lambda y: (want(*y), y))):
                self.reserve[y] = max(1, min(want(*y), left - (len(reps) - 1 - n)))
                left -= self.reserve[y]

    def run(self) -> "_Play":
        now, finished = 0.0, 0
        while finished < len(self.dag):
            for r in range(len(self.ready)):
                if self.free_at[r] <= now + _EPS:
                    t = self._pick(r, now)
                    if t is not None:
                        self._start(t, now)
            now = self._next_time(now)
            finished += self._complete(now)
        return self

    def _deficit(self, y: tuple[int, int], extra: int = 0) -> int:
        """Micro-batches replica y is still owed of its reserve (after ``extra`` more start)."""
        return max(0, min(self.reserve[y], self.forwards_left[y] - extra) - self.in_flight[y] - extra)

    def _admissible(self, t: int) -> bool:
        """F fits under the cap while leaving every replica of the rank room for its reserve."""
        if self.dag.op[t] is not Op.F:
            return True
        r, key = self.dag.rank[t], self.dag.replica(t)
        owed = sum(self._deficit(y) for y in self.replicas[r] if y != key) + self._deficit(key, 1)
        return self.held[r] + self.size * (1 + owed) <= self.cap + _EPS

    def _pick(self, r: int, now: float) -> int | None:
        arrived = [t for t in self.ready[r] if self.arrival[t] <= now + _EPS]
        allowed = [t for t in arrived if self._admissible(t)]
        blocked = len(allowed) < len(arrived)  # a forward waits for memory
        return min(allowed, key=lambda t: self.rule(self.dag, t, blocked), default=None)

    def _start(self, t: int, now: float) -> None:
        """Run t; its successors learn now when their input will arrive (times are exact)."""
        dag, r = self.dag, self.dag.rank[t]
        self.ready[r].remove(t)
        self.order[r].append(t)
        end = self.free_at[r] = now + dag.dur[t]
        heapq.heappush(self.running, (end, t))
        if dag.op[t] is Op.F:
            key = dag.replica(t)
            self.held[r] += self.size
            self.in_flight[key] += 1
            self.forwards_left[key] -= 1
        for u in dag.succs[t]:
            hop = self.hop if dag.rank[u] != r else 0.0
            self.arrival[u] = max(self.arrival[u], end + hop)
            self.missing[u] -= 1
            if not self.missing[u]:
                self.ready[dag.rank[u]].append(u)

    def _next_time(self, now: float) -> float:
        times = [self.running[0][0]] if self.running else []
        times += [self.arrival[t] for r, ts in enumerate(self.ready) if self.free_at[r] <= now + _EPS
                  for t in ts if self.arrival[t] > now + _EPS]
        if not times:  # cannot happen with the reservation rule; kept as a loud guard
            raise ScheduleError(f"chimera-zb list scheduler is stuck at t={now:g}")
        return min(times)

    def _complete(self, now: float) -> int:
        """Finish what ends by ``now``: a W frees its micro-batch's activations."""
        n = 0
        while self.running and self.running[0][0] <= now + _EPS:
            end, t = heapq.heappop(self.running)
            n += 1
            self.makespan = max(self.makespan, end)
            if self.dag.op[t] is Op.W:
                self.held[self.dag.rank[t]] -= self.size
                self.in_flight[self.dag.replica(t)] -= 1
        return n


def play(placement: Placement, micro_pipe, times: OpTimes, cap: float, variant: str = "fiw-unblock/one"
         ) -> tuple[list[list[Action]], float]:
    """List-schedule F, I, W of every micro-batch; return per-rank actions and the makespan.

    ``variant``: ``RULE`` or ``RULE/RESERVE`` with RULE in :data:`RULES` and RESERVE in
    :data:`RESERVES`: ``one`` micro-batch of room per replica, or ``1f1b``: as many as 1F1B
    keeps in flight at that stage (S - s).
    """
    rule, _, reserve = variant.partition("/")
    if reserve not in ("",) + RESERVES:
        raise ScheduleError(f"unknown chimera-zb reserve {reserve!r}; choose one of {', '.join(RESERVES)}")
    dag = build_dag(placement, micro_pipe, times)
    size = placement.ranks / placement.stages
    need = max(len(placement.held(r)) for r in range(placement.ranks)) * size
    if cap + _EPS < need:
        raise ScheduleError(f"activation cap {cap:g} Ma is below {need:g} Ma, one micro-batch for "
                            f"each replica a rank holds")
    game = _Play(dag, placement.ranks, cap, size, times.hop, make_rule(rule, dag))
    if reserve == "1f1b":
        game.set_reserve(lambda pipe, stage: placement.stages - stage)
    game.run()
    programs = [[Action(dag.op[t], dag.pipe[t], dag.stage[t], dag.micro[t]) for t in ts]
                for ts in game.order]
    return programs, game.makespan


@register("chimera-zb", "Chimera placement with B split into I and W, list-scheduled by time under "
                        "a per-rank activation cap (default D Ma); any N")
def chimera_zb(stages: int, micro_batches: int, pipes: int = 2, cost: str | None = None,
               cap: int | None = None, rule: str = "auto", exact: int = 0) -> Schedule:
    """Chimera's Q pipes (micro-batch m on pipe m mod Q), ordered by ``rule`` under ``cap``.

    ``cost``: ``"F:I:W"`` or ``"F:B"`` unit times (default ``1:1:1``), or from Python a
    :class:`chimera.sim.CostModel` (per-stage times and p2p). ``cap``: activation memory per
    rank in Ma (default D). ``rule``: a :func:`play` variant, or ``auto`` to play each of
    :data:`AUTO` and keep the shortest. ``exact``: seconds of CP-SAT refinement
    (:mod:`chimera.schedules.exact`, needs OR-Tools; small D and N), 0 for none.
    """
    if micro_batches < 1:
        raise ScheduleError(f"chimera-zb needs micro-batches >= 1, got {micro_batches}")
    placement = Placement.chimera(stages, pipes)
    micro_pipe = tuple(m % pipes for m in range(micro_batches))
    times = op_times(cost, stages, stages)
    limit = stages if cap is None else cap
    variants = AUTO if rule == "auto" else (rule,)
    plays = [(*play(placement, micro_pipe, times, limit, v), v) for v in variants]
    programs, span, chosen = min(plays, key=lambda x: x[1])
    if exact > 0:
        from chimera.schedules.exact import refine

        refined, refined_span, _ = refine(placement, micro_pipe, times, limit, programs, exact)
        if refined_span < span:
            programs, chosen = refined, f"{chosen}+cpsat"
    return Schedule("chimera-zb", placement, micro_pipe, tuple(map(tuple, programs)),
                    params={"stages": stages, "micro_batches": micro_batches, "pipes": pipes,
                            "cost": cost if isinstance(cost, str) or cost is None else "custom",
                            "cap": limit, "rule": chosen})
