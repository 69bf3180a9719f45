"""Trace replay (no torch): the step a real run recorded, simulated with the costs measured in it.

:func:`replay` reads a trace of a real step (``chimera train --trace``; ``chimera simulate
--from-trace``) and prices its schedule with per (op, stage) median compute times, the p2p
latency of the receives that waited and the allreduce time the STEP waited for (or, given a
profile, the profile's links). With ``clock="cpu"`` compute is priced by thread CPU time
instead of wall time: what the step would take with one dedicated core (device) per rank when
the run shared fewer cores.

Every cost a replay uses is named in :attr:`Replay.sources`, so a prediction can be checked.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

from chimera.ir import COMPUTE_OPS, Op, OpTimes, Schedule, ScheduleError, other_end
from chimera.sim.cost import CostModel
from chimera.sim.engine import simulate
from chimera.sim.profile import Profile, cost_from_profile, nonnegative_number
from chimera.sim.timeline import Event, Timeline
from chimera.sim.trace import load_trace

CLOCKS = ("wall", "cpu")
_WAITED_S = 50e-6  # a receive whose wall time exceeds its CPU time by this much waited


@dataclass
class Replay:
    schedule: Schedule
    cost: CostModel
    predicted: Timeline
    measured_makespan: float
    measured_step_s: float | None
    clock: str
    sources: dict = field(default_factory=dict)

    @property
    def outside_s(self) -> float | None:
        """Measured time of the step outside the schedule (optimizer, clipping, loss sum)."""
        if self.measured_step_s is None:
            return None
        return max(0.0, self.measured_step_s - self.measured_makespan)

    @property
    def predicted_step_s(self) -> float | None:
        extra = self.outside_s
        return None if extra is None else self.predicted.makespan + extra

    def to_json(self) -> dict:
        c = self.cost
        return {"schedule": self.schedule.name, "stages": self.schedule.ranks,
                "micro_batches": self.schedule.micro_batches, "clock": self.clock,
                "predicted_makespan_s": self.predicted.makespan,
                "measured_makespan_s": self.measured_makespan,
                "predicted_step_s": self.predicted_step_s, "measured_step_s": self.measured_step_s,
                "outside_schedule_s": self.outside_s, "bubble_ratio": self.predicted.bubble_ratio,
                "cost": {"f": c.f, "b": c.b, "i": c.i, "w": c.w, "p2p_s": c.p2p_time,
                         "allreduce_s": c.allreduce_time}, "sources": self.sources}


def replay(path: str, clock: str = "wall", profile: Profile | None = None) -> Replay:
    """Replay the step recorded in trace ``path`` with the costs measured in it."""
    if clock not in CLOCKS:
        raise ScheduleError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
    try:
        schedule, events, other = load_trace(path)
    except (OSError, KeyError, TypeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise ScheduleError(f"cannot read trace {path!r}: {exc}") from None
    if schedule is None:
        raise ScheduleError(f"{path}: the trace does not carry its schedule; record it again "
                            "(chimera train --trace FILE)")
    step_s = other.get("step_s")
    if step_s is not None and not nonnegative_number(step_s):
        raise ScheduleError(f"{path}: otherData.step_s must be a finite number >= 0, got {step_s!r}")
    if not events or not all(math.isfinite(e.start) and math.isfinite(e.end) for e in events):
        raise ScheduleError(f"{path}: the trace's events must have finite times")
    cost, sources = cost_from_trace(schedule, events, other, clock, profile)
    measured = max(e.end for e in events) - min(e.start for e in events)
    return Replay(schedule, cost, simulate(schedule, cost), measured, step_s, clock, sources)


def cost_from_trace(schedule: Schedule, events: list[Event], other: dict, clock: str = "wall",
                    profile: Profile | None = None) -> tuple[CostModel, dict]:
    """The cost model measured in a trace, and where each of its numbers came from."""
    per_rank = _programs(schedule, events)
    t = _compute_costs(schedule, per_rank, clock)
    times = {"f": t.f, "b": t.b, "i": t.i, "w": t.w}
    sources = {"compute": f"median per (op, stage) of {clock} time, with the receives', sends', "
                          f"syncs' {'CPU' if clock == 'cpu' else 'wall'} time folded in"}
    aligned = other.get("aligned", True)
    if profile is not None:  # the profile's links, bytes and width; the trace's compute
        base = cost_from_profile(profile, schedule, data_parallel=int(other.get("data_parallel", 1)))
        sources["p2p"] = sources["allreduce"] = "alpha-beta links of the profile"
        return replace(base, **times), sources
    hop, sources["p2p"] = _p2p_latency(per_rank, aligned, schedule.stages)
    reduce_s, sources["allreduce"] = _allreduce_time(schedule, per_rank, other, aligned)
    return CostModel(**times, p2p_time=hop, allreduce_time=reduce_s), sources


def _programs(schedule: Schedule, events: list[Event]) -> list[list[Event]]:
    """Each rank's events in program order, checked against the schedule."""
    out = []
    for rank, prog in enumerate(schedule.programs):
        mine = sorted((e for e in events if e.rank == rank), key=lambda e: (e.start, e.end))
        if [e.action for e in mine] != list(prog):
            raise ScheduleError(f"trace events of rank {rank} do not follow the schedule it carries "
                                f"({len(mine)} events for {len(prog)} actions)")
        out.append(mine)
    return out


