"""Simulator: hand-checked timelines, costs, communication and allreduce overlap."""

import pytest

from chimera.ir import Op, ScheduleError
from chimera.passes import lower
from chimera.schedules import build
from chimera.sim import CostModel, Deadlock, simulate


def starts(t, rank):
    return [(str(e.action), e.start, e.end) for e in t.compute_events(rank)]


def test_1f1b_two_stages_by_hand():
    t = simulate(lower(build("1f1b", 2, 2)), CostModel.unit(1, 2))
    assert starts(t, 0) == [("p0s0F0", 0, 1), ("p0s0F1", 1, 2), ("p0s0B0", 4, 6), ("p0s0B1", 7, 9)]
    assert starts(t, 1) == [("p0s1F0", 1, 2), ("p0s1B0", 2, 4), ("p0s1F1", 4, 5), ("p0s1B1", 5, 7)]
    assert t.makespan == 9
    assert t.bubble_ratio == pytest.approx(1 - 12 / 18)


def test_p2p_hop_delays_the_consumer():
    t = simulate(lower(build("gpipe", 2, 1)), CostModel.unit(1, 1, p2p_time=0.5))
    assert starts(t, 1)[0] == ("p0s1F0", 1.5, 2.5)
    assert t.makespan == 1 + 0.5 + 1 + 1 + 0.5 + 1


def test_lowered_and_unlowered_agree():
    s = build("chimera", 8, 16)
    cost = CostModel.unit(1, 2, p2p_time=0.25)
    assert simulate(s, cost).makespan == simulate(lower(s), cost).makespan


def test_eager_sync_overlaps_allreduce_end_sync_does_not():
    s = build("chimera", 8, 8)
    cost = CostModel.unit(1, 1, allreduce_time=3.0)
    base = simulate(lower(s), CostModel.unit(1, 1)).makespan
    eager = simulate(lower(s, "eager"), cost).makespan
    end = simulate(lower(s, "end"), cost).makespan
    assert end == base + 2 * 3.0  # each rank holds two stages: two allreduces in a row
    assert base < eager < end  # outer stages finish early and hide their allreduce
    blocking = simulate(lower(s, "eager"), CostModel.unit(1, 1, allreduce_time=3.0,
                                                       overlap_allreduce=False)).makespan
    assert blocking >= eager


def test_allreduce_needs_replicas_or_data_parallel():
    s = lower(build("1f1b", 4, 4))
    base = simulate(s, CostModel.unit(1, 1, allreduce_time=5.0)).makespan
    assert base == simulate(s).makespan  # one replica per stage, W=1: no allreduce
    dp = simulate(s, CostModel.unit(1, 1, allreduce_time=5.0, data_parallel=2))
    assert dp.makespan > base and dp.collectives


def test_halving_scales_times():
    t = simulate(build("chimera", 4, 4, strategy="halving"), CostModel.unit(1, 2))
    assert {e.duration for e in t.compute_events() if e.action.op is Op.F} == {0.5}


def test_interleaved_virtual_stage_is_smaller():
    t = simulate(build("interleaved", 2, 2, chunks=2))
    assert {e.duration for e in t.compute_events()} == {0.5}


def test_deadlock_is_reported():
    from chimera.ir import Action
    s = build("gpipe", 2, 1)
    bad = s.with_programs([[Action.parse("p0s0B0"), Action.parse("p0s0F0")], list(s.programs[1])])
    with pytest.raises(Deadlock):
        simulate(bad)


@pytest.mark.parametrize("text", ["1", "1:0", "a:b", "1:2:3:4", "-1:2", "nan:1"])
def test_cost_parse_rejects(text):
    with pytest.raises(ScheduleError):
        CostModel.parse(text)


def test_cost_parse_split():
    c = CostModel.parse("1:1:1")
    assert (c.f, c.b, c.i, c.w) == ((1.0,), (2.0,), (1.0,), (1.0,))


