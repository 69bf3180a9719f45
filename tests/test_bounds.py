"""chimera.theory.bounds: neither the bound of a schedule's placement nor the planner's floor ever
exceeds the simulated makespan, over a grid of schemes, shapes and cost models (no torch)."""

import pytest

from chimera.theory import bounds
from chimera.ir import Placement, ScheduleError
from chimera.passes import lower
from chimera.schedules import build, schemes
from chimera.sim import CostModel, Link, simulate


def _staged(stages: int) -> CostModel:
    """Uneven stages, a p2p link that charges bytes, a fixed hop on top."""
    return CostModel(f=tuple(1.0 + 0.3 * (s % 3) for s in range(stages)),
                     b=tuple(2.0 + 0.5 * (s % 2) for s in range(stages)),
                     p2p=Link(0.05, 40.0), act_bytes=(2.0,) * stages, p2p_time=0.1)


COSTS = {
    "1:1": lambda stages: CostModel.unit(1, 1),
    "1:2": lambda stages: CostModel.unit(1, 2),
    "1:1:1": lambda stages: CostModel.unit(1, i=1, w=1),
    "1:1.5:0.5": lambda stages: CostModel.unit(1, i=1.5, w=0.5),
    "1:2 hop": lambda stages: CostModel.unit(1, 2, p2p_time=0.3),
    "1:1:1 hop": lambda stages: CostModel.unit(1, i=1, w=1, p2p_time=0.3),
    "per-stage": _staged,
    "W=2 allreduce": lambda stages: CostModel.unit(1, 2, p2p_time=0.1, allreduce=Link(0.2, 10.0),
                                                   weight_bytes=(3.0,), data_parallel=2),
}
SHAPES = [(2, 3), (4, 4), (4, 7), (8, 16)]


def _cases():
    for scheme in schemes():
        for d, n in SHAPES:
            for label in COSTS:
                yield pytest.param(scheme.name, d, n, label, id=f"{scheme.name}-D{d}-N{n}-{label}")


def _floor(schedule, cost: CostModel) -> float:
    """The planner's floor for ``schedule`` priced by ``cost`` (as plan.search calls it)."""
    times = cost.op_times(schedule.stages, schedule.ranks, schedule.micro_scale)
    micro_batches = round(len(schedule.micro_pipe) * schedule.micro_scale)
    per_stage = schedule.stages if len(cost.weight_bytes) == 1 else 1  # one value: every stage
    return bounds.time_floor(schedule, times, cost.weight_bytes * per_stage, micro_batches,
                             cost.allreduce, cost.data_parallel)


@pytest.mark.parametrize("name, d, n, label", list(_cases()))
def test_no_bound_exceeds_the_simulated_makespan(name, d, n, label):
    try:
        unit = build(name, d, n)
    except ScheduleError:
        pytest.skip("a shape this scheme refuses")
    cost = COSTS[label](unit.stages)
    # time-aware schemes are built for the costs they run under, as the CLI builds them
    schedule = build(name, d, n, cost=cost) if "cost" in _options(name) else unit
    timeline = simulate(lower(schedule), cost)
    bound = bounds.schedule_bound(schedule, cost)
    assert bound.makespan <= timeline.makespan + 1e-9
    assert bound.bubble <= timeline.bubble_ratio + 1e-9
    if not _asynchronous(name):  # their floor is the steady state (async_parts), not a bound
        assert _floor(schedule, cost) <= timeline.makespan + 1e-9


def _options(name: str) -> tuple[str, ...]:
    return next(s.options for s in schemes() if s.name == name)


def _asynchronous(name: str) -> bool:
    return name.startswith("pipedream")


def test_the_bound_is_tight_where_a_schedule_reaches_it():
    """GPipe at F = B = 1 with free messages: (N + D - 1) * 2 units, the bound exactly."""
    s = build("gpipe", 4, 8)
    cost = CostModel.unit(1, 1)
    assert bounds.schedule_bound(s, cost).makespan == simulate(lower(s), cost).makespan == 22
    assert _floor(s, cost) == 22


def test_bound_matches_the_closed_forms():
    one = CostModel.unit(1, 1)
    linear = bounds.placement_bound(Placement.linear(8), (0,) * 16, one, split=False)
    assert linear.bubble == pytest.approx(7 / 23)
    chimera = bounds.placement_bound(Placement.chimera(8), tuple(m % 2 for m in range(16)), one, split=False)
    assert chimera.bubble == pytest.approx(6 / 38) and (chimera.head, chimera.tail) == (3, 3)


def test_arrivals_add_a_hop_only_where_the_rank_changes():
    assert bounds.arrivals([0, 1, 1, 2], [1.0, 2.0, 3.0, 4.0], [0.5, 0.5, 0.5, 0.5]) == [0, 1.5, 3.5, 7.0]
