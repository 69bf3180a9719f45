"""Exact refinement of a split-backward schedule with CP-SAT (optional: ``pip install ortools``).

The model is the list scheduler's problem stated whole: one interval per F, I, W task (times
scaled to integers), precedences with the p2p hop between ranks, no overlap on a rank, and a
cumulative constraint per rank where micro-batch m of replica (p, s) holds ``size`` Ma from
the start of its F to the end of its W. Minimise the makespan, starting from a hint (the list
scheduler's order as timed by its own play). Micro-batches of one pipe are interchangeable,
so their stage-0 forwards are ordered to break the symmetry. Meant for small D and N: the
solver gets a time limit and returns the best order it found (never worse than the hint).
"""

from __future__ import annotations

from chimera.ir import Action, Op, OpTimes, Placement, ScheduleError
from chimera.schedules.list_play import Dag, build_dag, first_hop

_SCALE = 1000  # time resolution of the integer model: 1/1000 of a unit


def available() -> bool:
    try:  # OR-Tools is an optional extra (chimera-pipeline[exact]): imported where it is used
        import ortools.sat.python.cp_model  # noqa: F401
    except ImportError:
        return False
    return True


def refine(placement: Placement, micro_pipe, times: OpTimes, cap: float, hint: list[list[Action]],
           seconds: float = 10.0, workers: int = 8) -> tuple[list[list[Action]], float, bool]:
    """Per-rank programs, their makespan (in the cost's units), and whether it is proven optimal."""
    try:  # the optional extra, as in available()
        from ortools.sat.python import cp_model
    except ImportError:
        raise ScheduleError("exact refinement needs OR-Tools: "
                            "pip install 'chimera-pipeline[exact]'") from None
    dag = build_dag(placement, micro_pipe, times)
    model = cp_model.CpModel()
    dur = [max(1, round(d * _SCALE)) for d in dag.dur]
    hop = round(first_hop(times) * _SCALE)
    horizon = sum(dur) + hop * len(dag)
    start = [model.NewIntVar(0, horizon, f"s{t}") for t in range(len(dag))]
    end = [model.NewIntVar(0, horizon, f"e{t}") for t in range(len(dag))]
    intervals = [model.NewIntervalVar(start[t], dur[t], end[t], f"i{t}") for t in range(len(dag))]
    _precedences(model, dag, start, end, hop)
    for r in range(placement.ranks):
        model.AddNoOverlap([intervals[t] for t in range(len(dag)) if dag.rank[t] == r])
    _memory(model, dag, placement, start, end, cap, horizon)
    _symmetry(model, dag, start)
    makespan = model.NewIntVar(0, horizon, "makespan")
    model.AddMaxEquality(makespan, end)
    model.Minimize(makespan)
    _hint(model, dag, start, hint, dur, hop)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(seconds)
    solver.parameters.num_workers = workers
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return hint, float("inf"), False
    order = sorted(range(len(dag)), key=lambda t: (solver.Value(start[t]), t))
    programs: list[list[Action]] = [[] for _ in range(placement.ranks)]
    for t in order:
        programs[dag.rank[t]].append(Action(dag.op[t], dag.pipe[t], dag.stage[t], dag.micro[t]))
    starts = _asap(dag, programs, dur, hop)  # the solver need not start everything early
    span = max(starts[t] + dur[t] for t in starts)
    return programs, span / _SCALE, status == cp_model.OPTIMAL


def _precedences(model, dag: Dag, start, end, hop: int) -> None:
    for t in range(len(dag)):
        for u in dag.succs[t]:
            model.Add(start[u] >= end[t] + (hop if dag.rank[u] != dag.rank[t] else 0))


def _memory(model, dag: Dag, placement: Placement, start, end, cap: float, horizon: int) -> None:
    """Activations of (pipe, stage, micro) live from its F's start to its W's end."""
    size = placement.ranks / placement.stages
    first = {(dag.pipe[t], dag.stage[t], dag.micro[t]): t for t in range(len(dag)) if dag.op[t] is Op.F}
    lives: dict[int, list] = {}
    for t in range(len(dag)):
        if dag.op[t] is Op.W:
            f = first[(dag.pipe[t], dag.stage[t], dag.micro[t])]
            length = model.NewIntVar(0, horizon, f"live{t}")
            live = model.NewIntervalVar(start[f], length, end[t], f"l{t}")
            lives.setdefault(dag.rank[t], []).append(live)
    units = round(cap / size + 1e-9)
    for r, intervals in lives.items():
        model.AddCumulative(intervals, [1] * len(intervals), units)


def _symmetry(model, dag: Dag, start) -> None:
    last: dict[int, int] = {}
    for t in range(len(dag)):
        if dag.op[t] is Op.F and dag.stage[t] == 0:
            p = dag.pipe[t]
            if p in last:
                model.Add(start[last[p]] <= start[t])
            last[p] = t


def _hint(model, dag: Dag, start, hint: list[list[Action]], dur: list[int], hop: int) -> None:
    """Give the solver the hint's order timed as soon as possible (as the simulator would)."""
    for t, begin in _asap(dag, hint, dur, hop).items():
        model.AddHint(start[t], begin)


def _asap(dag: Dag, programs: list[list[Action]], dur: list[int], hop: int) -> dict[int, int]:
    """Start of every task when each rank runs its program in order, each as early as it can."""
    index = {(dag.op[t], dag.pipe[t], dag.stage[t], dag.micro[t]): t for t in range(len(dag))}
    progs = [[index[(a.op, a.pipe, a.stage, a.micro)] for a in prog] for prog in programs]
    preds: list[list[int]] = [[] for _ in range(len(dag))]
    for t in range(len(dag)):
        for u in dag.succs[t]:
            preds[u].append(t)
    starts, ends = {}, {}
    pos, clock = [0] * len(progs), [0] * len(progs)
    moved = True
    while moved:
        moved = False
        for r, prog in enumerate(progs):
            while pos[r] < len(prog) and all(p in ends for p in preds[prog[pos[r]]]):
                t = prog[pos[r]]
                arrive = [ends[p] + (hop if dag.rank[p] != r else 0) for p in preds[t]]
                starts[t] = max([clock[r]] + arrive)
                ends[t] = clock[r] = starts[t] + dur[t]
                pos[r] += 1
                moved = True
    return starts