def _compute_costs(schedule: Schedule, per_rank: list[list[Event]], clock: str) -> OpTimes:
    """f/b/i/w per stage: medians of each compute action's time plus what is folded into it."""
    samples: dict[tuple[Op, int], list[float]] = {}
    for prog in per_rank:
        for (op, stage), cost in _folded(prog, clock):
            samples.setdefault((op, stage), []).append(cost)
    table = {op: tuple(statistics.median(samples[(op, s)]) if (op, s) in samples else 0.0
                       for s in range(schedule.stages)) for op in COMPUTE_OPS}
    present = {op for op, _ in samples}
    if Op.B not in present and {Op.I, Op.W} <= present:
        table[Op.B] = tuple(x + y for x, y in zip(table[Op.I], table[Op.W]))
    if not {Op.I, Op.W} <= present:
        table[Op.I] = table[Op.W] = tuple(x / 2 for x in table[Op.B])
    return OpTimes(table[Op.F], table[Op.B], table[Op.I], table[Op.W])


def _own(e: Event, clock: str) -> float:
    if e.action.op in (Op.RECV_F, Op.RECV_B):  # only its work: the wait is the simulator's
        return e.cpu or 0.0
    if clock == "cpu" and e.cpu is not None:
        return e.cpu
    return e.end - e.start


def _folded(prog: list[Event], clock: str):
    """(op, stage), cost for each compute action: its own time, the receives before it, the
    sends and syncs after it and, on the wall clock, the gaps between them (dispatch)."""
    pending, last, prev_end = 0.0, None, None
    out: list[list] = []
    for e in prog:
        gap = 0.0 if prev_end is None or clock == "cpu" else max(0.0, e.start - prev_end)
        prev_end = e.end
        op = e.action.op
        if op.is_compute:
            last = [(op, e.action.stage), pending + gap + _own(e, clock)]
            out.append(last)
            pending = 0.0
        elif op in (Op.RECV_F, Op.RECV_B) or last is None:
            pending += gap + _own(e, clock)
        elif op is Op.STEP:
            last[1] += gap
        else:  # SEND, SYNC: issued right after the action that produced their data
            last[1] += gap + _own(e, clock)
    return [tuple(x) for x in out]


def _sent(per_rank: list[list[Event]]) -> dict:
    return {e.action: e for prog in per_rank for e in prog if e.action.op in (Op.SEND_F, Op.SEND_B)}


def _p2p_latency(per_rank: list[list[Event]], aligned: bool, stages: int) -> tuple[float, str]:
    """Median of (receive end - send end) over the receives that waited for their message."""
    if not aligned:
        return 0.0, "none: the ranks' clocks of this trace are not aligned (p2p taken as free)"
    sent, lat = _sent(per_rank), []
    for prog in per_rank:
        for e in prog:
            a = e.action
            if a.op not in (Op.RECV_F, Op.RECV_B):
                continue
            send = other_end(a, stages)
            waited = (e.end - e.start) - (e.cpu or 0.0) > (_WAITED_S if e.cpu is not None else 0.0)
            if send in sent and waited:
                lat.append(max(0.0, e.end - sent[send].end))
    if not lat:
        return 0.0, "none: no receive waited for its message (p2p hidden)"
    return statistics.median(lat), f"median latency of the {len(lat)} receives that waited"


def _allreduce_time(schedule: Schedule, per_rank: list[list[Event]], other: dict,
                    aligned: bool) -> tuple[float, str]:
    """Per-stage allreduce time: from the trace's allreduce lane if it has one (simulated
    traces), else how long each rank's STEP still waited after its last stage was ready."""
    lanes = other.get("collectives") or []
    if lanes:
        return statistics.median(end - start for _, _, start, end in lanes), \
            f"median of the trace's {len(lanes)} allreduce intervals"
    if not aligned:
        return 0.0, "none: the ranks' clocks of this trace are not aligned"
    shared = {s for s in range(schedule.stages) if len(set(schedule.placement.replicas(s))) > 1}
    ready: dict[int, float] = {}
    for prog in per_rank:
        for e in prog:
            if e.action.op is Op.SYNC and e.action.stage in shared:
                ready[e.action.stage] = max(ready.get(e.action.stage, 0.0), e.end)
    waits = []
    for rank, prog in enumerate(per_rank):
        mine = [ready[s] for _, s in schedule.placement.held(rank) if s in ready]
        step = prog[-1]
        if mine and step.action.op is Op.STEP:
            waits.append(max(0.0, step.end - max(step.start, max(mine))))
    if not waits:
        return 0.0, "none: no stage has more than one replica"
    return statistics.median(waits), "median over ranks of the STEP's wait after the last stage was ready"
