"""Event simulator: executes per-rank programs with the dependency rules the runtime obeys.

Each rank runs its program in order on one compute stream. A compute action starts when the
previous action of its rank has ended and its inputs exist: a forward needs the forward of
the previous stage of the same (pipe, micro-batch), a backward (or I) needs the backward of
the next stage and its own forward, W needs its I. A cross-rank input arrives one p2p hop
after its producer ended. In a lowered program the hop is paid by the RECV action (the
runtime waits there); SEND is asynchronous. SYNC starts the allreduce of one replica's
gradients once every replica of that stage has issued it; STEP waits for all of the rank's
allreduces. Because programs are fixed, the simulation is a longest-path computation; a
sweep that makes no progress is a deadlock.
"""

from __future__ import annotations

from chimera.ir import Action, Op, Schedule, ScheduleError
from chimera.sim.cost import CostModel
from chimera.sim.timeline import Event, RankStats, Timeline

_DONE_KEY = {Op.F: Op.F, Op.B: Op.B, Op.I: Op.B, Op.W: Op.W}


class Deadlock(ScheduleError):
    """No rank can make progress: ``blocked[rank] = (index, action)`` it waits at."""

    def __init__(self, schedule: Schedule, blocked: dict[int, tuple[int, Action]]):
        self.schedule, self.blocked = schedule, blocked
        first = min(blocked)
        idx, action = blocked[first]
        super().__init__(f"deadlock: {len(blocked)} ranks blocked; rank {first} waits at "
                         f"action {idx} ({action})")


class _State:
    def __init__(self, schedule: Schedule, cost: CostModel):
        self.s, self.cost = schedule, cost
        self.ends: dict[tuple, float] = {}  # (op, pipe, stage, micro) -> end time
        self.sent: dict[tuple, float] = {}  # (op, pipe, stage, micro) -> send time
        self.issued: dict[int, list[float]] = {}  # stage -> SYNC issue times
        self.clock = [0.0] * schedule.ranks
        self.pos = [0] * schedule.ranks
        self.events: list[Event] = []
        self.collectives: list[tuple[int, int, float, float]] = []
        self.lowered = schedule.lowered
        self.total_syncs = sum(a.op is Op.SYNC for _, _, a in schedule.actions())
        self.reduced: dict[int, float] | None = None  # stage -> allreduce end, once all issued

    def rank_of(self, pipe: int, stage: int) -> int:
        return self.s.placement.rank_of(pipe, stage)

    def input_ready(self, rank: int, a: Action) -> float | None:
        """When a compute action's inputs are available on ``rank``, or None if not yet."""
        s, stages = self.s, self.s.stages
        deps: list[tuple[Op, int]] = []  # (done-key op, stage)
        if a.op is Op.F and a.stage > 0:
            deps.append((Op.F, a.stage - 1))
        elif a.op in (Op.B, Op.I):
            deps.append((Op.F, a.stage))
            if a.stage < stages - 1:
                deps.append((Op.B, a.stage + 1))
        elif a.op is Op.W:
            deps.append((Op.B, a.stage))
        t = 0.0
        for op, stage in deps:
            end = self.ends.get((op, a.pipe, stage, a.micro))
            if end is None:
                return None
            if not self.lowered and self.rank_of(a.pipe, stage) != rank:
                end += self.cost.hop(min(stage, a.stage), stages, s.micro_scale)
            t = max(t, end)
        return t


def simulate(schedule: Schedule, cost: CostModel | None = None) -> Timeline:
    """Run ``schedule`` under ``cost`` (unit times 1:1 by default) and return its Timeline."""
    cost = cost or CostModel.unit()
    st = _State(schedule, cost)
    progs = schedule.programs
    remaining = sum(len(p) for p in progs)
    while remaining:
        progressed = 0
        for rank in range(schedule.ranks):
            while st.pos[rank] < len(progs[rank]):
                if not _step(st, rank, progs[rank][st.pos[rank]]):
                    break
                st.pos[rank] += 1
                progressed += 1
        if not progressed:
            blocked = {r: (st.pos[r], progs[r][st.pos[r]])
                       for r in range(schedule.ranks) if st.pos[r] < len(progs[r])}
            raise Deadlock(schedule, blocked)
        remaining -= progressed
    return _timeline(st)