def test_op_times_is_the_cost_model_priced_per_stage():
    from chimera.ir import COMPUTE_OPS
    from chimera.sim import Link

    cost = CostModel(f=(1.0, 1.5, 0.7, 1.2), b=(2.0, 2.5, 1.5, 2.2), act_bytes=(4.0, 3.0, 2.0, 1.0),
                     p2p=Link(0.1, 10.0))
    t = cost.op_times(4, 4, scale=0.5)
    for op in COMPUTE_OPS:
        assert [t.of(op, s) for s in range(4)] == [cost.compute(op, s, 4, 4, 0.5) for s in range(4)]
    assert t.hop == tuple(cost.hop(s, 4, 0.5) for s in range(4)) and t.hop[0] == pytest.approx(0.3)
    # interleaved: one unit value is a D-th of the model, so each of 2D stages takes half
    assert CostModel.unit(1, 2).op_times(8, 4).b == (1.0,) * 8


def test_a_cost_string_and_its_cost_model_shape_chimera_zb_alike():
    from chimera.schedules.chimera_zb import op_times

    model = CostModel.unit(1, i=2, w=1)
    text, priced = op_times("1:2:1", 4, 4), model.op_times(4, 4)
    assert (text.f, text.b, text.i, text.w) == (priced.f, priced.b, priced.i, priced.w)
    assert build("chimera-zb", 4, 8, cost="1:2:1").programs == build("chimera-zb", 4, 8, cost=model).programs


@pytest.mark.parametrize("name,overlap", [("1f1b", True), ("chimera", True), ("chimera", False)])
def test_the_optimizer_step_ends_the_iteration_once_per_replica_held(name, overlap):
    """Each rank's STEP runs one optimizer update per replica it holds after its allreduces:
    Chimera (two replicas a rank) pays twice what 1F1B pays, sharding over a stage's two
    replicas halves it for the price of an all-gather, and the optimizer's time counts as
    work, not as a bubble."""
    s = lower(build(name, 4, 8))
    base = dict(f=(1.0,), b=(2.0,), allreduce_time=0.5, overlap_allreduce=overlap)
    plain = simulate(s, CostModel(**base))
    step = simulate(s, CostModel(**base, optimizer=(0.75,)))
    sharded = simulate(s, CostModel(**base, optimizer=(0.75,), shard_optimizer=True))
    replicas = 2 if name == "chimera" else 1
    assert step.makespan == pytest.approx(plain.makespan + 0.75 * replicas)
    group = 2 if name == "chimera" else 1  # 1F1B at W=1: no replica to shard over
    gather = 0.5 / 2 if group > 1 else 0.0  # half an allreduce, before the next first forward
    # the reduce-scatter is the allreduce's other half: the last one ends that much sooner
    # (overlapped), or each of the rank's (blocking its stream)
    saved = gather * (1 if overlap else replicas)
    assert sharded.makespan == pytest.approx(plain.makespan + 0.75 * replicas / group + gather
                                             - saved)
    for a, b in zip(plain.ranks, step.ranks):
        assert b.busy == pytest.approx(a.busy + 0.75 * replicas)
    steps = [e for e in step.events if e.action.op is Op.STEP]
    assert len(steps) == 4 and all(e.end - e.start >= 0.75 * replicas - 1e-12 for e in steps)


def test_a_whole_backward_frees_in_a_split_schedule():
    """torch's DualPipeV runs B where it overlaps a forward and I/W elsewhere: B frees the
    micro-batch's activation as W does (else the peak counts it forever)."""
    from chimera.ir import Action, Op, Placement, Schedule

    prog = (Action(Op.F, 0, 0, 0), Action(Op.B, 0, 0, 0), Action(Op.F, 0, 0, 1),
            Action(Op.I, 0, 0, 1), Action(Op.W, 0, 0, 1))
    t = simulate(Schedule("mixed", Placement.linear(1), (0, 0), (prog,)))
    assert t.ranks[0].peak_activations == 1.0


