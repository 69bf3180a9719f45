"""The order in which each rank issues its communication: safe under NCCL by construction.

NCCL does not match messages by tag and does not buffer large ones: a send completes only
while the peer's matching receive is at the head of the peer's stream, and a collective
only once every member has it at the head of its stream. Which operations share a stream
depends on the set-up: p2p per pair of ranks (lazily created 2-rank communicators), all of a
rank's p2p (``device_id``), and, in the worst case that NCCL's guide asks programs to
survive for communicators used concurrently, **all** of a rank's operations, p2p and
collectives together. gloo hides all of this, so an order that trains on CPU can hang on GPUs.

**What this module builds.** One global order of every communication operation of an
iteration, messages and stage collectives (allreduce, its buckets, or a sharded replica's
reduce-scatter) together; every rank issues its own operations as a subsequence of it:

- **Keys.** A unit-cost simulation of the lowered schedule (:mod:`chimera.sim.engine`) gives
  each action a key (start time, index in the simulator's execution order). A message's key
  is its SEND's; a stage's collective's key is the largest key of its members' SYNCs. The
  simulator's order is topological, and whatever follows a RECV on a rank starts no earlier
  than the message's send, so keys grow along every rank's program, and everything after a
  RECV of message m has a larger key than m.
- **Sends** stay where lowering put them, right after their producer (their keys are fixed).
- **Posts and launches** (:class:`Post`, :class:`Launch`) are merged in by key: each is
  issued as soon as every operation of the rank with a smaller key is issued and, for a
  launch, the rank has reached its replica's SYNC (a launch never needs to wait on the CPU:
  by the key properties above, a SYNC precedes every send and RECV with a larger key). A
  post is never later than the RECV that waits for it.
- **Buckets** (:attr:`CommPlan.early`) are decided per stage, never per rank: a stage's
  replicas reduce bucket by bucket inside their last backward only if, on every member,
  nothing but posts (moved in front of that backward) lies between the backward and the
  stage's launch, so issuing the buckets there does not change the rank's order; otherwise
  every member issues one collective at its launch. Every member of a group therefore
  issues the same collectives, of the same sizes, in the same position of the order.

**What is proved, under which model.** Each rank issues its operations in increasing key
order. Take the smallest-key operation not yet complete: every participant has issued it (a
rank blocks only on an operation it issued before, which has a smaller key, hence is
complete), and everything ahead of it on any stream has a smaller key, hence is complete;
so it is at the head everywhere and completes. By induction every operation completes, in
the strictest model (one FIFO stream per rank for p2p and collectives together, sends never
buffered, communicators created before the first iteration), and therefore in every model
that splits those streams further (per pair, p2p apart from collectives). Between
iterations every rank waits for all of its operations at STEP; a sharded optimizer's
parameter all-gathers are issued after the step, stages in order on every rank, ahead of
the next iteration's operations. :mod:`chimera.check.rendezvous` replays the resulting calls in
each model (and :mod:`chimera.check.validate` runs it on every lowered schedule); the proof does
not cover collectives outside the schedule (loss, norm, ties, buffers, the API's batch
fingerprint, checkpoints), which are blocking and issued in one program order on every rank.

This is what torch's ``_add_send_recv`` achieves with a lock-step simulation, and stronger
than DualPipe's "one ``batch_isend_irecv`` before each compute". The runtime executes the
plan's :attr:`CommPlan.steps` item by item; nothing about the order is decided at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from chimera.ir import Action, Op, Schedule, ScheduleError, other_end, peer_stage
from chimera.sim.cost import CostModel
from chimera.sim.engine import compile_schedule


@dataclass(frozen=True, order=True)
class Message:
    """One p2p message, named by its receiving side: an activation (RECV_F) or a gradient
    (RECV_B) into ``stage`` of ``pipe`` for micro-batch ``micro``, sent by ``source_stage``
    (which the name already implies, so it is not compared)."""

    kind: Op
    pipe: int
    stage: int
    micro: int
    source_stage: int = field(compare=False)

    @classmethod
    def of(cls, a: Action, stages: int) -> "Message":
        """The message a SEND or RECV action moves."""
        if a.op in (Op.RECV_F, Op.RECV_B) and (source := peer_stage(a, stages)) is not None:
            return cls(a.op, a.pipe, a.stage, a.micro, source)
        if a.op in (Op.SEND_F, Op.SEND_B) and (recv := other_end(a, stages)) is not None:
            return cls(recv.op, recv.pipe, recv.stage, recv.micro, a.stage)
        raise ScheduleError(f"{a} moves no message")

    def ranks(self, schedule: Schedule) -> tuple[int, int]:
        """(sending rank, receiving rank) within one pipeline copy."""
        place = schedule.placement
        return place.rank_of(self.pipe, self.source_stage), place.rank_of(self.pipe, self.stage)

    def tag(self, schedule: Schedule) -> int:
        """A tag unique within an iteration (gloo checks it; NCCL ignores tags)."""
        pipes, stages = schedule.placement.pipes, schedule.stages
        return (((self.micro * pipes + self.pipe) * stages + self.stage) << 1) | (self.kind is Op.RECV_B)

    def __str__(self) -> str:
        return f"p{self.pipe}s{self.stage}{'F' if self.kind is Op.RECV_F else 'B'}{self.micro}"


@dataclass(frozen=True)
class Post:
    """Post the receive of ``message`` (irecv into its buffer); RECV later waits for it."""

    message: Message

    def __str__(self) -> str:
        return f"post({self.message})"


@dataclass(frozen=True)
class Launch:
    """Issue the gradient collective of the replica (pipe, stage) on the stage's group: its
    allreduce (or what is left of its buckets), or a sharded replica's reduce-scatter."""

    pipe: int
    stage: int

    def __str__(self) -> str:
        return f"launch(p{self.pipe}s{self.stage})"


