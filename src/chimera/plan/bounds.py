"""Lower bounds on a configuration's iteration time and memory, without simulating it.

Every bound here is something no schedule of that shape can beat under the cost model, so a
configuration whose bound is worse than what the search already holds is cut without loss.
The simulator's rules (a rank does one thing at a time; an input arrives one hop after its
producer ends; the allreduce of a stage follows its last gradient) give, for rank r:

- *fill*: r's first input is a forward of the stage it holds nearest to a pipe's start, so
  it cannot arrive before the forward chain up to that stage has run (hops included);
- *busy*: r computes every micro-batch once on one of its replicas (F + B of that stage);
- *drain*: after r's last backward, the backward chain still runs down to the pipe's first
  stage (none when backward is split: r may end on a W that nothing waits for);
- every micro-batch goes through all stages of its pipe and back (*round trip*);
- the allreduce of the stage whose gradient came last follows it (the cheapest one, then).

Asynchronous schemes are priced exactly by their steady state (``async_parts``).
"""

from __future__ import annotations

import math

from chimera.plan.memory import state_bytes
from chimera.plan.shapes import Shape
from chimera.plan.workload import StageCosts
from chimera.schedules.asynchronous import steady_period
from chimera.sim.cost import Link


def time_floor(shape: Shape, sc: StageCosts, hops: list[float], micro_batches: int,
               allreduce: Link, width: int) -> float:
    """max(per-rank fill + busy + drain, one micro-batch's round trip) + cheapest allreduce."""
    s = shape.schedule
    split, ranks = s.split_backward, s.ranks
    t = sc.times
    chain_b = t.i if split else t.b
    n = round(micro_batches / s.micro_scale)
    fill, drain, busy = [math.inf] * ranks, [math.inf] * ranks, [math.inf] * ranks
    work = [f + b for f, b in zip(t.f, t.b)]
    trip = math.inf
    for row in s.placement.table:
        f_sum = b_sum = 0.0
        per_rank = [0.0] * ranks
        last = len(row) - 1
        for stage, rank in enumerate(row):
            if f_sum < fill[rank]:
                fill[rank] = f_sum
            if not split and b_sum < drain[rank]:
                drain[rank] = b_sum
            per_rank[rank] += work[stage]
            hop = hops[stage] if stage < last and row[stage + 1] != rank else 0.0
            f_sum += t.f[stage] + hop
            b_sum += chain_b[stage] + hop
        busy = [min(x, y) for x, y in zip(busy, per_rank)]
        trip = min(trip, f_sum + b_sum)
    if split:
        drain = [0.0] * ranks
    bound = max(trip, max(fill[r] + n * busy[r] + drain[r] for r in range(ranks)))
    group = len(s.placement.replicas(0)) * width
    if group > 1:
        bound += min(allreduce.allreduce(x, group) for x in sc.grad_bytes)
    return bound


def memory_floor(shape: Shape, sc: StageCosts, precision: str, recompute: bool,
                 shards: int = 1) -> float:
    """The fullest rank holds at least its replicas' state and one micro-batch."""
    worst = 0.0
    for held in shape.replicas:
        params = sum(sc.params[stage] for _, stage in held)
        act = min(sc.act_kept[stage] for _, stage in held)
        if recompute:  # and one of its stages rebuilt during its backward
            act += max(sc.act_full[stage] for _, stage in held)
        worst = max(worst, state_bytes(params, precision, shards=shards) + act)
    return worst


def quick_floor(micro_batches: int, depth: int, model_time: float) -> float:
    """The model's work for N micro-batches spread evenly over D ranks; needs no schedule."""
    return micro_batches * model_time / depth


def async_parts(sc: StageCosts, hops: list[float], micro_batches: int, syncs: int,
                allreduce: Link, width: int) -> tuple[float, float, list[float]]:
    """(iteration, compute part, busy per stage) of PipeDream / 2BW in steady state.

    N micro-batches at the pipeline's steady period; ``syncs`` allreduces per iteration of
    each stage (N for PipeDream, 1 for 2BW) on each rank's channel, overlapping the next
    micro-batches entirely (the asynchronous update lets them): the iteration is the longer
    of the two. An approximation: the two streams do not slow each other down.
    """
    stage_time = [f + b for f, b in zip(sc.times.f, sc.times.b)]
    compute = micro_batches * steady_period(stage_time, hops[:-1])
    comm = syncs * max(allreduce.allreduce(x, width) for x in sc.grad_bytes)
    return max(compute, comm), compute, [micro_batches * t for t in stage_time]