def test_a_mixed_whole_and_split_backward_validates_lowers_and_syncs_after_its_last_gradient():
    """torch's DualPipeV order (B where it overlaps a forward, I/W elsewhere) passes the
    validator, as the engine runs it; the eager SYNC of a stage follows its last gradient
    action whichever it is (issue 36)."""
    from chimera.check.validate import validate
    from chimera.ir import Action, Op, Placement, Schedule
    from chimera.passes import lower

    F, B, I, W = ((lambda op: (lambda s, m: Action(op, 0, s, m)))(op) for op in (Op.F, Op.B, Op.I, Op.W))
    progs = ((F(0, 0), F(0, 1), I(0, 0), W(0, 0), B(0, 1)),
             (F(1, 0), I(1, 0), F(1, 1), B(1, 1), W(1, 0)))
    s = Schedule("mixed", Placement.linear(2), (0, 0), progs)
    validate(s)
    lowered = lower(s)
    validate(lowered)
    for rank, last in ((0, B(0, 1)), (1, W(1, 0))):
        prog = [a for a in lowered.programs[rank] if a.op is not Op.SEND_B]
        assert prog[prog.index(last) + 1].op is Op.SYNC
    assert simulate(lowered).makespan > 0
    with pytest.raises(ScheduleError, match="appears 0 times"):  # B or I+W, never half of each
        validate(Schedule("bad", Placement.linear(2), (0, 0),
                          ((F(0, 0), F(0, 1), I(0, 0), W(0, 0), B(0, 1)),
                           (F(1, 0), I(1, 0), F(1, 1), B(1, 1)))))


def test_i_frees_what_w_does_not_need():
    """Activation memory from F to W: I frees ``1 - w_keeps`` of a micro-batch (issue 36)."""
    from chimera.ir import Action, Op, Placement, Schedule

    prog = (Action(Op.F, 0, 0, 0), Action(Op.I, 0, 0, 0), Action(Op.F, 0, 0, 1),
            Action(Op.W, 0, 0, 0), Action(Op.I, 0, 0, 1), Action(Op.W, 0, 0, 1))
    s = Schedule("split", Placement.linear(1), (0, 0), (prog,))
    assert simulate(s).ranks[0].peak_activations == 2.0  # default: the graph kept whole for W
    assert simulate(s, CostModel.unit(w_keeps=0.4)).ranks[0].peak_activations == pytest.approx(1.4)
    assert simulate(s, CostModel.unit(w_keeps=0.0)).ranks[0].peak_activations == 1.0
    with pytest.raises(ScheduleError, match="w_keeps"):
        CostModel.unit(w_keeps=1.5)


@pytest.mark.parametrize("name, ranks_bytes", [("1f1b", 1.0), ("zb-v", 1.0), ("interleaved", 1.0),
                                               ("chimera", 2.0)])
def test_allreduce_is_priced_by_the_bytes_a_rank_holds(name, ranks_bytes):
    """``reduce`` (the CLI's --allreduce) is a time per D-th of the model's gradients: a V or
    interleaved stage (half a D-th) pays half, a rank pays for what it holds in all, so V and
    interleaved ranks pay once and Chimera's, two replicas, twice (issue 36; it was one
    stage's time per stage whatever its size)."""
    s = lower(build(name, 4, 8), "end")  # every collective after the compute: its sum shows
    plain = simulate(s, CostModel.unit(1, 2, data_parallel=2))
    priced = simulate(s, CostModel.unit(1, 2, reduce=(3.0,), data_parallel=2))
    per_rank = {}
    for rank, _, start, end in priced.collectives:
        per_rank[rank] = per_rank.get(rank, 0.0) + end - start
    assert len(per_rank) == 4 and sorted(per_rank.values()) == pytest.approx([3.0 * ranks_bytes] * 4)
    assert priced.makespan >= plain.makespan + 3.0 * ranks_bytes - 1e-9


def test_cli_w_keeps_lowers_the_simulated_peak_of_a_split_backward(capsys):
    import json

    from chimera.cli import main

    peaks = []
    for share in ("1", "0.4"):
        assert main(["simulate", "-s", "zb-h1", "-D", "4", "-N", "8", "--cost", "1:1:1",
                     "--w-keeps", share, "--json"]) == 0
        peaks.append([r["peak_activations"] for r in json.loads(capsys.readouterr().out)["ranks"]])
    assert peaks[0][0] == 4.0 and all(b < a for a, b in zip(peaks[0][1:], peaks[1][1:]))