Step = Action | Post | Launch


@dataclass(frozen=True)
class CommPlan:
    """Per rank, the program with its receive posts and collective launches in place.

    ``steps[r]`` is what rank r executes, in order; ``early[r]`` are the B actions inside
    which a replica's collective may be issued bucket by bucket (as DDP): its last backward,
    for stages where every replica can do so without changing its rank's order (the same
    decision on every member); ``order`` is each message's position in the global order and
    ``collective_order`` the stages in the order of their collectives.
    """

    schedule: Schedule
    steps: tuple[tuple[Step, ...], ...]
    early: tuple[frozenset[Action], ...]
    order: dict[Message, int]  # global position of each message
    collective_order: tuple[int, ...]  # stages, in the global order of their allreduces

    @cached_property
    def incoming(self) -> tuple[tuple[Message, ...], ...]:
        """Per rank, the messages it receives, in the order it posts them."""
        return tuple(tuple(s.message for s in steps if isinstance(s, Post)) for steps in self.steps)


def plan_comm(schedule: Schedule) -> CommPlan:
    """The communication plan of a lowered ``schedule`` (see the module docstring)."""
    if not schedule.lowered:
        raise ScheduleError("plan_comm needs a lowered schedule (chimera.passes.lower)")
    message_key, collective_key = _keys(schedule)
    order = {msg: k for k, msg in enumerate(sorted(message_key, key=message_key.__getitem__))}
    collective_order = tuple(sorted(collective_key, key=collective_key.__getitem__))
    steps = [_merge(schedule, rank, prog, message_key, collective_key)
             for rank, prog in enumerate(schedule.programs)]
    early = _buckets_per_stage(schedule, steps)
    return CommPlan(schedule, tuple(map(tuple, steps)), early, order, collective_order)


Key = tuple[float, int]  # (simulated start time, index in the simulator's execution order)


def _keys(schedule: Schedule) -> tuple[dict[Message, Key], dict[int, Key]]:
    """Each message's key (its SEND's) and each stage collective's (its last member's SYNC)."""
    compiled = compile_schedule(schedule)
    split = schedule.split_backward
    cost = CostModel.unit(1.0, 2.0, 1.0, 1.0) if split else CostModel.unit(1.0, 2.0)
    start = compiled.times(cost).start
    messages: dict[Message, Key] = {}
    collectives: dict[int, Key] = {}
    for i, (_, a) in enumerate(compiled.order):
        if a.op in (Op.SEND_F, Op.SEND_B):
            messages[Message.of(a, schedule.stages)] = (start[i], i)
        elif a.op is Op.SYNC:
            collectives[a.stage] = max(collectives.get(a.stage, (-1.0, -1)), (start[i], i))
    return messages, collectives


