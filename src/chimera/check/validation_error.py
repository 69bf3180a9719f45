"""The schedule error that shows the schedule it is about (no torch): the rank-by-slot grid
with the offending action marked, so a failure explains itself (``validate``, ``rendezvous``)."""

from __future__ import annotations

from chimera.ir import Schedule, ScheduleError
from chimera.viz.grid import render_programs


class ValidationError(ScheduleError):
    """``problem`` at action ``index`` of ``rank`` (when known); the message ends with the grid."""

    def __init__(self, problem: str, schedule: Schedule, rank: int | None = None,
                 index: int | None = None):
        self.problem, self.rank, self.index = problem, rank, index
        mark = schedule.programs[rank][index] if rank is not None and index is not None else None
        picture = render_programs(schedule, mark=mark)
        super().__init__(f"{problem}\n{picture}" if picture else problem)
