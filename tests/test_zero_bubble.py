"""Zero-bubble schedules: ZB-V, DualPipe(V), chimera-zb, reaching the lower bound, and the CLI hooks
(the bound itself: tests/test_bounds.py)."""

import json

import pytest

from chimera.theory.bounds import schedule_bound
from chimera.cli import main
from chimera.ir import Op, Placement, ScheduleError
from chimera.passes import lower
from chimera.schedules import build
from chimera.schedules.chimera_zb import RESERVES, RULES, op_times, play
from chimera.sim import CostModel, simulate
from chimera.check.validate import validate

UNIT = CostModel.unit(1, i=1, w=1)  # F = I = W = 1, no communication
NEW = ["zb-v", "dualpipev", "dualpipe", "chimera-zb"]
# the sweeps' largest shapes, in this process: make test-slow runs them (on two workers),
# make test the rest
SLOW = [pytest.mark.slow, pytest.mark.sweep]


def big(*values):
    """One parametrization case left to the slow set (a large D or N, seconds to schedule)."""
    return pytest.param(*values, marks=SLOW)


def run(name, d, n, sim_cost=UNIT, **kw):
    schedule = validate(lower(build(name, d, n, **kw)))
    return schedule, simulate(schedule, sim_cost)


GRID = [(name, d, n, kw) if not (d == 8 and n >= 2 * d - 1) else big(name, d, n, kw)
        for d in (2, 4, 6, 8)
        for n in sorted({1, 2, 3, d - 1, d, 2 * d - 1, 2 * d, 2 * d + 1})
        for name, kw in [("zb-v", {}), ("dualpipev", {}), ("dualpipe", {}), ("chimera-zb", {}),
                         ("chimera-zb", {"pipes": 4}), ("chimera-zb", {"cost": "1:1", "cap": d + 2})]
        if n >= 1 and not (kw.get("pipes") == 4 and d % 4)]


@pytest.mark.parametrize("name,d,n,kw", GRID)
def test_new_schemes_pass_the_validator(name, d, n, kw):
    s = build(name, d, n, **kw)
    validate(s)
    for sync in ("eager", "end"):
        low = validate(lower(s, sync))
        assert sum(a.op is Op.STEP for _, _, a in low.actions()) == d
    assert s.split_backward


@pytest.mark.parametrize("d,n,target", [(8, 16, 0.065), big(16, 64, 0.039)])
def test_chimera_zb_targets(d, n, target):
    schedule, t = run("chimera-zb", d, n)
    bound = schedule_bound(schedule, UNIT)
    assert t.bubble_ratio <= target
    assert bound.bubble == pytest.approx({8: 3 / 51, 16: 7 / 199}[d])  # 5.9% and 3.5%
    acts = [r.peak_activations for r in t.ranks]
    assert max(acts) <= d and max(acts) / min(acts) <= 1.1


@pytest.mark.parametrize("d,n", [(4, 8), (8, 16), (8, 17), (8, 33), big(16, 32), big(16, 65)])
def test_chimera_zb_reaches_the_bound_with_equal_costs(d, n):
    schedule, t = run("chimera-zb", d, n)
    assert t.makespan == schedule_bound(schedule, UNIT).makespan


@pytest.mark.parametrize("d,n", [(8, 16), (8, 24), big(16, 32)])
def test_published_baselines_reach_their_bounds_with_equal_costs(d, n):
    for name in ("zb-v", "dualpipev", "dualpipe", "zb-h1"):
        schedule, t = run(name, d, n)
        assert t.makespan == pytest.approx(schedule_bound(schedule, UNIT).makespan), name


def test_zb_v_and_dualpipe_memory_as_published():
    d = 8
    assert {r.peak_activations for r in run("zb-v", d, 2 * d)[1].ranks} == {d}
    assert {r.peak_activations for r in run("dualpipe", d, 2 * d)[1].ranks} == {d + 1}
    assert {r.weights for r in run("dualpipe", d, 2 * d)[1].ranks} == {2}
    assert {r.weights for r in run("dualpipev", d, 2 * d)[1].ranks} == {1}


@pytest.mark.parametrize("cost", ["1:1:1", "1:1", "1:2:1"])
@pytest.mark.parametrize("cap", [2, 3, 5, 8])
def test_chimera_zb_honours_its_cap(cost, cap):
    _, t = run("chimera-zb", 8, 16, CostModel.parse(cost), cost=cost, cap=cap)
    assert max(r.peak_activations for r in t.ranks) <= cap


