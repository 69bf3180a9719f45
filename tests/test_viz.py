"""Text grid, PNG Gantt chart and Chrome trace of small hand-built timelines."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from chimera.ir import Action, Op, Placement, Schedule
from chimera.sim.timeline import Event, RankStats, Timeline
from chimera.viz import (
    chrome_trace, load_trace_events, render_grid, render_programs, save_gantt_png, save_trace,
)

UNIT_COST = {Op.F: 1.0, Op.B: 2.0, Op.I: 1.0, Op.W: 1.0}


def _schedule(name: str, placement: Placement, micro_pipe, programs: list[str]) -> Schedule:
    parsed = tuple(tuple(Action.parse(a) for a in line.split()) for line in programs)
    return Schedule(name, placement, tuple(micro_pipe), parsed)


def _dependency(action: Action, stages: int):
    """The action that must finish first: previous stage's F, next stage's B, or own F."""
    p, s, m = action.key
    if action.op is Op.F:
        return (Op.F, p, s - 1, m) if s > 0 else None
    return (Op.B, p, s + 1, m) if s < stages - 1 else (Op.F, p, s, m)


def _simulate(schedule: Schedule, cost=UNIT_COST, scale: float = 1.0, unit="unit") -> Timeline:
    """A tiny list scheduler (F/B only, free p2p) so the tests do not depend on sim/."""
    done: dict = {}
    free = [0.0] * schedule.ranks
    pos = [0] * schedule.ranks
    events: list[Event] = []
    while any(pos[r] < len(p) for r, p in enumerate(schedule.programs)):
        stuck = True
        for rank, program in enumerate(schedule.programs):
            while pos[rank] < len(program):
                action = program[pos[rank]]
                dep = _dependency(action, schedule.stages)
                if dep is not None and dep not in done:
                    break
                start = max(free[rank], done.get(dep, 0.0))
                free[rank] = done[(action.op,) + action.key] = start + cost[action.op] * scale
                events.append(Event(rank, action, start, free[rank]))
                pos[rank] += 1
                stuck = False
        assert not stuck, "test schedule deadlocks"
    stats = [RankStats(r, sum(e.duration for e in events if e.rank == r), 0.0, 0.0)
             for r in range(schedule.ranks)]
    return Timeline(schedule, events, max(free), stats, unit)


@pytest.fixture
def linear() -> Schedule:
    return _schedule("1f1b", Placement.linear(2), [0, 0],
                     ["p0s0F0 p0s0F1 p0s0B0 p0s0B1", "p0s1F0 p0s1B0 p0s1F1 p0s1B1"])


@pytest.fixture
def chimera4() -> Schedule:
    """Chimera D=4, N=4 (paper Fig. 3): micro 0,1 down (pipe 0), 2,3 up (pipe 1)."""
    programs = [
        "p0s0F0 p0s0F1 p1s3F2 p1s3B2 p1s3F3 p1s3B3 p0s0B0 p0s0B1",
        "p0s1F0 p1s2F2 p0s1F1 p1s2F3 p1s2B2 p0s1B0 p1s2B3 p0s1B1",
        "p1s1F2 p0s2F0 p1s1F3 p0s2F1 p0s2B0 p1s1B2 p0s2B1 p1s1B3",
        "p1s0F2 p1s0F3 p0s3F0 p0s3B0 p0s3F1 p0s3B1 p1s0B2 p1s0B3",
    ]
    return _schedule("chimera", Placement.chimera(4), [0, 0, 1, 1], programs)


def _rows(text: str) -> dict[int, str]:
    return {int(line.split()[0][1:]): line for line in text.splitlines()
            if line.startswith("P") and "|" in line}


def _cells(text: str, rank: int) -> list[str]:
    """The cells of one rank's row (cell width read from the row itself)."""
    body = _rows(text)[rank].split("|", 1)[1]
    width = max(len(tok) for tok in body.replace(">", " ").replace("<", " ").split())
    return [body[i + 1:i + 1 + width].strip() for i in range(0, len(body) - 1, width + 1)]


