"""Rendezvous check: replay every rank's communication calls under NCCL's rules (no torch).

gloo matches messages by tag and buffers them, so an order of calls that trains on CPU can
hang on GPUs. This module replays, for every rank, the exact sequence of ``torch.distributed``
calls the runtime makes for a :class:`~chimera.comm_plan.CommPlan` (:func:`issued_ops`: what
:class:`~chimera.runtime.p2p.Mailbox` and :class:`~chimera.runtime.sync.GradSync` call, in
order; a test records the real runtime's calls and compares) under these rules:

- **Streams.** Each p2p call (``isend``/``irecv``) joins a FIFO stream when the rank's CPU
  reaches it. Mode ``pair``: one stream per pair of ranks on each side, shared by both
  directions (NCCL's lazily created 2-rank communicators). Mode ``rank``: one stream per
  rank for all its p2p (``init_process_group(device_id=...)``: p2p then runs on the default
  communicator, created at start-up).
- **Rendezvous.** A send and its receive complete together, and only while both are at the
  head of their streams: a send larger than NCCL's buffer waits for the peer's receive, and
  nothing behind it on its stream moves meanwhile. (Small messages may slip through the
  buffer on real hardware; the check assumes none does.)
- **CPU.** ``Work.wait`` blocks the rank's CPU until the op completed: a RECV waits for its
  posted receive; STEP waits for every send, then every allreduce, in issue order. Compute,
  posts, sends and launches never block.
- **Collectives.** Each rank has one FIFO of collectives over all communicators (NCCL needs
  one consistent order across communicators used concurrently); the k-th allreduce on a
  group completes when it is at the head of every member's FIFO. On CUDA a replica whose
  gradients the plan lets reduce bucket by bucket (``CommPlan.early``) issues its allreduce
  inside its last backward (``buckets=True``; on CPU, one allreduce at the Launch); its
  buckets are consecutive in every member's FIFO, so they count as one collective. A group
  of one rank issues nothing.
- **Sharded optimizer** (``sharded=True``, ZeRO-1, :mod:`chimera.runtime.shard`): a replica's
  collective at its Launch is a reduce-scatter on NCCL (never bucketed; off NCCL the runtime
  runs an allreduce in that slot, gloo's reduce-scatter being slower); after STEP the rank issues
  one parameter all-gather per replica, stages in order, and waits for each right before
  its replica's first forward of the next iteration (prefetch). Those gathers are what
  makes iterations interact, so a sharded replay runs two iterations, each ending as
  ``PipelineRuntime.gather_parameters`` does (wait for gathers no forward waited for, then
  issue the next ones). The k-th collective of a group must be of the same kind on every
  member (an all-gather meeting a reduce-scatter never completes here).
- **Lazy communicators** (``lazy_communicators=True``): the first use of a communicator (a
  pair's first p2p call in ``pair`` mode, a group's first collective) blocks the CPU until
  every member reaches its own first use: NCCL creates it then. The runtime creates every
  communicator at start-up (``ProcessGrid.warm_up``), so :mod:`chimera.validate` replays
  with eager communicators; the lazy mode shows why that matters.
- **Data parallelism.** ``data_parallel=W`` replays W pipeline copies (global rank
  ``w * D + d``): p2p stays inside a copy, stage groups span all copies. The copies run in
  lock-step, so W >= 2 behaves like W = 2, which is W = 1 with every stage group reducing
  (with W = 1 a stage held once issues nothing). Progress here is monotone (a call that
  may complete stays so until it does), so removing those calls cannot create a deadlock:
  W = 2 passing implies W = 1 passing. The validator replays W = 2; tests replay both.

Not modelled: timing (only whether progress is possible), buffering of small messages
(which only hides deadlocks), p2p and collective kernels blocking each other across
communicators, the start-up warm-up itself (its order is fixed and global), collectives
outside the schedule (loss, gradient norm, checkpoints), and, without sharding, more than one
iteration (after STEP everything is complete, so iterations do not interact).

The replay is event driven: each call is queued, matched and completed once, so it costs
O(number of calls).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from chimera.comm_plan import CommPlan, Launch, Message, Post
from chimera.errors import UserError
from chimera.ir import Action, Op, Schedule
from chimera.validation_error import ValidationError

MODES = ("pair", "rank")
ISEND, IRECV, WAIT = "isend", "irecv", "wait"
ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER = "all_reduce", "reduce_scatter", "all_gather"
COLLECTIVES = (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER)


@dataclass(frozen=True, slots=True)
class Issued:
    """One ``torch.distributed`` call of one rank. ``step`` indexes the rank's CommPlan steps
    (the step that makes the call); ``target`` is, for a wait, the index of the awaited call
    in the rank's list of calls."""

    kind: str
    step: int
    peer: int = -1  # p2p: the other global rank
    message: Message | None = None
    group: tuple[int, ...] = ()  # a collective: global ranks of the stage group
    stage: int = -1
    target: int = -1

    def describe(self, calls: list["Issued"]) -> str:
        if self.kind == ISEND:
            return f"isend {self.message} to rank {self.peer}"
        if self.kind == IRECV:
            return f"irecv {self.message} from rank {self.peer}"
        if self.kind in COLLECTIVES:
            name = {ALL_REDUCE: "allreduce", REDUCE_SCATTER: "reduce-scatter",
                    ALL_GATHER: "parameter all-gather"}[self.kind]
            return f"{name} of stage {self.stage} over ranks {_ranks_text(self.group)}"
        return f"wait for {calls[self.target].describe(calls)}"


