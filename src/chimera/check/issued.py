"""The ``torch.distributed`` calls a rank makes executing a CommPlan, as data (no torch).

:func:`issued_ops` lists, for one global rank, every call in the order the runtime makes it
(:class:`~chimera.runtime.p2p.Mailbox`, :class:`~chimera.runtime.sync.GradSync`, the shards,
``PipelineRuntime.gather_parameters``): posts, sends, waits, and the stage collectives with
their sizes, buckets as separate collectives. :mod:`chimera.check.rendezvous` replays them under
NCCL's rules; a test records the real runtime's calls and compares them with these. What a
replica's collectives are (kinds, sizes, buckets, when) is :mod:`chimera.collectives`', read by
the runtime too; this module places them in the rank's sequence of calls.

**Tensor parallelism** (``tensor_parallel=T``, global rank ``(w*D + d)*T + t``): the T ranks
of a pipeline rank run its program in lockstep, so each is pipeline rank ``d``'s calls with
its peers and groups moved to its own t (p2p to (d', t), a stage's group over its replicas
at t), plus the collectives its layers issue inside each compute: :data:`TP` on the TP
group's own communicator, blocking (the layer waits for it before it goes on) and issued in
program order. One call and its wait per F, B and I (a layer's several collectives on one
group, each waited for before the next, complete together or not at all; W has none), after
the buckets a last backward issues (the gradient hooks fire before the earlier layers'
backward collectives: the latest place, the most a collective can wait behind).
"""

from __future__ import annotations

from dataclasses import dataclass

from chimera.check.comm_plan import CommPlan, Launch, Message, Post
from chimera.collectives import (AFTER_STEP, ALL_GATHER, ALL_REDUCE, AT_LAUNCH, IN_BACKWARD,
                                 REDUCE_SCATTER, Choices, replica_collectives)
from chimera.ir import Action, Op, Schedule
from chimera.check.validation_error import ValidationError

ISEND, IRECV, WAIT = "isend", "irecv", "wait"
TP = "tensor_parallel"  # the collectives a compute's TP layers issue on the TP group
TP_OPS = (Op.F, Op.B, Op.I)  # the computes that issue them (W reads kept nodes: none)
# collectives only a recorded run has (start-up, the trainer's and the API's own calls)
OTHERS = ("broadcast", "broadcast_object_list", "all_gather_object", "barrier")
COLLECTIVES = (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, TP) + OTHERS


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
    size: int = 0  # a collective: elements of its buffer (a reduce-scatter's input)

    def describe(self, calls: list["Issued"]) -> str:
        if self.kind == ISEND:
            return f"isend {self.message} to rank {self.peer}"
        if self.kind == IRECV:
            return f"irecv {self.message} from rank {self.peer}"
        if self.kind == TP:
            return (f"tensor-parallel collectives of stage {self.stage}'s layers over ranks "
                    f"{ranks_text(self.group)}")
        if self.kind in COLLECTIVES:
            name = {ALL_REDUCE: "allreduce", REDUCE_SCATTER: "reduce-scatter",
                    ALL_GATHER: "parameter all-gather"}.get(self.kind, self.kind)
            return (f"{name} of stage {self.stage} ({self.size} elements) over ranks "
                    f"{ranks_text(self.group)}")
        return f"wait for {calls[self.target].describe(calls)}"


def group_key(c: Issued) -> tuple:
    """The communicator a collective runs on: its stage's group (one per stage and TP
    position: the members tell them apart), or the TP group (a recorded call: its group)."""
    return (TP, c.group) if c.kind == TP else (c.stage, c.group)


def stage_group(schedule: Schedule, stage: int, data_parallel: int = 1) -> tuple[int, ...]:
    """Global ranks of the replica group of ``stage`` (as ``ProcessGrid.build_groups``)."""
    depth = schedule.ranks
    return tuple(sorted({w * depth + d for w in range(data_parallel)
                         for d in schedule.placement.replicas(stage)}))


SYNTHETIC: dict[int, tuple[int, ...]] = {}  # no sizes given: every stage two buckets of one


def bucket_sizes(sizes: dict[int, tuple[int, ...]] | None, stage: int) -> tuple[int, ...]:
    """Element counts of ``stage``'s gradient buckets in launch order (their sum: the flat
    buffer); () for a stage with nothing to train. Without ``sizes``, (1, 1): enough to tell
    a bucketed replica (two collectives) from an unbucketed one (one of two elements)."""
    if sizes is None or stage not in sizes:
        return (1, 1)
    return tuple(sizes[stage])


