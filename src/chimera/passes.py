"""Lowering passes: add p2p communication, gradient-sync points and the optimizer step."""

from __future__ import annotations

from chimera.ir import (GRADIENT_ENDS, Action, Op, Schedule, ScheduleError, input_stage, output_stage,
                        recv_of, send_of)

SYNC_MODES = ("eager", "end")


def add_communication(schedule: Schedule) -> Schedule:
    """Insert SEND/RECV for every dependency that crosses ranks.

    A producer's SEND follows it immediately (sends are asynchronous); a consumer's RECV goes
    right before it, so the runtime can post the receive early and wait only there.
    """
    stages, table = schedule.stages, schedule.placement.table
    programs = []
    for rank, prog in enumerate(schedule.programs):
        out: list[Action] = []
        for a in prog:
            src, dst = input_stage(a, stages), output_stage(a, stages)
            if src is not None and table[a.pipe][src] != rank:
                out.append(recv_of(a))
            out.append(a)
            if dst is not None and table[a.pipe][dst] != rank:
                out.append(send_of(a))
        programs.append(out)
    return schedule.with_programs(programs)


def add_sync(schedule: Schedule, mode: str = "eager") -> Schedule:
    """Insert one SYNC per stage replica and a final STEP on every rank.

    ``eager``: right after the replica's last gradient-producing action on the rank (B or W:
    a schedule may mix whole and split backwards), so the allreduce overlaps the remaining bubbles. ``end``: after
    all of the rank's actions.
    """
    if mode not in SYNC_MODES:
        raise ScheduleError(f"unknown sync mode {mode!r}; choose one of {', '.join(SYNC_MODES)}")
    programs = []
    for rank, prog in enumerate(schedule.programs):
        last_grad: dict[tuple[int, int], int] = {}
        for i, a in enumerate(prog):
            if a.op in GRADIENT_ENDS:
                last_grad[(a.pipe, a.stage)] = i
        # a replica whose pipe got no micro-batch (N=1 on two pipes) still joins its stage's
        # allreduce, at the end: its peers wait for it, and it must receive their gradients
        for key in schedule.placement.held(rank):
            last_grad.setdefault(key, len(prog) - 1)
        syncs = sorted((i, Action(Op.SYNC, p, s)) for (p, s), i in last_grad.items())
        out = list(prog)
        if mode == "eager":
            for i, sync in reversed(syncs):
                # after the SEND that follows the gradient action, so the peer is not delayed
                j = i + 1
                while j < len(out) and out[j].op in (Op.SEND_B, Op.SEND_F):
                    j += 1
                out.insert(j, sync)
        else:
            out += [sync for _, sync in syncs]
        out.append(Action(Op.STEP))
        programs.append(out)
    return schedule.with_programs(programs)


def lower(schedule: Schedule, sync: str = "eager") -> Schedule:
    """The full lowering the runtime and the simulator consume."""
    if schedule.lowered:
        raise ScheduleError("schedule is already lowered")
    return add_sync(add_communication(schedule), sync)