class _Pending:
    """A rank's posts and launches sorted by key; the head goes out once the rank may issue it."""

    def __init__(self, rank: int, items: list[tuple[Key, Post | Launch]]):
        self.rank, self.items, self.next = rank, sorted(items, key=lambda x: x[0]), 0
        self.synced: set[int] = set()  # stages whose SYNC the rank has passed

    def flush(self, out: list, below: Key, forced: bool, inclusive: bool = False) -> None:
        """Issue the items with a key below ``below`` (or equal, ``inclusive``), in key order;
        ``forced``: the next action needs them (a send or receive with that key)."""
        items = self.items
        while self.next < len(items):
            key, item = items[self.next]
            if key > below or (key == below and not inclusive):
                return
            if isinstance(item, Launch) and item.stage not in self.synced:
                if forced:  # the key properties (module docstring) rule this out
                    raise ScheduleError(f"rank {self.rank}: {item} would come before its SYNC")
                return
            out.append(item)
            self.next += 1


def _merge(schedule: Schedule, rank: int, prog, message_key: dict[Message, Key],
           collective_key: dict[int, Key]) -> list[Step]:
    """``prog`` with its posts and launches merged in by key (module docstring)."""
    stages, end = schedule.stages, (float("inf"), 0)
    pending = _Pending(rank, [(message_key[m], Post(m)) for m in _received(prog, stages)]
                       + [(collective_key[r[1]], Launch(*r)) for r in _synced(schedule, rank, prog)])
    sends = [message_key[Message.of(a, stages)] for a in prog if a.op in (Op.SEND_F, Op.SEND_B)]
    out: list[Step] = []
    sent = 0
    for a in prog:
        if a.op in (Op.SEND_F, Op.SEND_B):
            pending.flush(out, sends[sent], forced=True)
            sent += 1
        elif a.op in (Op.RECV_F, Op.RECV_B):
            pending.flush(out, message_key[Message.of(a, stages)], forced=True, inclusive=True)
        elif a.op is Op.STEP:
            pending.flush(out, end, forced=True)
        out.append(a)
        if a.op is Op.SYNC:
            pending.synced.add(a.stage)
        # as early as possible: whatever comes before the rank's next send in the order
        pending.flush(out, sends[sent] if sent < len(sends) else end, forced=False)
    return out


def _received(prog, stages: int) -> list[Message]:
    return [Message.of(a, stages) for a in prog if a.op in (Op.RECV_F, Op.RECV_B)]


def _synced(schedule: Schedule, rank: int, prog) -> list[tuple[int, int]]:
    """The (pipe, stage) replicas whose SYNC is in ``prog`` (one per stage)."""
    synced = [(a.pipe, a.stage) for a in prog if a.op is Op.SYNC]
    if len({s for _, s in synced}) != len(synced):
        raise ScheduleError(f"rank {rank} holds two replicas of one stage; their allreduces "
                            "would not match across the stage's group")
    return synced


def _buckets_per_stage(schedule: Schedule, steps: list[list[Step]]) -> tuple[frozenset, ...]:
    """Per rank, the last backwards inside which a replica reduces bucket by bucket: only for
    stages where every member can do so without changing its order (module docstring); the
    posts between such a backward and its launch move in front of the backward."""
    if schedule.split_backward:  # the last gradient comes from W: nothing to bucket inside B
        return tuple(frozenset() for _ in steps)
    spans: dict[int, list[tuple[int, int, int]]] = {}  # stage -> (rank, B index, Launch index)
    for rank, st in enumerate(steps):
        for stage, span in _bucket_spans(st).items():
            spans.setdefault(stage, []).append((rank, *span))
    early: list[set[Action]] = [set() for _ in steps]
    for stage, members in spans.items():
        if len(members) != len(schedule.placement.replicas(stage)):
            continue  # a member cannot: none does
        for rank, b, launch in members:
            st = steps[rank]
            posts = [x for x in st[b + 1:launch] if isinstance(x, Post)]
            rest = [x for x in st[b + 1:launch] if not isinstance(x, Post)]
            st[b:launch] = posts + [st[b]] + rest
            early[rank].add(st[b + len(posts)])
    return tuple(frozenset(e) for e in early)


def _bucket_spans(steps: list[Step]) -> dict[int, tuple[int, int]]:
    """stage -> (index of the replica's last B, index of its Launch) where only actions that
    issue nothing (compute, waits, SYNC) or posts lie between the two."""
    last_b: dict[tuple[int, int], int] = {}
    out = {}
    for i, x in enumerate(steps):
        if isinstance(x, Action) and x.op is Op.B:
            last_b[(x.pipe, x.stage)] = i
        elif isinstance(x, Launch) and (x.pipe, x.stage) in last_b:
            b = last_b[(x.pipe, x.stage)]
            between = steps[b + 1:i]
            if not any(isinstance(y, Launch) or (isinstance(y, Action) and y.op in
                                                 (Op.SEND_F, Op.SEND_B)) for y in between):
                out[x.stage] = (b, i)
    return out
