import json

import pytest

from chimera.ir import (Action, Op, Placement, Schedule, ScheduleError, finishing_op, input_stage,
                        needs, other_end, output_stage, peer_stage, recv_of, send_of)
from chimera.passes import lower
from chimera.schedules import build


@pytest.mark.parametrize("text", ["p0s1F3", "p1s0B12", "p0s2I0", "p3s7W5", "p0s1SEND_F3",
                                  "p1s2RECV_B0", "p0s3SYNC", "STEP"])
def test_action_string_round_trip(text):
    assert str(Action.parse(text)) == text


def test_action_fields():
    a = Action.parse("p1s2F7")
    assert (a.op, a.pipe, a.stage, a.micro) == (Op.F, 1, 2, 7)


@pytest.mark.parametrize("bad", ["", "F", "p0s1X3", "q0s1F3", "p0s1F-1", "p0F3"])
def test_action_parse_rejects(bad):
    with pytest.raises(ScheduleError):
        Action.parse(bad)


def test_chimera_placement_is_mirrored():
    p = Placement.chimera(4)
    assert p.table == ((0, 1, 2, 3), (3, 2, 1, 0))
    assert p.replicas(0) == (0, 3)
    assert sorted(p.held(1)) == [(0, 1), (1, 2)]


def test_chimera_q4_placement_shifts_pipes():
    p = Placement.chimera(8, pipes=4)
    assert p.pipes == 4
    for rank in range(8):  # every rank holds Q distinct stages
        stages = [s for _, s in p.held(rank)]
        assert len(stages) == 4 == len(set(stages))
    assert p.table[2] == tuple((s + 4) % 8 for s in range(8))


@pytest.mark.parametrize("d,q", [(3, 2), (4, 3), (6, 4), (2, 4)])
def test_chimera_placement_rejects(d, q):
    with pytest.raises(ScheduleError, match="even"):
        Placement.chimera(d, q)


def test_loop_and_v_placements():
    assert Placement.loop(2, 2).table == ((0, 1, 0, 1),)
    assert Placement.v(3).table == ((0, 1, 2, 2, 1, 0),)


@pytest.mark.parametrize("name,kw", [("chimera", {}), ("1f1b", {}), ("zb-h1", {}),
                                     ("chimera", {"strategy": "halving"})])
def test_schedule_json_round_trip(name, kw):
    s = lower(build(name, 4, 8, **kw))
    back = Schedule.loads(json.dumps(json.loads(s.dumps())))
    assert back == s
    assert back.micro_scale == s.micro_scale and back.params == s.params


def test_schedule_json_rejects_garbage():
    with pytest.raises(ScheduleError):
        Schedule.from_json({"name": "x"})


def test_schedule_checks_program_count():
    with pytest.raises(ScheduleError, match="rank programs"):
        Schedule("x", Placement.linear(2), (0,), ((),))


def test_the_dependency_rule():
    a = Action.parse
    assert needs(a("p0s0F1"), 3, False) == ()
    assert needs(a("p1s2F1"), 3, False) == (a("p1s1F1"),)
    assert needs(a("p0s1B2"), 3, False) == (a("p0s1F2"), a("p0s2B2"))
    assert needs(a("p0s2B2"), 3, False) == (a("p0s2F2"),)
    assert needs(a("p0s1I2"), 3, True) == (a("p0s1F2"), a("p0s2I2"))
    assert needs(a("p0s1W2"), 3, True) == (a("p0s1I2"),)
    assert needs(a("p0s1SYNC"), 3, True) == ()
    assert [input_stage(a(t), 3) for t in ("p0s0F0", "p0s1F0", "p0s1B0", "p0s2B0", "p0s1W0")] \
        == [None, 0, 2, None, None]
    assert [output_stage(a(t), 3) for t in ("p0s2F0", "p0s1F0", "p0s1I0", "p0s0B0", "p0s1W0")] \
        == [None, 2, 0, None, None]
    assert finishing_op(True) is Op.W and finishing_op(False) is Op.B


def test_messages_follow_the_dependency_rule():
    a = Action.parse
    computes = [a(t) for t in ("p0s1F2", "p1s0B2", "p0s1I2")]
    assert [str(recv_of(c)) for c in computes] == ["p0s1RECV_F2", "p1s0RECV_B2", "p0s1RECV_B2"]
    assert [str(send_of(c)) for c in computes] == ["p0s1SEND_F2", "p1s0SEND_B2", "p0s1SEND_B2"]
    pairs = [("p0s1SEND_F2", "p0s2RECV_F2"), ("p0s1SEND_B2", "p0s0RECV_B2")]
    for send, recv in pairs:
        assert other_end(a(send), 3) == a(recv) and other_end(a(recv), 3) == a(send)
        assert peer_stage(a(send), 3) == a(recv).stage and peer_stage(a(recv), 3) == a(send).stage
    ends = ("p0s0RECV_F1", "p0s2RECV_B1", "p0s2SEND_F1", "p0s0SEND_B1")  # past the pipe's ends
    assert [other_end(a(t), 3) for t in ends] == [peer_stage(a(t), 3) for t in ends] == [None] * 4