def test_chimera_zb_refuses_a_cap_below_one_per_replica():
    with pytest.raises(ScheduleError, match="cap"):
        build("chimera-zb", 8, 16, pipes=4, cap=3)


@pytest.mark.parametrize("variant", [f"{r}/{v}" for r in RULES for v in RESERVES])
def test_every_rule_plays_to_a_valid_schedule(variant):
    placement, micro_pipe = Placement.chimera(6, 2), tuple(m % 2 for m in range(9))
    programs, span = play(placement, micro_pipe, op_times("1:2:1", 6, 6), 6, variant)
    schedule = build("chimera-zb", 6, 9).with_programs(programs)
    t = simulate(validate(lower(schedule)), CostModel.unit(1, i=2, w=1))
    assert t.makespan <= span + 1e-9  # the simulator never runs later than the scheduler planned
    assert max(r.peak_activations for r in t.ranks) <= 6


def test_chimera_zb_uses_the_cost_it_is_given():
    p2p = CostModel.unit(1, i=1, w=1, p2p_time=0.5)
    timed = simulate(lower(build("chimera-zb", 8, 16, cost=p2p)), p2p).makespan
    blind = simulate(lower(build("chimera-zb", 8, 16)), p2p).makespan
    assert timed <= blind
    with pytest.raises(ScheduleError, match="cost"):
        build("chimera-zb", 4, 4, cost="fast")


def test_cli_passes_cost_and_cap_and_reports_the_bound(capsys):
    assert main(["simulate", "-s", "chimera-zb", "-D", "8", "-N", "16", "--cost", "1:1:1",
                 "--cap", "6", "--bound", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["params"]["cost"] == "1:1:1" and out["params"]["cap"] == 6
    assert max(r["peak_activations"] for r in out["ranks"]) <= 6
    assert out["bound"]["bubble"] == pytest.approx(3 / 51)
    assert out["bound"]["bubble"] <= out["bubble_ratio"]
    assert main(["simulate", "-s", "1f1b", "-D", "4", "-N", "4", "--bound"]) == 0
    assert "lower bound: makespan 14, bubble 42.9%" in capsys.readouterr().out  # = 1F1B
    with pytest.raises(SystemExit):
        main(["simulate", "-s", "1f1b", "-D", "4", "--cap", "3"])  # 1f1b takes no cap


def test_exact_refinement_never_worse_than_the_list_schedule():
    pytest.importorskip("ortools")
    from chimera.schedules.exact import refine

    placement, micro_pipe = Placement.chimera(4, 2), tuple(m % 2 for m in range(5))
    times = op_times("1:1.5:0.5", 4, 4)
    hint, span = play(placement, micro_pipe, times, 4)
    programs, exact_span, _ = refine(placement, micro_pipe, times, 4, hint, seconds=5, workers=2)
    schedule = build("chimera-zb", 4, 5).with_programs(programs)
    cost = CostModel.unit(1, i=1.5, w=0.5)
    t = simulate(validate(lower(schedule)), cost)
    assert t.makespan <= exact_span + 1e-9 <= span + 1e-9
    assert max(r.peak_activations for r in t.ranks) <= 4
    refined = build("chimera-zb", 4, 5, cost="1:1.5:0.5", exact=5)
    assert simulate(validate(lower(refined)), cost).makespan <= span + 1e-9


def test_chimera_zb_told_the_hop_never_plays_slower_than_blind_to_it():
    """Issue 36: a greedy play that sees messages arrive late filled the wait with a W and
    delayed the I arriving during it (D=8 N=16 1:2:1, hop 0.05: 76.5 told, 70.8 blind); the
    blind play, priced with the hop, is now among the candidates."""
    for hop in (0.05, 0.2, 1.0):
        cost = CostModel.unit(1, i=2, w=1, p2p_time=hop)
        told = simulate(build("chimera-zb", 8, 16, cost=cost), cost).makespan
        blind = simulate(build("chimera-zb", 8, 16, cost="1:2:1"), cost).makespan
        assert told <= blind + 1e-9
    cost = CostModel.unit(1, i=2, w=1, p2p_time=0.05)
    assert simulate(build("chimera-zb", 8, 16, cost=cost), cost).makespan == pytest.approx(70.8)
