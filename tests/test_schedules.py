"""Generators against the paper's closed forms, and the validator over a grid of shapes."""

import pytest

from chimera.theory import tables
from chimera.theory.formulas import closed_form
from chimera.ir import Action, Op, ScheduleError
from chimera.passes import lower
from chimera.schedules import build, schemes
from chimera.sim import CostModel, simulate
from chimera.check.validate import ValidationError, validate

EQUAL = CostModel.unit(1, 1)
# the sweeps' largest shapes, in this process: make test-slow runs them (on two workers),
# make test the rest
SLOW = [pytest.mark.slow, pytest.mark.sweep]


def big(*values):
    """One parametrization case left to the slow set (a large D or N, seconds to simulate)."""
    return pytest.param(*values, marks=SLOW)


def sim(name, d, n, cost=EQUAL, **kw):
    return simulate(validate(lower(build(name, d, n, **kw))), cost)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("d,n", [(2, 2), (4, 4), (4, 8), (8, 3), (8, 16), (16, 5)])
def test_gpipe_1f1b_bubble(name, d, n):
    assert sim(name, d, n).bubble_ratio == pytest.approx((d - 1) / (n + d - 1))


@pytest.mark.parametrize("d", [d if d < 20 else big(d) for d in range(4, 33, 2)])
def test_chimera_basic_unit_bubble(d):
    assert sim("chimera", d, d).bubble_ratio == pytest.approx((d - 2) / (2 * d + d - 2))


@pytest.mark.parametrize("d", [4, 6, 8, big(16)])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_chimera_direct_concatenation_keeps_d_minus_2_bubbles(d, k):
    t = sim("chimera", d, k * d)
    assert t.makespan == 2 * k * d + d - 2  # D-2 idle units per rank, whatever k
    for r in t.ranks:
        assert t.makespan - r.busy == d - 2


@pytest.mark.parametrize("d", [d if d < 20 else big(d) for d in range(4, 33, 2)])
def test_chimera_memory_at_n_equals_d(d):
    t = sim("chimera", d, d)
    acts = [r.peak_activations for r in t.ranks]
    assert min(acts) == d / 2 + 1 and max(acts) == d
    assert all(r.weights == 2 for r in t.ranks)


@pytest.mark.parametrize("d,q", [(4, 4), (8, 4), (8, 8), big(16, 4)])
def test_chimera_q_pipes_weights(d, q):
    t = sim("chimera", d, 2 * d, pipes=q)
    assert all(r.weights == q for r in t.ranks)
    assert t.bubble_ratio < sim("chimera", d, 2 * d).bubble_ratio + 1e-12


def test_1f1b_rank_r_holds_d_minus_r():
    t = sim("1f1b", 8, 16)
    assert [r.peak_activations for r in t.ranks] == [8 - r for r in range(8)]


@pytest.mark.parametrize("d,n,v", [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (8, 16, 2)])
def test_interleaved_bubble(d, n, v):
    assert sim("interleaved", d, n, chunks=v).bubble_ratio == pytest.approx((d - 1) / (v * n + d - 1))


@pytest.mark.parametrize("d,n", [(4, 4), (4, 8), (8, 16), (6, 12)])
def test_zb_h1_has_d_minus_1_unit_bubbles(d, n):
    t = sim("zb-h1", d, n, cost=CostModel.unit(1, i=1, w=1))
    assert t.makespan == 3 * n + d - 1
    assert all(t.makespan - r.busy == d - 1 for r in t.ranks)
    assert max(r.peak_activations for r in t.ranks) == d


@pytest.mark.parametrize("d,n", [(4, 8), (4, 16), (8, 16), big(16, 32), big(16, 64)])
def test_forward_doubling_beats_direct_when_backward_is_twice_forward(d, n):
    heavy = CostModel.unit(1, 2)
    assert sim("chimera", d, n, heavy, strategy="doubling").makespan < \
        sim("chimera", d, n, heavy, strategy="direct").makespan


def test_halving_is_half_size_doubling_without_extra_memory():
    s = build("chimera", 8, 16, strategy="halving")
    assert s.micro_scale == 0.5 and s.micro_batches == 32
    heavy = CostModel.unit(1, 2)
    halving, direct = sim("chimera", 8, 16, heavy, strategy="halving"), sim("chimera", 8, 16, heavy)
    assert max(r.peak_activations for r in halving.ranks) <= max(r.peak_activations for r in direct.ranks)
    assert halving.makespan < direct.makespan


GRID = [(name, d, n, kw) if not (d == 8 and n > d) else big(name, d, n, kw)
        for d in (2, 4, 6, 8)
        for n in (d, 2 * d, 3 * d)
        for name, kw in [("gpipe", {}), ("1f1b", {}), ("zb-h1", {}), ("gems", {}),
                         ("interleaved", {"chunks": 2}), ("chimera", {}),
                         ("chimera", {"strategy": "doubling"}), ("chimera", {"strategy": "halving"}),
                         ("chimera", {"pipes": 4}), ("zb-v", {}), ("dualpipev", {}), ("dualpipe", {}),
                         ("chimera-zb", {}), ("chimera-zb", {"pipes": 4})]
        if not (kw.get("pipes") == 4 and d % 4) and not (kw.get("strategy") == "doubling" and n % 4)]


