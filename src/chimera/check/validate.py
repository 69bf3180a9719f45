"""Validator: counts, per-rank dependency order, matched communication, a deadlock dry run,
and, for lowered schedules, a rendezvous replay of the runtime's calls under NCCL's rules
(:mod:`chimera.check.rendezvous`).

Every failure raises :class:`ValidationError` whose message ends with the rank-by-slot grid
of the schedule, the offending action marked.
"""

from __future__ import annotations

from collections import Counter

from chimera.check import comm_plan, rendezvous
from chimera.ir import Action, Op, Schedule, input_stage, needs, other_end, recv_of
from chimera.sim.engine import Deadlock, simulate
from chimera.check.validation_error import ValidationError

__all__ = ["ValidationError", "validate"]


def validate(schedule: Schedule, tensor_parallel: int = 1) -> Schedule:
    """Check ``schedule`` (lowered or not); return it unchanged if it is valid.
    ``tensor_parallel``: T ranks run each pipeline rank's program, their layers' collectives
    inside its computes (the rendezvous replay models them: T = 2 stands for any T > 1)."""
    _check_placement(schedule)
    _check_counts(schedule)
    _check_order(schedule)
    if schedule.lowered:
        _check_comm(schedule)
    _dry_run(schedule)
    if schedule.lowered:
        _check_rendezvous(schedule, tensor_parallel)
    return schedule


def _check_placement(s: Schedule) -> None:
    for rank, i, a in s.actions():
        if a.op is Op.STEP:
            continue
        if not (0 <= a.pipe < s.placement.pipes and 0 <= a.stage < s.stages):
            raise ValidationError(f"rank {rank}: {a} names a pipe or stage that does not exist", s, rank, i)
        if s.placement.rank_of(a.pipe, a.stage) != rank:
            raise ValidationError(f"rank {rank}: {a} belongs on rank "
                                  f"{s.placement.rank_of(a.pipe, a.stage)}", s, rank, i)
        if a.op is not Op.SYNC and not (0 <= a.micro < s.micro_batches):
            raise ValidationError(f"rank {rank}: {a} names micro-batch outside 0..{s.micro_batches - 1}",
                                  s, rank, i)
        if a.op is not Op.SYNC and a.micro >= 0 and s.micro_pipe[a.micro] != a.pipe:
            raise ValidationError(f"rank {rank}: micro-batch {a.micro} belongs to pipe "
                                  f"{s.micro_pipe[a.micro]}, not {a.pipe}", s, rank, i)


def _check_counts(s: Schedule) -> None:
    seen = Counter((a.op, a.pipe, a.stage, a.micro) for _, _, a in s.actions() if a.op.is_compute)
    for m, p in enumerate(s.micro_pipe):
        for stage in range(s.stages):
            # a split schedule may run some backwards whole (torch's DualPipeV runs B where
            # it overlaps a forward, I and W elsewhere): per micro-batch and stage, B or I+W
            split = s.split_backward and (Op.B, p, stage, m) not in seen
            for op in (Op.F, Op.I, Op.W) if split else (Op.F, Op.B):
                n = seen.pop((op, p, stage, m), 0)
                if n != 1:
                    rank = s.placement.rank_of(p, stage)
                    raise ValidationError(f"rank {rank}: {Action(op, p, stage, m)} appears {n} times "
                                          f"(expected once)", s, rank, None)
    if seen:
        (op, p, stage, m), _ = next(iter(seen.items()))
        raise ValidationError(f"unexpected action {Action(op, p, stage, m)} (mixed B and I/W, "
                              f"or a stray action)", s)


def _check_order(s: Schedule) -> None:
    """What an action needs from its own stage (always on its rank) comes before it; inputs
    from other stages are the dry run's to check."""
    stages, split = s.stages, s.split_backward
    for rank, prog in enumerate(s.programs):
        done: set[Action] = set()
        for i, a in enumerate(prog):
            for need in needs(a, stages, split):
                if need.stage == a.stage and need not in done:
                    raise ValidationError(f"rank {rank}: {a} comes before its {need.op.value}",
                                          s, rank, i)
            done.add(a)


def _check_comm(s: Schedule) -> None:
    """Every SEND has exactly one RECV on the peer, and every cross-rank input is received."""
    sends = Counter(a for _, _, a in s.actions() if a.op in (Op.SEND_F, Op.SEND_B))
    recvs = Counter(a for _, _, a in s.actions() if a.op in (Op.RECV_F, Op.RECV_B))
    awaited: Counter[Action | None] = Counter()  # the sends the receives wait for
    stages = s.stages
    for rank, i, a in s.actions():
        if a.op in (Op.RECV_F, Op.RECV_B):
            src = other_end(a, stages)
            if recvs[a] != 1 or sends.get(src, 0) != 1:
                raise ValidationError(f"rank {rank}: {a} has no matching send (or is duplicated)",
                                      s, rank, i)
            awaited[src] += 1
    for send, n in sends.items():
        if awaited[send] != n:
            raise ValidationError(f"{send} is never received", s)
    _check_received_before_use(s)


def _check_received_before_use(s: Schedule) -> None:
    place, stages = s.placement, s.stages
    for rank, prog in enumerate(s.programs):
        got: set[Action] = set()
        for i, a in enumerate(prog):
            if a.op in (Op.RECV_F, Op.RECV_B):
                got.add(a)
            src = input_stage(a, stages)
            if src is not None and place.rank_of(a.pipe, src) != rank and recv_of(a) not in got:
                raise ValidationError(f"rank {rank}: {a} runs before its {recv_of(a).op.value} input "
                                      f"arrives", s, rank, i)


def _dry_run(s: Schedule) -> None:
    try:
        simulate(s)
    except Deadlock as exc:
        rank = min(exc.blocked)
        index, action = exc.blocked[rank]
        waits = "; ".join(f"rank {r} at {a}" for r, (_, a) in sorted(exc.blocked.items()))
        raise ValidationError(f"deadlock: no rank can proceed ({waits})", s, rank, index) from None


def _check_rendezvous(s: Schedule, tensor_parallel: int = 1) -> None:
    """The runtime's calls for ``s`` (its CommPlan) finish under NCCL's rules in every stream
    model, the strictest last (one stream per rank for p2p and collectives together),
    communicators created eagerly, with the device plan's buckets (two per stage: a member
    that bucketed where another did not is a CollectiveMismatch). Two data-parallel copies:
    then every stage group reduces (with one copy, single-replica stages issue nothing), and
    more copies run in lock-step with these two. Also with the optimizer sharded (two
    iterations: the parameter all-gathers after STEP are waited for inside the next one).
    With tensor parallelism, two TP ranks per pipeline rank: its members are symmetric, so
    more run in lock-step with these two (:mod:`chimera.check.rendezvous`)."""
    plan = comm_plan.plan_comm(s)
    tp = min(tensor_parallel, 2)
    for mode in rendezvous.MODES:
        for sharded in (False, True):
            rendezvous.check(plan, mode, data_parallel=2, buckets=True, sharded=sharded,
                             tensor_parallel=tp)
