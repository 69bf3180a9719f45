"""The order in which each rank issues its communication: safe under NCCL by construction.

NCCL does not match messages by tag and does not buffer large ones: between a pair of ranks
(or, with ``device_id``, for all of a rank's p2p) operations run one after another on one
FIFO stream, and a send completes only while the peer's matching receive is at the head of
the peer's stream. Collectives complete only when every member has reached them, and
communicators used concurrently must see their operations in one order on every rank.
gloo hides all of this, so an order that trains on CPU can hang on GPUs.

The plan below makes every stream's operations a subsequence of one global order of
messages, which is deadlock-free whatever the stream mode (per pair or per rank):

- **Global order.** A message's position is the time its SEND is issued in a simulated run
  of the lowered schedule (unit costs, ties by the simulator's execution order). Causality
  makes this order agree with every program: if a rank consumes message r before it sends
  m, r was sent before m.
- **Sends** stay where lowering put them, right after their producer.
- **Receives** are posted (:class:`Post`) as early as the order allows: right after the
  rank's last send that precedes them in the global order, and never later than the RECV
  that waits for them. So each rank's stream holds its sends and receives in global order.
  By induction on that order, the earliest incomplete message always has both ends issued
  and at the head of their streams (everything before it on either stream is earlier,
  hence complete), so it completes.
- **Collectives.** The allreduce of a stage group is ordered globally by the time its last
  member reaches SYNC (ties by stage). A rank :class:`Launch`-es its replicas' allreduces
  in that order: a SYNC whose predecessors are not launched yet waits (in the plan, not on
  the CPU) until they are; STEP launches whatever is left, then waits. Every member of
  every group thus issues collectives in one order, and none blocks compute before STEP.

This is what torch's ``_add_send_recv`` achieves with a lock-step simulation, and stronger
than DualPipe's "one ``batch_isend_irecv`` before each compute", which does not cover
interleaved, doubling/halving or zero-bubble schedules (the rendezvous check in
:mod:`chimera.validate` replays every plan under NCCL's rules). The runtime executes the
plan's :attr:`CommPlan.steps` item by item; nothing about the order is decided at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from chimera.ir import Action, Op, Schedule, ScheduleError, finishing_op, other_end, peer_stage
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
    """Issue the gradient allreduce of the replica (pipe, stage) on the stage's group."""

    pipe: int
    stage: int

    def __str__(self) -> str:
        return f"launch(p{self.pipe}s{self.stage})"


Step = Action | Post | Launch


