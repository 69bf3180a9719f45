"""Lower bounds on iteration time: what no schedule can beat under a cost model (no torch).

Both the bound on one schedule's placement (``chimera simulate --bound``, the chimera-zb
benchmark) and the planner's floors, which cut configurations without simulating them, come
from the simulator's rules: a rank does one thing at a time, an input arrives one hop after
its producer ends, a stage's allreduce follows its last gradient. One primitive,
:func:`arrivals`, walks a pipe's stages with the hops between ranks. For rank r:

    makespan >= head(r) + work(r) + tail(r)

- ``head(r)``: the earliest a forward input can arrive, over the replicas r holds: the
  forwards of the stages before it, plus one p2p hop per rank change on the way.
- ``work(r)``: the compute time of every action placed on r.
- ``tail(r)``: the mirror image of the head. With a full backward B the last action of r is
  a B of some replica (p, s), and the backwards of stages s-1 .. 0 must follow it; with B
  split into I and W the last action can be a W that nothing waits for, so the tail is 0.

:func:`placement_bound` is the largest of these over the ranks (and the critical path of one
micro-batch). On Chimera's placement with F = B the middle ranks give head + tail = D-2 units:
Chimera's D-2 bubbles are optimal for its placement without a split backward. With F = I = W
the latest-starting rank gives D/2-1 units: at D=8, N=16 a bubble of 3/51 = 5.9%.

:func:`time_floor` is the planner's cheaper form, which needs no micro-batch assignment: each
micro-batch passes rank r at least once on one of its pipes (``n * busy``), plus one
micro-batch's round trip and the cheapest allreduce. Asynchronous schemes are priced exactly
by their steady state (:func:`async_parts`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from chimera.ir import OpTimes, Placement, Schedule
from chimera.schedules.asynchronous import steady_period
from chimera.sim.cost import CostModel, Link


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
    forward = {p: arrivals(placement.table[p], t.f, t.hop) for p in used}
    backward = {p: arrivals(placement.table[p], t.b, t.hop) for p in used}
    best = None
    for r in range(d):
        held = [(p, s) for p, s in placement.held(r) if p in used]
        if not held:
            continue
        head = min(forward[p][s] for p, s in held)
        tail = 0.0 if split else min(backward[p][s] for p, s in held)
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


def arrivals(row: Sequence[int], times: Sequence[float], hops: Sequence[float]) -> list[float]:
    """For one pipe (``row[s]``: the rank of stage s), the time of ``times`` over stages
    0 .. s-1 plus ``hops[k]`` for each rank change k -> k+1 on the way, for every stage s:
    the earliest its forward input can arrive (times = F), or the backward chain that must
    follow stage s (times = B, or I)."""
    out, total = [0.0], 0.0
    for s in range(len(row) - 1):
        total += times[s]
        if row[s + 1] != row[s]:
            total += hops[s]
        out.append(total)
    return out


def _critical_path(placement: Placement, pipe: int, t: OpTimes, split: bool) -> float:
    """One micro-batch alone: forwards down, backwards (I) up, then the W of stage 0."""
    last, row = placement.stages - 1, placement.table[pipe]
    back = t.i if split else t.b
    path = arrivals(row, t.f, t.hop)[last] + t.f[last]
    path += arrivals(row, back, t.hop)[last] + back[last]
    return path + (t.w[0] if split else 0.0)


# -- the planner's floors --------------------------------------------------------------------
def time_floor(schedule: Schedule, times: OpTimes, grad_bytes: Sequence[float], micro_batches: int,
               allreduce: Link, width: int) -> float:
    """max(per-rank fill + busy + drain, one micro-batch's round trip) + cheapest allreduce,
    for ``micro_batches`` full micro-batches with per-stage ``times`` (hops included)."""
    split, ranks = schedule.split_backward, schedule.ranks
    back = times.i if split else times.b
    n = round(micro_batches / schedule.micro_scale)
    fill, drain, busy = [math.inf] * ranks, [math.inf] * ranks, [math.inf] * ranks
    work = [f + b for f, b in zip(times.f, times.b)]
    trip = math.inf
    for row in schedule.placement.table:
        down, up = arrivals(row, times.f, times.hop), arrivals(row, back, times.hop)
        per_rank = [0.0] * ranks
        for stage, rank in enumerate(row):
            fill[rank] = min(fill[rank], down[stage])
            drain[rank] = min(drain[rank], up[stage])
            per_rank[rank] += work[stage]
        busy = [min(x, y) for x, y in zip(busy, per_rank)]
        trip = min(trip, down[-1] + times.f[-1] + up[-1] + back[-1])
    if split:  # a rank may end on a W that nothing waits for
        drain = [0.0] * ranks
    bound = max(trip, max(fill[r] + n * busy[r] + drain[r] for r in range(ranks)))
    group = len(schedule.placement.replicas(0)) * width
    if group > 1:
        bound += min(allreduce.allreduce(x, group) for x in grad_bytes)
    return bound


def quick_floor(micro_batches: int, depth: int, model_time: float) -> float:
    """The model's work for N micro-batches spread evenly over D ranks; needs no schedule."""
    return micro_batches * model_time / depth


def async_parts(times: OpTimes, grad_bytes: Sequence[float], micro_batches: int, syncs: int,
                allreduce: Link, width: int, optimizer: Sequence[float] = ()
                ) -> tuple[float, float, list[float]]:
    """(iteration, compute part, busy per stage) of PipeDream / 2BW in steady state.

    N micro-batches at the pipeline's steady period; ``syncs`` allreduces per iteration of
    each stage (N for PipeDream, 1 for 2BW) on each rank's channel, overlapping the next
    micro-batches entirely (the asynchronous update lets them): the iteration is the longer
    of the two. Each sync is followed by an optimizer update of the stage (``optimizer[s]``
    seconds), on the compute stream. An approximation: the two streams do not slow each
    other down.
    """
    update = list(optimizer) or [0.0] * len(times.f)
    stage_time = [f + b for f, b in zip(times.f, times.b)]
    steps = [syncs * u for u in update]
    compute = micro_batches * steady_period(stage_time, times.hop[:-1]) + max(steps)
    comm = syncs * max(allreduce.allreduce(x, width) for x in grad_bytes)
    return (max(compute, comm), compute,
            [micro_batches * t + u for t, u in zip(stage_time, steps)])
