"""Asynchronous PipeDream and PipeDream-2BW: simulation only, for the paper's comparison.

Neither flushes the pipeline: micro-batches of the next iteration enter while the current
one drains, and weights are updated without waiting for the whole mini-batch, so the result
differs from single-device training (weight staleness). They are registered with
``runnable=False``: the planner and simulator price them, the runtime refuses them.

The schedule value is one *window* of the never-ending 1F1B pipeline: rank r keeps D - r
micro-batches in flight, exactly as 1F1B does. Simulating that window alone would charge
the fill and drain that an asynchronous pipeline never pays, so the planner prices an
iteration as N times :func:`steady_period`, the period of the pipeline in steady state.

- **PipeDream** (Narayanan et al., SOSP'19): weight stashing keeps one weight version per
  micro-batch in flight (D - r on rank r, up to D); a weight update, and with data
  parallelism a gradient allreduce, after every micro-batch.
- **PipeDream-2BW** (Narayanan et al., ICML'21): double-buffered weights (2 versions),
  gradients accumulated over the N micro-batches of an iteration and reduced once.
"""

from __future__ import annotations

from collections.abc import Sequence

from chimera.ir import Schedule
from chimera.schedules.classic import one_f_one_b
from chimera.schedules.registry import register

ASYNC_NOTE = "[asynchronous, simulation only] "


def _window(name: str, stages: int, micro_batches: int, versions: str, syncs: str) -> Schedule:
    base = one_f_one_b(stages, micro_batches)
    params = {"stages": stages, "micro_batches": micro_batches, "asynchronous": True,
              "weight_versions": versions, "grad_syncs_per_iteration": syncs}
    return Schedule(name, base.placement, base.micro_pipe, base.programs, params=params)


@register("pipedream", ASYNC_NOTE + "PipeDream: 1F1B that never flushes; weight stashing "
                       "keeps D-r weight versions on rank r; update (and allreduce) per micro-batch",
          runnable=False)
def pipedream(stages: int, micro_batches: int) -> Schedule:
    return _window("pipedream", stages, micro_batches, versions="in-flight", syncs="N")


@register("pipedream-2bw", ASYNC_NOTE + "PipeDream-2BW: 1F1B that never flushes; 2 weight "
                           "versions; gradients accumulated over N micro-batches, one allreduce",
          runnable=False)
def pipedream_2bw(stages: int, micro_batches: int) -> Schedule:
    return _window("pipedream-2bw", stages, micro_batches, versions="2", syncs="1")


def weight_versions(schedule: Schedule, rank: int) -> int:
    """Weight copies ``rank`` keeps in steady state: 2 (2BW), one per micro-batch in flight,
    D - rank (PipeDream's stashing), else 1."""
    versions = schedule.params.get("weight_versions")
    if versions == "2":
        return 2
    if versions == "in-flight":
        return schedule.ranks - rank
    return 1


def steady_period(stage_time: Sequence[float], hop: float | Sequence[float] = 0.0) -> float:
    """Time per micro-batch of a never-flushing 1F1B pipeline (the maximum cycle mean).

    ``stage_time[s]`` is F + B of one micro-batch on stage s, ``hop`` the p2p latency of a
    boundary (one number, or one per boundary s -> s+1). Rank r keeps D - r micro-batches in
    flight, and one of them must travel from stage r to the last stage and back (F + B of
    stages r..D-1 and two hops per boundary) before rank r may start another, so the period
    is at least that round trip over D - r; and at least the busiest stage's F + B. Exact
    for the cyclic schedule the simulator would run (tested against it).
    """
    d = len(stage_time)
    hops = [hop] * max(d - 1, 0) if isinstance(hop, (int, float)) else list(hop)[:max(d - 1, 0)]
    period = max(stage_time)
    for r in range(d):
        trip = sum(stage_time[r:]) + 2 * sum(hops[r:])
        period = max(period, trip / (d - r))
    return period