@pytest.mark.parametrize("name,d,n,kw", GRID)
@pytest.mark.parametrize("sync", ["eager", "end"])
def test_every_generator_passes_the_validator(name, d, n, kw, sync):
    s = build(name, d, n, **kw)
    validate(s)
    low = validate(lower(s, sync))
    assert sum(a.op is Op.STEP for _, _, a in low.actions()) == d
    syncs = sum(a.op is Op.SYNC for _, _, a in low.actions())
    assert syncs == sum(len(low.placement.held(r)) for r in range(d))


def test_chimera_accepts_n_not_multiple_of_d():
    t = sim("chimera", 4, 6)
    assert t.bubble_ratio > sim("chimera", 4, 8).bubble_ratio


@pytest.mark.parametrize("kw,match", [
    ({"stages": 5, "micro_batches": 5}, "even"),
    ({"stages": 4, "micro_batches": 3}, "multiple"),
    ({"stages": 4, "micro_batches": 4, "strategy": "tripling"}, "strategy"),
    ({"stages": 4, "micro_batches": 6, "strategy": "doubling"}, "multiple"),
])
def test_chimera_refuses_bad_shapes(kw, match):
    with pytest.raises(ScheduleError, match=match):
        build("chimera", **kw)


def test_build_rejects_unknown_names_and_options():
    with pytest.raises(ScheduleError, match="unknown schedule"):
        build("pipedream-9000", 4, 4)
    with pytest.raises(ScheduleError, match="does not take"):
        build("gpipe", 4, 4, pipes=2)
    with pytest.raises(ScheduleError, match="positive"):
        build("gpipe", 0, 4)


def test_every_scheme_is_registered_with_a_description():
    names = {s.name for s in schemes()}
    assert {"gpipe", "1f1b", "gems", "interleaved", "zb-h1", "chimera",
            "zb-v", "dualpipev", "dualpipe", "chimera-zb"} <= names
    assert all(s.description for s in schemes())


def _swap(schedule, rank, i, j):
    progs = [list(p) for p in schedule.programs]
    progs[rank][i], progs[rank][j] = progs[rank][j], progs[rank][i]
    return schedule.with_programs(progs)


def test_validator_rejects_backward_before_forward_with_picture():
    s = build("1f1b", 4, 4)
    bad = _swap(s, 3, 0, 1)  # rank 3: B0 before F0
    with pytest.raises(ValidationError) as err:
        validate(bad)
    assert "comes before its F" in str(err.value)
    assert "P3" in str(err.value) and ">B0<" in str(err.value)  # the grid, offender marked


def test_validator_finds_deadlock():
    s = build("gpipe", 2, 2)
    # rank 0 waits for B0 before sending F1; rank 1 wants F1 before it does F0: a cycle
    progs = [[Action.parse(a) for a in "p0s0F0 p0s0B0 p0s0F1 p0s0B1".split()],
             [Action.parse(a) for a in "p0s1F1 p0s1F0 p0s1B0 p0s1B1".split()]]
    with pytest.raises(ValidationError, match="deadlock"):
        validate(s.with_programs(progs))


def test_validator_rejects_missing_and_duplicate_actions():
    s = build("1f1b", 2, 2)
    progs = [list(p) for p in s.programs]
    progs[0] = progs[0][:-1]
    with pytest.raises(ValidationError, match="appears 0 times"):
        validate(s.with_programs(progs))
    progs = [list(p) for p in s.programs]
    progs[1].append(progs[1][0])
    with pytest.raises(ValidationError, match="appears 2 times"):
        validate(s.with_programs(progs))


def test_validator_rejects_unmatched_send():
    low = lower(build("1f1b", 2, 2))
    progs = [[a for a in p if not (a.op is Op.RECV_F and a.micro == 1)] for p in low.programs]
    with pytest.raises(ValidationError, match="RECV_F|never received"):
        validate(low.with_programs(progs))


def test_validator_rejects_action_on_wrong_rank():
    s = build("1f1b", 2, 2)
    progs = [list(p) for p in s.programs]
    progs[0][0] = Action(Op.F, 0, 1, 0)
    with pytest.raises(ValidationError, match="belongs on rank 1"):
        validate(s.with_programs(progs))


def test_closed_forms_cover_the_table():
    assert closed_form("chimera", 8, 8).bubble == pytest.approx(6 / 22)
    assert closed_form("1f1b", 4, 8).activations == (1.0, 4.0)


def test_the_scheme_table_marks_a_refused_size_and_lets_a_bug_through(monkeypatch):
    rows = {r["label"]: r for r in tables.scheme_rows(4, 6)}
    assert "multiple" in rows["interleaved v=2"]["error"] and "error" not in rows["1f1b"]

    def broken(*args, **kwargs):
        raise ValueError("a bug, not bad input")

    monkeypatch.setattr(tables, "lower", broken)
    with pytest.raises(ValueError, match="a bug"):
        tables.scheme_rows(4, 8)
