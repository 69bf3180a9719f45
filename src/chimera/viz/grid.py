"""Text pictures of schedules: one row per rank, one column per time slot (as in the paper).

Conventions (stated once, printed as a legend under every grid):

- A cell names the compute action occupying that slot: op letter then micro-batch,
  ``F3`` forward, ``B3`` backward, ``I3`` input-gradient half, ``W3`` weight-gradient half.
- **Upper case = down pipes** (pipe 0 and every even pipe), **lower case = up pipes**
  (odd pipes): in a Chimera grid ``F0`` and ``f2`` are micro-batches 0 and 2 of the down and
  the up pipeline. A two-unit backward fills two cells, ``B3 B3``.
- ``.`` is a bubble. Cells are padded to the widest micro index so columns always align.
- A marked action is wrapped as ``>B3<`` (the separators turn into arrows, so nothing
  shifts) with a caret line under its row and a note naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from chimera.ir import Action, Op, Schedule
from chimera.sim.timeline import Event, Timeline

DEFAULT_WIDTH = 120  # most columns a timeline grid uses before it is quantized coarser
_ANSI_PIPE = ("36", "33", "32", "35", "34", "31", "96", "93")
_OP_NAMES = {Op.F: "forward", Op.B: "backward", Op.I: "input-grad", Op.W: "weight-grad"}


@dataclass
class _Grid:
    """What a picture needs: per rank, the action in each column (None: bubble)."""

    cells: list[list[Action | None]]
    ticks: list[str]  # header label of each column ("" where none is printed)
    scale: str  # what one column means, for the legend
    mark: tuple[int, list[int], str] | None = None  # (rank, columns, note)


# -- public API ---------------------------------------------------------------------------
def render_grid(timeline: Timeline, width: int | None = None, mark=None,
                color: bool = False) -> str:
    """Rank-by-time picture of a timeline's compute events.

    ``mark`` is an Action, an Event, or ``(rank, i)`` (the i-th compute event of that rank).
    Unit-time timelines get one column per unit; otherwise (or when the makespan exceeds
    ``width`` columns) a column is the shortest compute event, widened to fit ``width``.
    """
    quantum, ncols = _quantum(timeline, width or DEFAULT_WIDTH)
    cells = _timeline_cells(timeline, quantum, ncols)
    ticks = _ticks(ncols, lambda c: f"{c * quantum:.4g}")
    grid = _Grid(cells, ticks, f"1 column = {quantum:.4g} {timeline.unit}")
    if mark is not None:
        grid.mark = _timeline_mark(timeline, cells, quantum, mark)
    return _draw(grid, color)


def render_programs(schedule: Schedule, mark=None, color: bool = False) -> str:
    """Grid from program order alone: column i is the i-th compute action of each rank.

    ``mark`` is an Action or ``(rank, index)`` with ``index`` into ``schedule.programs[rank]``
    (lowered programs included: a non-compute action is marked at the next compute column).
    """
    programs = schedule.compute_programs()
    ncols = max((len(p) for p in programs), default=0)
    cells = [list(p) + [None] * (ncols - len(p)) for p in programs]
    grid = _Grid(cells, _ticks(ncols, str), "1 column = 1 program slot (no timing)")
    if mark is not None:
        grid.mark = _program_mark(schedule, mark, ncols)
    return _draw(grid, color)


def cell_label(action: Action) -> str:
    """``F3`` for a down-pipe forward of micro-batch 3, ``f3`` for an up-pipe one."""
    letter = action.op.value if action.pipe % 2 == 0 else action.op.value.lower()
    return f"{letter}{action.micro}"


# -- building the cells -------------------------------------------------------------------
def _quantum(timeline: Timeline, width: int) -> tuple[float, int]:
    """Length of one column and the number of columns."""
    durations = [e.duration for e in timeline.compute_events() if e.duration > 0]
    shortest = min(durations, default=1.0)
    quantum = min(1.0, shortest) if timeline.unit == "unit" else shortest
    ncols = max(1, math.ceil(timeline.makespan / quantum - 1e-9))
    if ncols > width:  # coarsen by a whole factor so columns stay on event boundaries
        quantum *= math.ceil(ncols / width)
        ncols = max(1, math.ceil(timeline.makespan / quantum - 1e-9))
    return quantum, ncols


def _span(event: Event, quantum: float, ncols: int) -> range:
    """Columns an event covers: rounded boundaries, at least one column."""
    first = min(ncols - 1, math.floor(event.start / quantum + 0.5))
    last = max(first + 1, math.floor(event.end / quantum + 0.5))
    return range(first, min(last, ncols))


def _timeline_cells(timeline: Timeline, quantum: float, ncols: int) -> list[list[Action | None]]:
    cells: list[list[Action | None]] = [[None] * ncols for _ in range(timeline.schedule.ranks)]
    for event in sorted(timeline.compute_events(), key=lambda e: e.start):
        for col in _span(event, quantum, ncols):
            cells[event.rank][col] = event.action
    return cells


def _ticks(ncols: int, label) -> list[str]:
    every = 5 if ncols <= 60 else 10
    return [label(c) if c % every == 0 else "" for c in range(ncols)]


# -- marks --------------------------------------------------------------------------------
def _timeline_mark(timeline: Timeline, cells, quantum: float, mark) -> tuple[int, list[int], str]:
    event = _find_event(timeline, mark)
    cols = [c for c, a in enumerate(cells[event.rank]) if a == event.action]
    if not cols:  # hidden under a later event after quantization
        cols = [min(len(cells[event.rank]) - 1, math.floor(event.start / quantum))]
    note = f"marked: {event.action} on P{event.rank} at {event.start:.4g}-{event.end:.4g}"
    return event.rank, cols, note


def _find_event(timeline: Timeline, mark) -> Event:
    if isinstance(mark, Event):
        return mark
    if isinstance(mark, Action):
        found = [e for e in timeline.events if e.action == mark]
        if not found:
            raise ValueError(f"action {mark} is not in the timeline")
        return found[0]
    rank, index = mark
    events = sorted(timeline.compute_events(rank), key=lambda e: e.start)
    if not 0 <= index < len(events):
        raise ValueError(f"rank {rank} has no compute event #{index} ({len(events)} events)")
    return events[index]


def _program_mark(schedule: Schedule, mark, ncols: int) -> tuple[int, list[int], str]:
    if isinstance(mark, Action):
        where = [(r, i) for r, i, a in schedule.actions() if a == mark]
        if not where:
            raise ValueError(f"action {mark} is in no rank's program")
        mark = where[0]
    rank, index = mark
    program = schedule.programs[rank]
    if not 0 <= index < len(program):
        raise ValueError(f"rank {rank} has no action #{index} ({len(program)} actions)")
    col = sum(1 for a in program[:index] if a.op.is_compute)
    action = program[index]
    note = f"marked: {action} on P{rank}, action #{index} of its program"
    if not action.op.is_compute and col >= ncols:  # e.g. the STEP: after every column
        note += f" (a {action.op.value}, after the last compute column)"
        return rank, ([ncols - 1] if ncols else []), note
    if not action.op.is_compute:
        note += f" (a {action.op.value}, shown before compute column {col})"
    return rank, [col], note


# -- drawing ------------------------------------------------------------------------------
def _draw(grid: _Grid, color: bool) -> str:
    width = max([len(cell_label(a)) for row in grid.cells for a in row if a] + [2])
    label_w = len(f"P{len(grid.cells) - 1}") + 1
    lines = [_header(grid.ticks, width, label_w)]
    for rank, row in enumerate(grid.cells):
        cols = grid.mark[1] if grid.mark and grid.mark[0] == rank else []
        lines.append(_row(f"P{rank}".ljust(label_w), row, width, cols, color))
        if cols:
            lines.append(_caret_line(label_w, width, cols, len(row)))
    if grid.mark:
        lines.append(grid.mark[2])
    lines.append(_legend(grid))
    return "\n".join(lines)


def _header(ticks: list[str], width: int, label_w: int) -> str:
    line = [" "] * (label_w + 1 + len(ticks) * (width + 1) + 1)
    line[0] = "t"
    for col, tick in enumerate(ticks):
        pos = label_w + 2 + col * (width + 1)
        for i, ch in enumerate(tick):
            if pos + i < len(line):
                line[pos + i] = ch
    return "".join(line).rstrip()


def _row(label: str, row: list[Action | None], width: int, marked: list[int],
         color: bool) -> str:
    seps = [" "] * (len(row) + 1)
    if marked:
        seps[min(marked)], seps[max(marked) + 1] = ">", "<"
    body = "".join(seps[c] + _cell(a, width, color) for c, a in enumerate(row))
    return f"{label}|{body}{seps[-1]}"


def _cell(action: Action | None, width: int, color: bool) -> str:
    text = (cell_label(action) if action else ".").ljust(width)
    if not color:
        return text
    if action is None:
        return f"\x1b[2m{text}\x1b[0m"
    style = {Op.F: "", Op.B: "1;7;", Op.I: "7;", Op.W: "4;"}[action.op]
    return f"\x1b[{style}{_ANSI_PIPE[action.pipe % len(_ANSI_PIPE)]}m{text}\x1b[0m"


def _caret_line(label_w: int, width: int, cols: list[int], ncols: int) -> str:
    line = [" "] * (label_w + 1 + ncols * (width + 1) + 1)
    for col in cols:
        start = label_w + 2 + col * (width + 1)
        line[start:start + width] = "^" * width
    return "".join(line).rstrip()


def _legend(grid: _Grid) -> str:
    actions = {a for row in grid.cells for a in row if a}
    ops = [op for op in (Op.F, Op.B, Op.I, Op.W) if any(a.op is op for a in actions)]
    parts = [" ".join(f"{op.value}3={_OP_NAMES[op]}" for op in ops or [Op.F, Op.B])
             + " of micro-batch 3"]
    if any(a.pipe % 2 for a in actions):
        parts.append("UPPER=down pipe (even), lower=up pipe (odd)")
    parts += [".=bubble", grid.scale]
    return "legend: " + "; ".join(parts)
