"""Lower bound on the makespan (and so on the bubble ratio) of any schedule on a placement.

A rank cannot start before the first input can reach it, must do all of its own work, and
after its last action some work may still have to run elsewhere. For rank r:

    makespan >= head(r) + work(r) + tail(r)

- ``head(r)``: the earliest a forward input can arrive, over the replicas r holds: the
  forwards of the stages before it, plus one p2p hop per rank change on the way.
- ``work(r)``: the compute time of every action placed on r.
- ``tail(r)``: the mirror image of the head. With a full backward B the last action of r is
  a B of some replica (p, s), and the backwards of stages s-1 .. 0 must follow it; with B
  split into I and W the last action can be a W that nothing waits for, so the tail is 0.

The bound is the largest of these over the ranks (and the critical path of one micro-batch).
On Chimera's placement with F = B the middle ranks give head + tail = D-2 units: Chimera's
D-2 bubbles are optimal for its placement without a split backward. With F = I = W the
latest-starting rank gives D/2-1 units: at D=8, N=16 a bubble of 3/51 = 5.9%.
"""

from __future__ import annotations

from dataclasses import dataclass

from chimera.ir import OpTimes, Placement, Schedule
from chimera.sim.cost import CostModel


@dataclass(frozen=True)
class Bound:
    makespan: float  # no schedule on this placement can be shorter
    bubble: float  # so no schedule can have a smaller bubble ratio
    rank: int  # the rank that sets the bound
    head: float  # its earliest input arrival
    work: float  # its compute time
    tail: float  # work that must follow its last action elsewhere


def placement_bound(placement: Placement, micro_pipe, cost: CostModel | None = None,
                    split: bool = True, scale: float = 1.0) -> Bound:
    """Bound for ``micro_pipe[m]`` = pipe of micro-batch m on ``placement`` under ``cost``."""
    cost = cost or CostModel.unit()
    d, stages = placement.ranks, placement.stages
    t = cost.op_times(stages, d, scale)
    used = sorted(set(micro_pipe))
    back = [i + w for i, w in zip(t.i, t.w)] if split else t.b
    work = [0.0] * d
    for p in micro_pipe:
        for s in range(stages):
            work[placement.rank_of(p, s)] += t.f[s] + back[s]
    best = None
    for r in range(d):
        held = [(p, s) for p, s in placement.held(r) if p in used]
        if not held:
            continue
        head = min(_chain(placement, p, s, t.f, t.hop) for p, s in held)
        tail = 0.0 if split else min(_chain(placement, p, s, t.b, t.hop) for p, s in held)
        candidate = (head + work[r] + tail, r, head, tail)
        best = max(best, candidate) if best else candidate
    total, rank, head, tail = best
    total = max(total, max(_critical_path(placement, p, t, split) for p in used))
    busy = sum(work)
    return Bound(total, 1.0 - busy / (d * total) if total > 0 else 0.0, rank, head, work[rank], tail)


def schedule_bound(schedule: Schedule, cost: CostModel | None = None) -> Bound:
    """Bound for the placement and micro-batches of ``schedule`` (its order is not used)."""
    return placement_bound(schedule.placement, schedule.micro_pipe, cost,
                           schedule.split_backward, schedule.micro_scale)


def _chain(placement: Placement, pipe: int, stage: int, times, hop) -> float:
    """Time of ``times`` over stages 0 .. stage-1 of ``pipe``, plus a hop per rank change."""
    total = 0.0
    for s in range(stage):
        total += times[s]
        if placement.rank_of(pipe, s) != placement.rank_of(pipe, s + 1):
            total += hop[s]
    return total


def _critical_path(placement: Placement, pipe: int, t: OpTimes, split: bool) -> float:
    """One micro-batch alone: forwards down, backwards (I) up, then the W of stage 0."""
    last = placement.stages - 1
    back = t.i if split else t.b
    path = _chain(placement, pipe, last, t.f, t.hop) + t.f[last]
    path += _chain(placement, pipe, last, back, t.hop) + back[last]
    return path + (t.w[0] if split else 0.0)