def stage_group(schedule: Schedule, stage: int, data_parallel: int = 1) -> tuple[int, ...]:
    """Global ranks of the replica group of ``stage`` (as ``ProcessGrid.build_groups``)."""
    depth = schedule.ranks
    return tuple(sorted({w * depth + d for w in range(data_parallel)
                         for d in schedule.placement.replicas(stage)}))


def issued_ops(plan: CommPlan, rank: int, data_parallel: int = 1,
               buckets: bool = True, sharded: bool = False) -> list[Issued]:
    """The ``torch.distributed`` calls global ``rank`` makes, in order, executing ``plan``.

    ``buckets``: the runtime reduces a replica bucket by bucket inside its last backward
    where ``plan.early`` allows (what it does on CUDA); False: one allreduce at its Launch
    (``bucket_bytes=0``, what it does on CPU). ``sharded``: the optimizer is sharded over
    each stage group (module docstring); the calls of two iterations."""
    depth = plan.schedule.ranks
    calls = _pipeline_calls(plan, rank % depth, data_parallel, buckets, sharded)
    return _shifted(calls, (rank // depth) * depth)


def _shifted(calls: list[Issued], base: int) -> list[Issued]:
    """``calls`` of pipeline copy 0 as made in the copy whose first global rank is ``base``."""
    if base == 0:
        return calls
    return [Issued(c.kind, c.step, c.peer + base, c.message, c.group, c.stage, c.target)
            if c.peer >= 0 else c for c in calls]


def _pipeline_calls(plan: CommPlan, d: int, data_parallel: int, buckets: bool,
                    sharded: bool = False) -> list[Issued]:
    """The calls of pipeline rank ``d`` in copy 0 (the other copies differ only in peers)."""
    calls: list[Issued] = []
    gathers: dict[tuple[int, int], int] = {}  # replica -> its all-gather not waited for yet
    for _ in range(2 if sharded else 1):
        _iteration(calls, gathers, plan, d, data_parallel, buckets and not sharded, sharded)
    return calls


def _iteration(calls: list[Issued], gathers: dict[tuple[int, int], int], plan: CommPlan, d: int,
               data_parallel: int, buckets: bool, sharded: bool) -> None:
    """Append the calls of one iteration; with ``sharded``, a replica's first forward waits
    for its pending all-gather, and the iteration ends with the next all-gathers."""
    s = plan.schedule
    early_b = plan.early[d] if buckets else frozenset()
    early = {(a.pipe, a.stage) for a in early_b}
    reduce = REDUCE_SCATTER if sharded else ALL_REDUCE
    posted: dict[Message, int] = {}
    sends: list[int] = []
    reduces: list[int] = []
    for i, step in enumerate(plan.steps[d]):
        if isinstance(step, Post):
            posted[step.message] = len(calls)
            calls.append(Issued(IRECV, i, step.message.ranks(s)[0], step.message))
        elif isinstance(step, Launch):
            if (step.pipe, step.stage) not in early:
                _collective(calls, reduces, reduce, s, i, step.stage, data_parallel)
        elif step.op in (Op.SEND_F, Op.SEND_B):
            msg = Message.of(step, s.stages)
            sends.append(len(calls))
            calls.append(Issued(ISEND, i, msg.ranks(s)[1], msg))
        elif step.op in (Op.RECV_F, Op.RECV_B):
            calls.append(Issued(WAIT, i, target=_posted(plan, d, i, step, posted)))
        elif step.op is Op.F and (step.pipe, step.stage) in gathers:
            calls.append(Issued(WAIT, i, target=gathers.pop((step.pipe, step.stage))))
        elif step.op is Op.B and step in early_b:
            _collective(calls, reduces, reduce, s, i, step.stage, data_parallel)
        elif step.op is Op.STEP:
            calls += [Issued(WAIT, i, target=t) for t in sends + reduces]
            sends, reduces = [], []
            if sharded:  # PipelineRuntime.gather_parameters, after the optimizer step
                calls += [Issued(WAIT, i, target=t) for t in gathers.values()]
                gathers.clear()
                for p, stage in sorted(s.placement.held(d), key=lambda k: (k[1], k[0])):
                    index = len(calls)
                    if _collective(calls, [], ALL_GATHER, s, i, stage, data_parallel):
                        gathers[(p, stage)] = index


def _collective(calls: list[Issued], issued: list[int], kind: str, s: Schedule, i: int,
                stage: int, data_parallel: int) -> bool:
    """Append ``kind`` over ``stage``'s group (and its index to ``issued``); a group of one
    rank has nothing to reduce or gather and makes no call."""
    group = stage_group(s, stage, data_parallel)
    if len(group) == 1:
        return False
    issued.append(len(calls))
    calls.append(Issued(kind, i, group=group, stage=stage))
    return True


def _posted(plan: CommPlan, d: int, i: int, step: Action, posted: dict[Message, int]) -> int:
    msg = Message.of(step, plan.schedule.stages)
    if msg not in posted:
        raise ValidationError(f"rank {d}: {step} waits for a receive that was never posted",
                              plan.schedule, d, _action_index(plan.steps[d], i))
    return posted.pop(msg)


class RendezvousDeadlock(ValidationError):
    """The replay stopped with ranks left: ``stuck`` maps each stuck global rank to what it
    waits at; ``heads`` names the call at the head of each non-empty stream or FIFO."""

    def __init__(self, problem: str, schedule: Schedule, rank: int, index: int,
                 stuck: dict[int, str], heads: list[str]):
        self.stuck, self.heads = stuck, heads
        super().__init__(problem, schedule, rank, index)


def check(plan: CommPlan, mode: str = "pair", data_parallel: int = 1,
          lazy_communicators: bool = False, buckets: bool = True, sharded: bool = False) -> None:
    """Replay ``plan`` under NCCL's rules (module docstring); raise RendezvousDeadlock if
    some rank can never finish its iteration. ``buckets`` and ``sharded`` as in
    :func:`issued_ops`."""
    if mode not in MODES:
        raise UserError(f"unknown stream mode {mode!r}; choose one of {', '.join(MODES)}")
    if data_parallel < 1:
        raise UserError(f"data_parallel must be at least 1, got {data_parallel}")
    depth = plan.schedule.ranks
    copy0 = [_pipeline_calls(plan, d, data_parallel, buckets, sharded) for d in range(depth)]
    calls = [_shifted(c, w * depth) for w in range(data_parallel) for c in copy0]
    _Replay(plan, calls, mode, lazy_communicators).run()


class _Replay:
    def __init__(self, plan: CommPlan, calls: list[list[Issued]], mode: str, lazy: bool):
        self.plan, self.calls, self.mode, self.lazy = plan, calls, mode, lazy
        n = len(calls)
        self.pc = [0] * n
        self.done = [bytearray(len(c)) for c in calls]
        self.streams: dict[object, deque[tuple[int, int]]] = {}
        self.fifo = [deque() for _ in range(n)]  # per rank: indices of its queued collectives
        self.arrived: dict[tuple, int] = {}  # (group, stage, k) -> members at the head
        self.coll_id = [self._number_collectives(c) for c in calls]
        self.first = [self._first_uses(r, c) for r, c in enumerate(calls)] if lazy else []
        self.created: set[tuple] = set()
        self.waiting_for: dict[tuple, set[int]] = {}  # lazy communicator -> arrived members
        self.ready = deque(range(n))

    # -- set-up -------------------------------------------------------------------------
    @staticmethod
    def _number_collectives(calls: list[Issued]) -> dict[int, tuple]:
        """NCCL matches the k-th collective on a communicator with every member's k-th, which
        must be of the same kind. Each stage has its own group, even where two have the same
        members."""
        count: dict[int, int] = {}
        out = {}
        for i, c in enumerate(calls):
            if c.kind in COLLECTIVES:
                k = count[c.stage] = count.get(c.stage, -1) + 1
                out[i] = (c.group, c.stage, k, c.kind)
        return out

    def _first_uses(self, rank: int, calls: list[Issued]) -> dict[int, tuple]:
        """Index of each call that first uses a communicator -> (communicator, members)."""
        seen, out = set(), {}
        for i, c in enumerate(calls):
            if c.kind in COLLECTIVES:
                comm = (f"stage {c.stage}", c.group)
            elif c.kind in (ISEND, IRECV) and self.mode == "pair":
                comm = ("pair", tuple(sorted((rank, c.peer))))
            else:
                continue
            if comm not in seen:
                seen.add(comm)
                out[i] = comm
        return out

    def _stream(self, rank: int, peer: int):
        return (rank, peer) if self.mode == "pair" else rank

    # -- the replay ---------------------------------------------------------------------
    def run(self) -> None:
        while self.ready:
            self._advance(self.ready.popleft())
        if any(pc < len(c) for pc, c in zip(self.pc, self.calls)):
            raise self._deadlock()

    def _advance(self, r: int) -> None:
        """Run rank ``r``'s CPU until it blocks or its calls are all issued."""
        calls, done = self.calls[r], self.done[r]
        while self.pc[r] < len(calls):
            i = self.pc[r]
            c = calls[i]
            if self.lazy and i in self.first[r] and not self._communicator_ready(r, i):
                return  # woken when the last member arrives
            if c.kind == WAIT and not done[c.target]:
                return  # woken by _complete
            self.pc[r] = i + 1  # before queueing: a completion looks at where the rank is
            if c.kind in COLLECTIVES:
                self.fifo[r].append(i)
                if len(self.fifo[r]) == 1:
                    self._collectives_from(r)
            elif c.kind != WAIT:
                queue = self.streams.setdefault(self._stream(r, c.peer), deque())
                queue.append((r, i))
                if len(queue) == 1:
                    self._match_from(self._stream(r, c.peer))

    def _communicator_ready(self, r: int, i: int) -> bool:
        comm = self.first[r][i]
        if comm in self.created:
            return True
        members = comm[1]
        arrived = self.waiting_for.setdefault(comm, set())
        arrived.add(r)
        if len(arrived) < len(members):
            return False
        self.created.add(comm)
        self.ready.extend(m for m in members if m != r)
        return True

    def _complete(self, r: int, i: int) -> None:
        self.done[r][i] = 1
        pc = self.pc[r]
        if pc < len(self.calls[r]) and self.calls[r][pc].target == i:
            self.ready.append(r)

    def _match_from(self, key) -> None:
        """Complete sends and receives at the heads of their streams, as long as they pair."""
        todo = [key]
        while todo:
            key = todo.pop()
            queue = self.streams[key]
            if not queue:
                continue
            r, i = queue[0]
            c = self.calls[r][i]
            other = self._stream(c.peer, r)
            peer_queue = self.streams.get(other)
            if not peer_queue:
                continue
            q, j = peer_queue[0]
            d = self.calls[q][j]
            if d.peer == r and d.kind != c.kind and d.message == c.message:
                queue.popleft()
                peer_queue.popleft()
                self._complete(r, i)
                self._complete(q, j)
                todo += [key, other]

    def _collectives_from(self, rank: int) -> None:
        """Count the collective now at the head of ``rank``'s FIFO; complete full ones."""
        todo = [rank]
        while todo:
            r = todo.pop()
            if not self.fifo[r]:
                continue
            ident = self.coll_id[r][self.fifo[r][0]]
            n = self.arrived[ident] = self.arrived.get(ident, 0) + 1
            if n < len(ident[0]):
                continue
            del self.arrived[ident]
            for m in ident[0]:
                self._complete(m, self.fifo[m].popleft())
                todo.append(m)

    # -- the report ---------------------------------------------------------------------
    def _deadlock(self) -> RendezvousDeadlock:
        s, depth = self.plan.schedule, self.plan.schedule.ranks
        stuck = {r: self._stuck_text(r) for r, c in enumerate(self.calls) if self.pc[r] < len(c)}
        heads = self._heads()
        first = min(stuck, key=lambda r: (self.calls[r][self.pc[r]].kind != WAIT, r))
        steps = self.plan.steps[first % depth]
        index = _action_index(steps, self.calls[first][self.pc[first]].step)
        index = min(index, len(s.programs[first % depth]) - 1)
        streams = "one per pair of ranks" if self.mode == "pair" else "one per rank"
        comms = "lazily" if self.lazy else "eagerly"
        ranks = len(self.calls)
        problem = (f"rendezvous deadlock under NCCL semantics ({ranks} ranks; p2p streams: "
                   f"{streams}; communicators created {comms}):\n"
                   + "\n".join(f"  {t}" for t in stuck.values())
                   + "\nat the head of each stream and collective queue:\n"
                   + "\n".join(f"  {h}" for h in heads))
        return RendezvousDeadlock(problem, s, first % depth, index, stuck, heads)

    def _stuck_text(self, r: int) -> str:
        i = self.pc[r]
        c = self.calls[r][i]
        where = self._step_text(r, c.step)
        if self.lazy and i in self.first[r] and self.first[r][i] not in self.created:
            comm = self.first[r][i]
            missing = sorted(set(comm[1]) - self.waiting_for.get(comm, set()))
            return (f"rank {r} blocks at {where}: creating the communicator of {comm[0]} "
                    f"(ranks {_ranks_text(comm[1])}) for {c.describe(self.calls[r])}; "
                    f"rank {_ranks_text(missing)} not there")
        return f"rank {r} blocks at {where}: {c.describe(self.calls[r])}"

    def _heads(self) -> list[str]:
        out = []
        for key, queue in sorted(self.streams.items(), key=lambda kv: str(kv[0])):
            if queue:
                r, i = queue[0]
                c = self.calls[r][i]
                name = f"stream {key[0]}<->{key[1]} on rank {key[0]}" if self.mode == "pair" \
                    else f"p2p stream of rank {key}"
                out.append(f"{name}: {c.describe(self.calls[r])} ({self._step_text(r, c.step)})")
        for r, fifo in enumerate(self.fifo):
            if fifo:
                c = self.calls[r][fifo[0]]
                out.append(f"collectives of rank {r}: {c.describe(self.calls[r])} "
                           f"({self._step_text(r, c.step)})")
        return out or ["(all empty: the ranks block on the CPU)"]

    def _step_text(self, r: int, step: int) -> str:
        return f"{self.plan.steps[r % self.plan.schedule.ranks][step]}"


def _action_index(steps, step: int) -> int:
    """Index in the rank's program of the action to mark for ``steps[step]``: itself, the
    action a Launch follows (its SYNC or last backward), or the action a Post precedes."""
    before = sum(1 for x in steps[:step] if isinstance(x, Action))
    return max(0, before - 1) if isinstance(steps[step], Launch) else before


def _ranks_text(ranks) -> str:
    return ", ".join(map(str, ranks))
