"""Faults: explaining a hang or a dead peer, and injecting faults on purpose (drills).

**Explaining.** A p2p or collective wait that times out or fails (a peer died) raises
:class:`CommTimeout` naming the rank, the action and the peer. :func:`explain` adds the
schedule grid with this rank's position marked and, best effort, where every other rank
was: each failing rank posts its position to the rendezvous store and waits up to
``GRACE_S`` for the others' before it exits.

**Drills.** ``--fault`` (``CHIMERA_FAULT``; the run context's ``RuntimeOptions.fault``;
comma-separated) makes a run fail the way real ones do, so tests (and a new cluster) can
check that failures end runs promptly and restarts resume:

- ``kill:R:S``   global rank R kills itself with SIGKILL at the start of step S, on the
                 first attempt only (``TORCHELASTIC_RESTART_COUNT`` unset or 0)
- ``nan:R:S``    rank R's gradients become NaN at step S (a non-finite loss)
- ``deadlock:R`` rank R waits for its last receive first: a mismatched schedule
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import time

from chimera.check.comm_plan import Message, Post
from chimera.errors import UserError
from chimera.ir import Action, Op, Schedule
from chimera.runtime.p2p import CommTimeout, peers_text
from chimera.runtime.transport import Transport

ENV = "CHIMERA_FAULT"
GRACE_S = 1.5  # how long a failing rank waits for the others' positions
_KINDS = {"kill": 2, "nan": 2, "deadlock": 1}


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int = -1


def parse(text: str | None) -> list[Fault]:
    """``"kill:1:3,nan:0:2"`` -> faults; ValueError on anything else."""
    faults = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        kind, *numbers = part.split(":")
        if kind not in _KINDS or len(numbers) != _KINDS[kind] or not all(n.isdigit() for n in numbers):
            raise UserError(f"--fault ({ENV}) {text!r}: expected kill:RANK:STEP, nan:RANK:STEP or "
                             f"deadlock:RANK (comma-separated), got {part!r}")
        faults.append(Fault(kind, *map(int, numbers)))
    return faults


def active(spec: str) -> list[Fault]:
    """The faults of a run's ``fault`` option."""
    return parse(spec)


def _first_attempt() -> bool:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def before_step(rank: int, step: int, spec: str) -> None:
    """``kill``: die here, as a crashed worker does (no exception, no cleanup)."""
    for f in active(spec):
        if f.kind == "kill" and (f.rank, f.step) == (rank, step) and _first_attempt():
            os.kill(os.getpid(), signal.SIGKILL)


def grad_hook(rank: int, step: int, spec: str):
    """``nan``: an ``on_grads`` callback for ``Trainer.step`` that poisons the gradients."""
    if not any(f.kind == "nan" and (f.rank, f.step) == (rank, step) for f in active(spec)):
        return None

    def poison(trainer) -> None:
        for p in trainer.params:
            if p.grad is not None:
                p.grad.fill_(float("nan"))
    return poison


def program_for(program: tuple, schedule: Schedule, rank: int, spec: str) -> tuple:
    """``deadlock``: rank ``rank``'s steps (a CommPlan's) with its last receive, posted and
    waited for, moved to the front: it waits for a message its peer sends only later."""
    if not any(f.kind == "deadlock" and f.rank == rank for f in active(spec)):
        return program
    recvs = [i for i, a in enumerate(program) if isinstance(a, Action)
             and a.op in (Op.RECV_F, Op.RECV_B)]
    if not recvs:
        return program
    wait = program[recvs[-1]]
    post = next(s for s in program if isinstance(s, Post) and s.message == Message.of(wait, schedule.stages))
    rest = [s for s in program if s is not wait and s is not post]
    return (post, wait, *rest)


# -- explaining -------------------------------------------------------------------------
def collective(transport: Transport, what: str, fn, *args, **kwargs):
    """Run a blocking collective of ``transport``; a failure or timeout becomes a CommTimeout
    naming ``what`` and the peers it waited on (any of them may be the one that died)."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:
        rank = transport.get_rank() if transport.is_initialized() else 0
        peers = _peers(transport, rank, kwargs.get("group"))
        raise CommTimeout(f"rank {rank}: {what} with {peers} failed or "
                          f"timed out: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                          rank=rank, what=what) from exc


def _peers(transport: Transport, rank: int, group) -> str:
    try:
        ranks = transport.get_process_group_ranks(group) if group is not None else \
            range(transport.get_world_size())
    except (RuntimeError, ValueError):  # the group is already gone
        return "its peers"
    return peers_text(rank, ranks)


def explain(exc: CommTimeout, schedule: Schedule, grid, transport: Transport) -> CommTimeout:
    """``exc`` with the grid of ``schedule`` and where each rank stood appended (posted to
    ``transport``'s rendezvous store)."""
    program = schedule.programs[grid.d]
    index = _index_of(program, exc.action)
    here = str(program[index]) if exc.action is not None else f"{exc.what or 'a collective'} at STEP"
    positions = _gather_positions(transport, grid.rank, grid.world, f"#{index} {here}")
    lines = [str(exc).splitlines()[0],
             f"schedule {schedule.name}, pipeline rank P{grid.d} (data replica {grid.w}); "
             "the grid shows program order, this rank's position marked:",
             _picture(schedule, grid.d, index)]
    if positions:
        lines.append("where each rank was (global rank: action # in its program):")
        lines += [f"  rank {r}: {positions.get(r, 'no report (exited, killed, or still running)')}"
                  for r in range(grid.world)]
    return CommTimeout("\n".join(lines), rank=exc.rank, action=exc.action, peer=exc.peer,
                       what=exc.what)


def _index_of(program, action) -> int:
    if action is not None and action in program:
        return program.index(action)
    steps = [i for i, a in enumerate(program) if a.op is Op.STEP]
    return steps[0] if steps else len(program) - 1


def _picture(schedule: Schedule, d: int, index: int) -> str:
    """The program grid with ``index`` marked; a failure to draw never hides the error
    being reported."""
    from chimera.viz.grid import render_programs

    try:
        return render_programs(schedule, mark=(d, index))
    except Exception as err:  # noqa: BLE001 -- best effort
        return f"(no picture: {err})"


def _gather_positions(transport: Transport, rank: int, world: int, mine: str) -> dict[int, str]:
    """Post our position to the rendezvous store; read the others' (best effort, bounded)."""
    try:
        store = transport.store()
        store.set_timeout(datetime.timedelta(seconds=GRACE_S))
        store.set(f"chimera/position/{rank}", mine)
        keys = [f"chimera/position/{r}" for r in range(world)]
        deadline = time.monotonic() + GRACE_S
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        return {r: store.get(k).decode() for r, k in enumerate(keys) if store.check([k])}
    except Exception:  # the store's host may be the dead rank: the picture is best effort
        return {}