@dataclass(frozen=True)
class CommPlan:
    """Per rank, the program with its receive posts and allreduce launches in place.

    ``steps[r]`` is what rank r executes, in order; ``early[r]`` are the B actions inside
    which a replica's allreduce may start bucket by bucket (as DDP): its last backward, when
    every allreduce before it in the rank's order is already launched by then.
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
    order, sync_time = _global_order(schedule)
    stage_key = {stage: (max(times), stage) for stage, times in sync_time.items()}
    collective_order = tuple(sorted(stage_key, key=stage_key.__getitem__))
    steps, early = [], []
    for rank, prog in enumerate(schedule.programs):
        with_posts = _place_posts(schedule, rank, prog, order)
        placed, ok = _place_launches(schedule, rank, with_posts, collective_order)
        steps.append(tuple(placed))
        early.append(ok)
    return CommPlan(schedule, tuple(steps), tuple(early), order, collective_order)


def _global_order(schedule: Schedule) -> tuple[dict[Message, int], dict[int, list[float]]]:
    """Each message's position (by simulated send time), and each stage's SYNC times."""
    compiled = compile_schedule(schedule)
    split = schedule.split_backward
    cost = CostModel.unit(1.0, 2.0, 1.0, 1.0) if split else CostModel.unit(1.0, 2.0)
    times = compiled.times(cost)
    sends, syncs = [], {}
    for i, (_, a) in enumerate(compiled.order):
        if a.op in (Op.SEND_F, Op.SEND_B):
            sends.append((times.start[i], i, Message.of(a, schedule.stages)))
        elif a.op is Op.SYNC:
            syncs.setdefault(a.stage, []).append(times.start[i])
    sends.sort()
    return {msg: k for k, (_, _, msg) in enumerate(sends)}, syncs


def _place_posts(schedule: Schedule, rank: int, prog, order: dict[Message, int]) -> list[Step]:
    """``prog`` with a Post before the first point where it may go (see module docstring)."""
    stages = schedule.stages
    received = [Message.of(a, stages) for a in prog if a.op in (Op.RECV_F, Op.RECV_B)]
    incoming = sorted((order[msg], msg) for msg in received)
    out: list[Step] = []
    k = 0
    for a in prog:
        if a.op in (Op.SEND_F, Op.SEND_B):
            limit = order[Message.of(a, stages)]  # receives earlier than this send go before it
        elif a.op in (Op.RECV_F, Op.RECV_B):
            limit = order[Message.of(a, stages)] + 1  # at the latest, right before its wait
        else:
            limit = -1
        while k < len(incoming) and incoming[k][0] < limit:
            out.append(Post(incoming[k][1]))
            k += 1
        out.append(a)
    if k != len(incoming):  # cannot happen for a validated schedule: every RECV posts
        raise ScheduleError(f"rank {rank}: receives {incoming[k][1]} and later were never posted")
    return out


def _place_launches(schedule: Schedule, rank: int, steps: list[Step],
                    collective_order: tuple[int, ...]) -> tuple[list[Step], frozenset]:
    """Launch each held replica's allreduce at its SYNC, in the global order of stages."""
    held = {stage: (pipe, stage) for pipe, stage in schedule.placement.held(rank)}
    synced = [a for a in steps if isinstance(a, Action) and a.op is Op.SYNC]
    if len({a.stage for a in synced}) != len(synced):
        raise ScheduleError(f"rank {rank} holds two replicas of one stage; their allreduces "
                            "would not match across the stage's group")
    queue = _LaunchQueue([held[s] for s in collective_order
                          if s in held and any(a.stage == s for a in synced)])
    out: list[Step] = []
    early: set[Action] = set()
    last_grad = _last_gradient_actions(schedule, steps)
    for a in steps:
        if not isinstance(a, Action):
            out.append(a)
        elif a.op is Op.STEP:  # everything left goes out before the step waits for it
            out += queue.due(everything=True)
            out.append(a)
        else:
            if a in last_grad and queue.is_next(a.stage):
                early.add(a)  # every earlier allreduce is out: buckets may go inside a
            out.append(a)
            if a.op is Op.SYNC:
                out += queue.due(ready=a.stage)
    return out, frozenset(early)


class _LaunchQueue:
    """A rank's replicas in the global order of their allreduces: one launches once it is
    ready and every replica before it has launched."""

    def __init__(self, replicas: list[tuple[int, int]]):
        self.replicas, self.ready, self.launched = replicas, set(), 0

    def is_next(self, stage: int) -> bool:
        return self.launched < len(self.replicas) and self.replicas[self.launched][1] == stage

    def due(self, ready: int | None = None, everything: bool = False) -> list[Launch]:
        """Mark ``ready`` (a stage), then the launches now due, in order."""
        if everything:
            self.ready.update(stage for _, stage in self.replicas)
        elif ready is not None:
            self.ready.add(ready)
        out = []
        while self.launched < len(self.replicas) and self.replicas[self.launched][1] in self.ready:
            out.append(Launch(*self.replicas[self.launched]))
            self.launched += 1
        return out


def _last_gradient_actions(schedule: Schedule, steps: list[Step]) -> set[Action]:
    """The B actions after which a replica's gradients are final (buckets may reduce inside)."""
    grad = finishing_op(schedule.split_backward)
    last: dict[tuple[int, int], Action] = {}
    for a in steps:
        if isinstance(a, Action) and a.op is grad:
            last[(a.pipe, a.stage)] = a
    return {a for a in last.values() if a.op is Op.B}
