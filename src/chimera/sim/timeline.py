"""What a simulation (or a measured run) produced: timed actions per rank, plus metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from chimera.ir import Action, Schedule


@dataclass(frozen=True)
class Event:
    """One action executed on one rank from ``start`` to ``end`` (simulated units or seconds)."""

    rank: int
    action: Action
    start: float
    end: float
    cpu: float | None = None  # measured thread CPU seconds, when the event comes from a real run

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class RankStats:
    rank: int
    busy: float  # compute time (F, B, I, W)
    peak_activations: float  # in Ma (one micro-batch on one D-th of the model)
    weights: float  # in Mθ (one D-th of the model's weights)


@dataclass
class Timeline:
    """Events of one iteration. ``unit`` names the time unit ("unit" or "s")."""

    schedule: Schedule
    events: list[Event]
    makespan: float
    ranks: list[RankStats] = field(default_factory=list)
    unit: str = "unit"
    # allreduce intervals per rank: (rank, stage, start, end); drawn as a separate lane
    collectives: list[tuple[int, int, float, float]] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # e.g. the measured step time; kept in traces

    @property
    def busy(self) -> float:
        return sum(r.busy for r in self.ranks)

    @property
    def bubble_ratio(self) -> float:
        """1 - busy / (ranks * makespan), the paper's definition."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - self.busy / (self.schedule.ranks * self.makespan)

    def compute_events(self, rank: int | None = None) -> list[Event]:
        return [e for e in self.events
                if e.action.op.is_compute and (rank is None or e.rank == rank)]