# -- text grid ----------------------------------------------------------------------------
def test_grid_linear_cells_and_bubbles(linear):
    text = render_grid(_simulate(linear))
    assert _cells(text, 0) == ["F0", "F1", ".", ".", "B0", "B0", ".", "B1", "B1"]
    assert _cells(text, 1) == [".", "F0", "B0", "B0", "F1", "B1", "B1", ".", "."]
    assert text.splitlines()[0].split() == ["t", "0", "5"]
    assert "legend:" in text.splitlines()[-1] and "lower=up" not in text


def test_grid_rows_align(linear, chimera4):
    for schedule in (linear, chimera4):
        rows = list(_rows(render_grid(_simulate(schedule))).values())
        assert len({len(r) for r in rows}) == 1


def test_grid_chimera_pipes_are_told_apart(chimera4):
    timeline = _simulate(chimera4)
    text = render_grid(timeline)
    assert _cells(text, 0)[:2] == ["F0", "F1"]
    assert _cells(text, 3)[:2] == ["f2", "f3"]
    assert "b2" in _cells(text, 0) and "B0" in _cells(text, 3)
    assert "lower=up pipe" in text
    busy = sum(c != "." for r in range(4) for c in _cells(text, r))
    assert busy == sum(e.duration for e in timeline.events)


def test_grid_multidigit_micro_indices_align():
    programs = [" ".join(f"p0s{s}F{m}" for m in range(12)) for s in range(2)]
    text = render_grid(_simulate(_schedule("gpipe-f", Placement.linear(2), [0] * 12, programs)))
    rows = _rows(text)
    assert len(rows[0]) == len(rows[1])
    assert _cells(text, 0)[3] == "F3" and _cells(text, 0)[11] == "F11"
    assert _cells(text, 1)[0] == "." and _cells(text, 1)[12] == "F11"


def test_grid_quantizes_seconds_and_width(linear):
    seconds = render_grid(_simulate(linear, scale=1e-3, unit="s"))
    assert _cells(seconds, 0) == _cells(render_grid(_simulate(linear)), 0)
    assert "1 column = 0.001 s" in seconds
    assert len(_cells(render_grid(_simulate(linear), width=3), 0)) == 3


def test_grid_mark(linear):
    text = render_grid(_simulate(linear), mark=Action(Op.B, 0, 1, 0))
    lines = text.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("P1"))
    assert ">B0 B0<" in lines[row]
    assert lines[row + 1].strip() == "^^ ^^"
    assert lines[row + 1].index("^") == lines[row].index(">") + 1
    assert "marked: p0s1B0 on P1" in text
    assert ">" in render_grid(_simulate(linear), mark=(0, 2)).splitlines()[1]


def test_render_programs_and_mark(chimera4):
    text = render_programs(chimera4, mark=(2, 4))
    assert _cells(text, 2) == ["f2", "F0", "f3", "F1", "B0", "b2", "B1", "b3"]
    assert ">B0<" in _rows(text)[2]
    assert "marked: p0s2B0 on P2" in text
    programs = [list(p) for p in chimera4.programs]
    programs[1].insert(0, Action(Op.RECV_F, 0, 1, 0))
    lowered = chimera4.with_programs(programs)
    marked = render_programs(lowered, mark=(1, 0))
    assert "marked: p0s1RECV_F0 on P1" in marked and ">F0<" in _rows(marked)[1]


def test_render_programs_marks_an_action_after_the_last_column(chimera4):
    from chimera.passes import lower

    lowered = lower(chimera4)
    last = len(lowered.programs[0]) - 1  # the STEP, after every compute action
    text = render_programs(lowered, mark=(0, last))
    assert "after the last compute column" in text
    assert _rows(text)[0].rstrip().endswith("<")


def test_grid_color_is_opt_in(chimera4):
    timeline = _simulate(chimera4)
    assert "\x1b[" not in render_grid(timeline)
    assert "\x1b[" in render_grid(timeline, color=True)