def _step(st: _State, rank: int, a: Action) -> bool:
    """Execute ``a`` on ``rank`` if it can run; return False when it must wait."""
    s = st.s
    if a.op.is_compute:
        ready = st.input_ready(rank, a)
        if ready is None:
            return False
        start = max(st.clock[rank], ready)
        end = start + st.cost.compute(a.op, a.stage, s.stages, s.ranks, s.micro_scale)
        st.ends[(_DONE_KEY[a.op], a.pipe, a.stage, a.micro)] = end
    elif a.op in (Op.SEND_F, Op.SEND_B):
        start = end = st.clock[rank]
        st.sent[(a.op, a.pipe, a.stage, a.micro)] = start
    elif a.op in (Op.RECV_F, Op.RECV_B):
        src = (Op.SEND_F, a.pipe, a.stage - 1, a.micro) if a.op is Op.RECV_F \
            else (Op.SEND_B, a.pipe, a.stage + 1, a.micro)
        if src not in st.sent:
            return False
        start = st.clock[rank]
        hop = st.cost.hop(min(a.stage, src[2]), s.stages, s.micro_scale)
        end = max(start, st.sent[src] + hop)
    elif a.op is Op.SYNC:
        start = end = st.clock[rank]
        st.issued.setdefault(a.stage, []).append(start)
        if not st.cost.overlap_allreduce:
            done = _allreduce_end(st, a.stage)
            if done is None:
                return False
            end = done
    elif a.op is Op.STEP:
        if sum(map(len, st.issued.values())) < st.total_syncs:
            return False
        reduced = _reduce_all(st)
        start = st.clock[rank]
        end = max([start] + [reduced[stage] for _, stage in s.placement.held(rank) if stage in reduced])
    else:  # pragma: no cover - every Op is handled above
        raise ScheduleError(f"simulator cannot execute {a}")
    st.clock[rank] = end
    st.events.append(Event(rank, a, start, end))
    return True


def _group_size(st: _State, stage: int) -> int:
    return len(st.s.placement.replicas(stage)) * st.cost.data_parallel


def _allreduce_end(st: _State, stage: int) -> float | None:
    """End of stage's allreduce once all its replicas issued SYNC; None before that."""
    issued = st.issued.get(stage, [])
    replicas = len(st.s.placement.replicas(stage))
    if len(issued) < replicas:
        return None
    return max(issued) + st.cost.sync(stage, st.s.stages, _group_size(st, stage))


def _reduce_all(st: _State) -> dict[int, float]:
    """Allreduce ends once every SYNC is issued: stages in order of readiness, each rank's
    collectives one after another on its communication channel (as NCCL/gloo run them)."""
    if st.reduced is not None:
        return st.reduced
    st.reduced, channel = {}, [0.0] * st.s.ranks
    for ready, stage in sorted((max(times), stage) for stage, times in st.issued.items()):
        members = set(st.s.placement.replicas(stage))
        start = max([ready] + [channel[r] for r in members])
        end = start + st.cost.sync(stage, st.s.stages, _group_size(st, stage))
        st.reduced[stage] = end
        if end > start:
            for r in members:
                channel[r] = end
                st.collectives.append((r, stage, start, end))
    return st.reduced


def _timeline(st: _State) -> Timeline:
    s = st.s
    makespan = max([e.end for e in st.events] + [0.0])
    busy = [0.0] * s.ranks
    for e in st.events:
        if e.action.op.is_compute:
            busy[e.rank] += e.end - e.start
    stats = [RankStats(r, busy[r], *_memory(s, r)) for r in range(s.ranks)]
    st.events.sort(key=lambda e: (e.rank, e.start, e.end))
    return Timeline(s, st.events, makespan, stats, collectives=st.collectives)


def _memory(s: Schedule, rank: int) -> tuple[float, float]:
    """(peak activations in Ma, weights in Mθ) for one rank."""
    size = s.ranks / s.stages  # a stage is this many D-ths of the model
    frees = Op.W if s.split_backward else Op.B
    held, peak = 0.0, 0.0
    for action in s.programs[rank]:
        if action.op is Op.F:
            held += size * s.micro_scale
            peak = max(peak, held)
        elif action.op is frees:
            held -= size * s.micro_scale
    return peak, len(s.placement.held(rank)) * size