def issued_ops(plan: CommPlan, rank: int, data_parallel: int = 1, buckets: bool = True,
               sharded: bool = False, sizes: dict[int, tuple[int, ...]] | None = None,
               tensor_parallel: int = 1) -> list[Issued]:
    """The ``torch.distributed`` calls global ``rank`` makes, in order, executing ``plan``
    (with ``tensor_parallel`` T > 1: ``rank`` is (w*D + d)*T + t, its layers' TP collectives
    included; module docstring).

    ``buckets``: the runtime reduces a replica bucket by bucket inside its last backward
    where ``plan.early`` allows (the device plan, :func:`chimera.runtime.sync.comm_choices`);
    False: one allreduce at its Launch (the CPU plan). ``sharded``: the optimizer is sharded
    over each stage group (module docstring); the calls of two iterations. ``sizes``: per
    stage its buckets' element counts (:func:`bucket_sizes`)."""
    depth, pipeline_rank = plan.schedule.ranks, rank // tensor_parallel
    calls = pipeline_calls(plan, pipeline_rank % depth, data_parallel, buckets, sharded, sizes,
                           tensor_parallel > 1)
    calls = shifted(calls, (pipeline_rank // depth) * depth)
    return at_tp_position(calls, pipeline_rank, rank % tensor_parallel, tensor_parallel)


def shifted(calls: list[Issued], base: int) -> list[Issued]:
    """``calls`` of pipeline copy 0 as made in the copy whose first global rank is ``base``."""
    if base == 0:
        return calls
    return [Issued(c.kind, c.step, c.peer + base, c.message, c.group, c.stage, c.target, c.size)
            if c.peer >= 0 else c for c in calls]


def at_tp_position(calls: list[Issued], pipeline_rank: int, t: int, tp: int) -> list[Issued]:
    """The calls of pipeline rank ``pipeline_rank`` (global rank w*D + d, made with
    ``tp_layers``) as made by its TP position ``t`` of ``tp``: peers and stage groups at t, its
    TP collectives on the group of the T ranks (unchanged at T = 1)."""
    if tp == 1:
        return calls
    mine = tuple(pipeline_rank * tp + u for u in range(tp))
    out = []
    for c in calls:
        if c.kind == TP:
            out.append(Issued(TP, c.step, group=mine, stage=c.stage, size=c.size))
        elif c.peer >= 0 or c.group:
            out.append(Issued(c.kind, c.step, c.peer * tp + t if c.peer >= 0 else -1, c.message,
                              tuple(g * tp + t for g in c.group), c.stage, c.target, c.size))
        else:
            out.append(c)
    return out


def pipeline_calls(plan: CommPlan, d: int, data_parallel: int, buckets: bool,
                    sharded: bool = False, sizes=None, tp_layers: bool = False) -> list[Issued]:
    """The calls of pipeline rank ``d`` in copy 0 (the other copies differ only in peers);
    ``tp_layers``: with its layers' TP collectives (groups left to :func:`at_tp_position`)."""
    calls: list[Issued] = []
    gathers: dict[tuple[int, int], int] = {}  # replica -> its all-gather not waited for yet
    it = _Iteration(calls, gathers, plan, d, data_parallel, sizes, sharded, tp_layers)
    for _ in range(2 if sharded else 1):
        it.run(buckets)
    return calls


class _Iteration:
    """Appends the calls of one iteration of pipeline rank ``d``: each replica's collectives
    (:func:`chimera.collectives.replica_collectives`) where they are issued; with ``sharded``,
    a replica's first forward waits for its pending all-gather, and the iteration ends with
    the next all-gathers; with ``tp_layers``, each F, B and I issues its layers' TP
    collectives and waits for them."""

    def __init__(self, calls, gathers, plan: CommPlan, d: int, data_parallel: int, sizes,
                 sharded: bool, tp_layers: bool = False):
        self.calls, self.gathers, self.plan, self.d = calls, gathers, plan, d
        self.dp, self.sizes, self.sharded, self.tp_layers = data_parallel, sizes, sharded, tp_layers

    def collectives(self, key: tuple[int, int], buckets: bool, early: set) -> tuple:
        """What replica ``key`` issues: the device plan's choices (``buckets``: bucketing
        allowed at all; a sharded replica reduce-scatters), as the runtime's."""
        choices = Choices(1 if buckets else 0, True)
        members = len(stage_group(self.plan.schedule, key[1], self.dp))
        return replica_collectives(bucket_sizes(self.sizes, key[1]), members, choices,
                                   early=key in early, sharded=self.sharded)

    def run(self, buckets: bool) -> None:
        calls, s, d = self.calls, self.plan.schedule, self.d
        early = {(a.pipe, a.stage) for a in self.plan.early[d]}
        mine = {key: self.collectives(key, buckets, early) for key in s.placement.held(d)}
        posted: dict[Message, int] = {}
        sends: list[int] = []  # STEP waits for the sends, then the collectives (Executor._step)
        waits: list[int] = []
        for i, step in enumerate(self.plan.steps[d]):
            if isinstance(step, Post):
                posted[step.message] = len(calls)
                calls.append(Issued(IRECV, i, step.message.ranks(s)[0], step.message))
            elif isinstance(step, Launch):
                self._issue(waits, i, step.stage, mine[(step.pipe, step.stage)], AT_LAUNCH)
            elif step.op in (Op.SEND_F, Op.SEND_B):
                msg = Message.of(step, s.stages)
                sends.append(len(calls))
                calls.append(Issued(ISEND, i, msg.ranks(s)[1], msg))
            elif step.op in (Op.RECV_F, Op.RECV_B):
                calls.append(Issued(WAIT, i, target=_posted(self.plan, d, i, step, posted)))
            elif step.op is Op.F and (step.pipe, step.stage) in self.gathers:
                calls.append(Issued(WAIT, i, target=self.gathers.pop((step.pipe, step.stage))))
            elif step.op is Op.B and step in self.plan.early[d]:
                self._issue(waits, i, step.stage, mine[(step.pipe, step.stage)], IN_BACKWARD)
            elif step.op is Op.STEP:
                calls += [Issued(WAIT, i, target=t) for t in sends + waits]
                self._gather_parameters(i, mine)
            if self.tp_layers and isinstance(step, Action) and step.op in TP_OPS:
                calls.append(Issued(TP, i, stage=step.stage, size=1))
                calls.append(Issued(WAIT, i, target=len(calls) - 1))

    def _issue(self, waits: list[int], i: int, stage: int, collectives, when: str) -> None:
        for c in collectives:
            if c.when == when:
                self._collective(waits, c.kind, i, stage, c.size)

    def _gather_parameters(self, i: int, mine: dict) -> None:
        """As ``PipelineRuntime.gather_parameters`` after the optimizer step: wait for gathers
        no forward waited for, then the all-gathers of the replicas that have one, stages in
        order."""
        calls = self.calls
        calls += [Issued(WAIT, i, target=t) for t in self.gathers.values()]
        self.gathers.clear()
        for key in sorted(mine, key=lambda k: (k[1], k[0])):
            for c in mine[key]:
                if c.when == AFTER_STEP:
                    self.gathers[key] = len(calls)
                    self._collective([], c.kind, i, key[1], c.size)

    def _collective(self, issued: list[int], kind: str, i: int, stage: int, size: int) -> None:
        """Append ``kind`` over ``stage``'s group (and its index to ``issued``)."""
        issued.append(len(self.calls))
        self.calls.append(Issued(kind, i, group=stage_group(self.plan.schedule, stage, self.dp),
                                 stage=stage, size=size))


def _posted(plan: CommPlan, d: int, i: int, step: Action, posted: dict[Message, int]) -> int:
    msg = Message.of(step, plan.schedule.stages)
    if msg not in posted:
        raise ValidationError(f"rank {d}: {step} waits for a receive that was never posted",
                              plan.schedule, d, action_index(plan.steps[d], i))
    return posted.pop(msg)


def action_index(steps, step: int) -> int:
    """Index in the rank's program of the action to mark for ``steps[step]``: itself, the
    action a Launch follows (its SYNC or last backward), or the action a Post precedes."""
    before = sum(1 for x in steps[:step] if isinstance(x, Action))
    return max(0, before - 1) if isinstance(steps[step], Launch) else before


def ranks_text(ranks) -> str:
    return ", ".join(map(str, ranks))
