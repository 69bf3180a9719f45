"""The process grid with tensor parallelism, P = W x D x T, against brute force (no processes).

Brute force: lay the ranks out by nested loops (w outermost, t innermost), then ask of every
pair of ranks whether they must share a group: a stage group when both hold a replica of the
stage at the same TP position; a TP group when they are the same pipeline rank of the same
data-parallel copy; a p2p pair when their pipeline ranks exchange messages, same copy, same t.
"""

import itertools

import pytest

from chimera.check.comm_plan import plan_comm
from chimera.passes import lower
from chimera.runtime.grid import ProcessGrid, group_order
from chimera.schedules import build

SCHEDULES = [("1f1b", {}), ("chimera", {}), ("zb-v", {}), ("interleaved", {"chunks": 2}),
             ("dualpipev", {})]


def _layouts():
    for name, opts in SCHEDULES:
        for d in (1, 2, 4, 8):
            if name != "1f1b" and d == 1:
                continue
            for w, t in itertools.product((1, 2, 4, 8), repeat=2):
                if w * d * t <= 8:
                    yield name, opts, d, w, t


class _Groups:
    """Records new_group calls; a group is its ranks."""

    def __init__(self):
        self.calls = []

    def new_group(self, ranks):
        self.calls.append(list(ranks))
        return tuple(ranks)


def _coords(rank, d_count, t_count):
    """Brute force: the (w, d, t) of ``rank`` from the nested loops that lay ranks out."""
    layout = [(w, d, t) for w in range(8) for d in range(d_count) for t in range(t_count)]
    return layout[rank]


@pytest.mark.parametrize("name,opts,d,w,t", list(_layouts()))
def test_groups_match_brute_force(name, opts, d, w, t):
    schedule = lower(build(name, d, 2 * d, **opts))
    placement, world = schedule.placement, w * d * t
    grids, calls = [], []
    for rank in range(world):
        grid, fake = ProcessGrid(placement, w, rank, t), _Groups()
        grid.build_groups(fake)
        grids.append(grid)
        calls.append(fake.calls)
    assert all(c == calls[0] for c in calls)  # one global order of creation on every rank
    for rank, grid in enumerate(grids):
        assert (grid.w, grid.d, grid.t) == _coords(rank, d, t)
        assert grid.global_rank(grid.d, grid.w, grid.t) == rank
        for stage in range(placement.stages):
            want = [r for r in range(world) if _coords(r, d, t)[2] == grid.t
                    and _coords(r, d, t)[1] in placement.replicas(stage)]
            assert grid.stage_ranks[stage] == want  # every stage's, at our t
            if grid.d in placement.replicas(stage):
                assert (grid.stage_groups[stage] is None) == (len(want) == 1)
            else:
                assert stage not in grid.stage_groups
        tp_want = [r for r in range(world) if _coords(r, d, t)[:2] == (grid.w, grid.d)]
        assert (grid.tp_ranks, grid.tp_group) == ((tp_want, tuple(tp_want)) if t > 1 else ([], None))
        for pipe, stage in itertools.product(range(placement.pipes), range(placement.stages)):
            peer = _coords(grid.peer(pipe, stage), d, t)
            assert peer == (grid.w, placement.rank_of(pipe, stage), grid.t)
    pairs = grids[0].pairs(plan_comm(schedule))
    for a, b in pairs:
        wa, da, ta = _coords(a, d, t)
        wb, db, tb = _coords(b, d, t)
        assert (wa, ta) == (wb, tb) and da != db
    assert len(pairs) == len(set(pairs))
    inner = {tuple(sorted(m.ranks(schedule))) for m in plan_comm(schedule).order}
    assert len(pairs) == len(inner) * w * t


def test_every_rank_is_in_one_tp_group_and_groups_are_listed_once():
    schedule = lower(build("chimera", 4, 4))
    order = group_order(schedule.placement, 2, 2)
    tps = [ranks for kind, *_, ranks in order if kind == "tp"]
    assert sorted(r for ranks in tps for r in ranks) == list(range(16))
    stages = [(a, b) for kind, a, b, _ in order if kind == "stage"]
    assert stages == [(s, t) for s in range(4) for t in range(2)]
    # Chimera: each stage's replicas on two pipeline ranks, in each of 2 copies, at one t
    assert all(len(ranks) == 4 for kind, *_, ranks in order if kind == "stage")