# -- PNG ----------------------------------------------------------------------------------
def test_gantt_png(tmp_path, chimera4):
    timeline = _simulate(chimera4)
    timeline.collectives = [(r, s, 9.0, 11.0) for r in range(4) for s in (r, 3 - r)]
    path = save_gantt_png(timeline, tmp_path / "out" / "chimera.png", title="test")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 5000


# -- Chrome trace -------------------------------------------------------------------------
def test_chrome_trace_events(linear):
    timeline = _simulate(linear)
    timeline.collectives = [(0, 0, 9.0, 10.0)]
    trace = chrome_trace(timeline)
    assert trace["displayTimeUnit"] == "ms"
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(timeline.events) + 1
    b0 = next(e for e in complete if e["name"] == "p0s0B0")
    assert (b0["ts"], b0["dur"], b0["pid"], b0["tid"], b0["cat"]) == (4000, 2000, 0, 0, "B")
    assert b0["args"] == {"pipe": 0, "stage": 0, "micro": 0}
    assert next(e for e in complete if e["cat"] == "ALLREDUCE")["tid"] == 2


def test_trace_round_trip(tmp_path, linear):
    timeline = _simulate(linear)
    timeline.events.append(Event(0, Action(Op.SEND_F, 0, 0, 1), 2.0, 2.5))
    path = save_trace(timeline, tmp_path / "t.json")
    assert json.loads(path.read_text())["traceEvents"]
    loaded = load_trace_events(path)
    assert loaded == sorted(timeline.events, key=lambda e: (e.rank, e.start, e.end))


def test_trace_seconds(tmp_path, linear):
    timeline = _simulate(linear, scale=1e-3, unit="s")
    b0 = next(e for e in chrome_trace(timeline)["traceEvents"] if e["name"] == "p0s0B0")
    assert b0["ts"] == pytest.approx(4000) and b0["dur"] == pytest.approx(2000)
    loaded = load_trace_events(save_trace(timeline, tmp_path / "s.json"))
    expected = sorted(timeline.events, key=lambda e: (e.rank, e.start))
    assert [e.action for e in loaded] == [e.action for e in expected]
    assert [e.end for e in loaded] == pytest.approx([e.end for e in expected])


def test_load_trace_rejects_non_trace(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(ValueError):
        load_trace_events(bad)


@pytest.mark.slow
def test_viz_imports_no_torch_or_matplotlib():
    code = ("import sys, chimera.viz; "
            "assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gantt_colours_a_ranks_two_v_stages_apart_and_stays_readable(tmp_path):
    """zb-v puts stages s and 2D-1-s on rank s in one pipe: the two chunks get two colours
    (and two legend entries); a timeline with a few tiny events stays within 18 x 14 in and
    no flatter than 5:1."""
    from chimera.schedules.registry import build
    from chimera.sim.engine import simulate
    from chimera.viz import gantt

    timeline = simulate(build("zb-v", 2, 4))
    keys = {(e.rank, gantt._color_key(timeline, e.action)) for e in timeline.compute_events()}
    assert keys == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert [gantt._chunk_name(timeline, k) for k in (0, 1)] == ["stages 0-1 (down)", "stages 2-3 (up)"]
    chimera = simulate(build("chimera", 4, 4))
    assert {gantt._color_key(chimera, e.action) for e in chimera.compute_events()} == {0, 1}  # pipes
    width, height = gantt._figsize(timeline)
    assert width <= 5 * height and height >= 3.4
    tiny = simulate(build("1f1b", 2, 64))
    i = next(i for i, e in enumerate(tiny.events) if e.action.op.is_compute)
    tiny.events[i] = Event(tiny.events[i].rank, tiny.events[i].action, tiny.events[i].start,
                           tiny.events[i].start + 1e-6)  # as a measured step's tiny event
    width, height = gantt._figsize(tiny)
    assert width <= min(18.0, 5 * height)
    assert save_gantt_png(timeline, tmp_path / "v.png").read_bytes()[:4] == b"\x89PNG"
