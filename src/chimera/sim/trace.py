"""Chrome / Perfetto trace files (Trace Event format) of a timeline, and reading them back.

One process per rank (``pid = rank``, named ``rank 0`` ...); threads: tid 0 compute,
tid 1 p2p communication, tid 2 allreduces. Complete events (``"ph": "X"``) carry ``ts`` and
``dur`` in microseconds: seconds are scaled by 1e6, and one simulated ``unit`` is shown as
1000 us (1 ms) so unit-time timelines read naturally in the viewer. The timeline's unit is
stored under ``otherData`` so :func:`load_trace_events` can undo the scaling; so is the
lowered schedule itself (``otherData.lowered_schedule``) and the timeline's ``meta``, and a
measured event carries its thread CPU time (``args.cpu_s``): what :func:`load_trace` needs to
replay a real run in the simulator (``chimera simulate --from-trace``).
"""

from __future__ import annotations

import json
from pathlib import Path

from chimera.errors import UserError
from chimera.ir import Action, Schedule, ScheduleError
from chimera.sim.timeline import Event, Timeline

US_PER = {"s": 1e6, "ms": 1e3, "us": 1.0, "unit": 1e3}  # microseconds per timeline unit
TID_COMPUTE, TID_COMM, TID_COLLECTIVE = 0, 1, 2
_THREAD_NAMES = {TID_COMPUTE: "compute", TID_COMM: "p2p", TID_COLLECTIVE: "allreduce"}


def chrome_trace(timeline: Timeline) -> dict:
    """The timeline as a Trace Event format object (``json.dump`` it, or use save_trace)."""
    scale = _scale(timeline.unit)
    events = _metadata(timeline.schedule.ranks)
    for event in sorted(timeline.events, key=lambda e: (e.rank, e.start, e.end)):
        events.append(_complete(event, scale))
    for rank, stage, start, end in timeline.collectives:
        events.append({
            "name": f"allreduce s{stage}", "cat": "ALLREDUCE", "ph": "X",
            "ts": start * scale, "dur": (end - start) * scale,
            "pid": rank, "tid": TID_COLLECTIVE, "args": {"stage": stage},
        })
    other = {"schedule": timeline.schedule.name, "unit": timeline.unit,
             "makespan": timeline.makespan, "bubble_ratio": timeline.bubble_ratio,
             **timeline.meta, "lowered_schedule": timeline.schedule.to_json()}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def save_trace(timeline: Timeline, path) -> Path:
    """Write :func:`chrome_trace` as JSON; open it in ui.perfetto.dev or chrome://tracing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(timeline), indent=None))
    return path


def load_trace_events(path, unit: str | None = None) -> list[Event]:
    """Read back the compute and p2p events of a trace written by :func:`save_trace`.

    Times come back in ``unit`` (default: the unit recorded in the file, else seconds).
    Only JSON is parsed; events whose name is not an action (allreduces, metadata, events of
    other tools) are skipped. Returns the events sorted by (rank, start).
    """
    data = strict_json(Path(path).read_text())
    if isinstance(data, list):  # the bare-array form of the format
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise UserError(f"{path}: not a Chrome trace (no traceEvents list)")
    other = data.get("otherData") if isinstance(data.get("otherData"), dict) else {}
    scale = _scale(unit or other.get("unit", "s"))
    events = [e for e in (_to_event(raw, scale) for raw in data["traceEvents"]) if e]
    return sorted(events, key=lambda e: (e.rank, e.start, e.end))


def load_trace(path) -> tuple[Schedule | None, list[Event], dict]:
    """(schedule, events, otherData) of a trace written by :func:`save_trace`.

    The schedule is None for traces written before it was stored. Allreduce intervals (tid 2)
    come back in ``otherData["collectives"]`` as ``(rank, stage, start, end)`` tuples.
    """
    data = strict_json(Path(path).read_text())
    other = data.get("otherData") if isinstance(data, dict) and isinstance(data.get("otherData"), dict) else {}
    schedule = Schedule.from_json(other["lowered_schedule"]) if "lowered_schedule" in other else None
    scale = _scale(other.get("unit", "s"))
    other = dict(other, collectives=[
        (int(e["pid"]), int(e["args"]["stage"]), e["ts"] / scale, (e["ts"] + e["dur"]) / scale)
        for e in data["traceEvents"] if isinstance(e, dict) and e.get("tid") == TID_COLLECTIVE
        and e.get("ph") == "X" and "stage" in e.get("args", {})])
    return schedule, load_trace_events(path), other


# -- helpers ------------------------------------------------------------------------------
def strict_json(text: str):
    """Standard JSON only: a trace holding ``Infinity`` or ``NaN`` is refused (ValueError)."""
    def refuse(name: str):
        raise UserError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


def _scale(unit: str) -> float:
    if unit not in US_PER:
        raise UserError(f"unknown time unit {unit!r} (expected one of {sorted(US_PER)})")
    return US_PER[unit]


def _metadata(ranks: int) -> list[dict]:
    events = []
    for rank in range(ranks):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        for tid, name in _THREAD_NAMES.items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                           "args": {"name": name}})
    return events


def _complete(event: Event, scale: float) -> dict:
    action = event.action
    args = {"pipe": action.pipe, "stage": action.stage, "micro": action.micro}
    if event.cpu is not None:
        args["cpu_s"] = event.cpu
    return {
        "name": str(action), "cat": action.op.value, "ph": "X",
        "ts": event.start * scale, "dur": event.duration * scale,
        "pid": event.rank, "tid": TID_COMPUTE if action.op.is_compute else TID_COMM,
        "args": args,
    }


def _to_event(raw, scale: float) -> Event | None:
    """One trace entry as an Event, or None when it is not an action's complete event."""
    if not isinstance(raw, dict) or raw.get("ph") != "X" or raw.get("tid") == TID_COLLECTIVE:
        return None
    try:
        action = Action.parse(str(raw["name"]))
        start, dur = float(raw["ts"]) / scale, float(raw.get("dur", 0.0)) / scale
        cpu = (raw.get("args") or {}).get("cpu_s")
        return Event(int(raw["pid"]), action, start, start + dur,
                     None if cpu is None else float(cpu))
    except (KeyError, TypeError, ValueError, ScheduleError):
        return None
