"""The schedule IR: actions, placements and schedules as plain values (no torch).

Glossary (used the same way everywhere in the package):

- **rank**: one worker of a pipeline group, ``0 .. D-1``. With data parallelism the global
  rank is ``w * D + d``; the IR only speaks of the D ranks of one group.
- **stage**: a contiguous slice of the model's layers, ``0 .. S-1``. Usually ``S = D``;
  interleaved and V placements cut the model into more, smaller stages.
- **pipe**: one pipeline, i.e. one mapping of every stage onto a rank. Chimera has two: the
  *down* pipe (pipe 0, stage s on rank s) and the *up* pipe (pipe 1, stage s on rank D-1-s).
- **replica**: the copy of a stage that one pipe keeps on one rank. A stage has one replica
  per pipe; the gradients of all replicas of a stage are summed before the optimizer step.
- **micro-batch**: ``0 .. N-1`` within one iteration; each belongs to exactly one pipe.
- **unit**: Chimera's basic scheduling unit of N = D micro-batches.
- **Ma / Mθ**: activation memory of one micro-batch on one D-th of the model, and the
  weight memory of one D-th of the model; the simulator reports memory in these units.

An :class:`Action` prints compactly (``p0s1F3``: pipe 0, stage 1, forward of micro-batch 3)
and parses back with :meth:`Action.parse`; a :class:`Schedule` round-trips through JSON.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterable, Iterator

from chimera.errors import UserError


class ScheduleError(UserError):
    """A schedule, placement or generator argument is invalid."""


class Op(str, enum.Enum):
    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # noqa: E741 -- input-gradient half of B (what the previous stage waits for)
    W = "W"  # weight-gradient half of B
    SEND_F = "SEND_F"  # activation to the next stage
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"  # input gradient to the previous stage
    RECV_B = "RECV_B"
    SYNC = "SYNC"  # start of the allreduce of one stage replica's gradients
    STEP = "STEP"  # optimizer step (after all SYNCs of this rank completed)

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_OPS

    def __str__(self) -> str:
        return self.value


COMPUTE_OPS = frozenset({Op.F, Op.B, Op.I, Op.W})
BACKWARD_OPS = frozenset({Op.B, Op.I})  # the ops that produce an input gradient
_ACTION_RE = re.compile(r"^(?:p(\d+)s(\d+))?([A-Z_]+?)(\d+)?$")


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank's program. ``micro`` is -1 for SYNC and STEP; STEP has no stage."""

    op: Op
    pipe: int = -1
    stage: int = -1
    micro: int = -1

    def __str__(self) -> str:
        where = f"p{self.pipe}s{self.stage}" if self.stage >= 0 else ""
        micro = str(self.micro) if self.micro >= 0 else ""
        return f"{where}{self.op.value}{micro}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        match = _ACTION_RE.match(text.strip())
        if not match or match.group(3) not in Op.__members__:
            raise ScheduleError(f"cannot parse action {text!r} (expected e.g. 'p0s1F3')")
        pipe, stage, op, micro = match.groups()
        has_where, has_micro = stage is not None, micro is not None
        want_where, want_micro = op != "STEP", op not in ("STEP", "SYNC")
        if (has_where, has_micro) != (want_where, want_micro):
            raise ScheduleError(f"cannot parse action {text!r}: {op} takes "
                                f"{'pipe and stage' if want_where else 'no pipe or stage'}"
                                f"{' and a micro-batch' if want_micro else ''}")
        return cls(
            Op(op),
            int(pipe) if pipe is not None else -1,
            int(stage) if stage is not None else -1,
            int(micro) if micro is not None else -1,
        )

    @property
    def key(self) -> tuple[int, int, int]:
        """(pipe, stage, micro): the work item this action belongs to."""
        return (self.pipe, self.stage, self.micro)


# -- the dependency rule: what an action needs, what it sends, what frees activations ---------
def finishing_op(split_backward: bool) -> Op:
    """The op that ends a micro-batch's work on a stage: it frees the activations the forward
    kept and produces the last of the stage's weight gradient (W when backward is split, B
    otherwise). Memory accounting, eager gradient sync and the list schedulers' windows all
    count on it."""
    return Op.W if split_backward else Op.B


# The ops that end a micro-batch's work on a stage in any schedule: W of a split backward, B of
# a whole one. A schedule may mix the two per micro-batch (torch's DualPipeV runs B where it
# overlaps a forward and I/W elsewhere), so what frees activations and what a stage's eager
# allreduce waits for is either.
GRADIENT_ENDS = frozenset({Op.B, Op.W})


def needs(action: Action, stages: int, split_backward: bool) -> tuple[Action, ...]:
    """The compute actions (same pipe and micro-batch) that must have run before ``action``:
    F(s) needs F(s-1); B(s) or I(s) needs F(s) and the input gradient of stage s+1 (its B, or
    its I when backward is split); W(s) needs I(s). Communication, SYNC and STEP need nothing
    here (their order is the lowering passes' business)."""
    op, p, s, m = action.op, action.pipe, action.stage, action.micro
    if op is Op.F:
        return (Action(Op.F, p, s - 1, m),) if s > 0 else ()
    if op is Op.W:
        return (Action(Op.I, p, s, m),)
    if op in BACKWARD_OPS:
        grad = Op.I if split_backward else Op.B
        return (Action(Op.F, p, s, m),) + ((Action(grad, p, s + 1, m),) if s < stages - 1 else ())
    return ()


def input_stage(action: Action, stages: int) -> int | None:
    """The neighbouring stage whose output ``action`` consumes (an activation for F, an input
    gradient for B and I), or None when it consumes none: the first forward, the last stage's
    backward, W, communication, SYNC and STEP. A message crosses ranks exactly when that
    stage lives on another rank of the pipe."""
    return _input_stage(action.op, action.stage, stages)


def output_stage(action: Action, stages: int) -> int | None:
    """The neighbouring stage that consumes ``action``'s output (the mirror of
    :func:`input_stage`): F(s) feeds s+1, B(s) and I(s) feed s-1."""
    return _output_stage(action.op, action.stage, stages)


# The same, given the op and stage alone: peer_stage asks them without building an Action.
def _input_stage(op: Op, stage: int, stages: int) -> int | None:
    if op is Op.F:
        return stage - 1 if stage > 0 else None
    if op in BACKWARD_OPS:
        return stage + 1 if stage < stages - 1 else None
    return None


def _output_stage(op: Op, stage: int, stages: int) -> int | None:
    if op is Op.F:
        return stage + 1 if stage < stages - 1 else None
    if op in BACKWARD_OPS:
        return stage - 1 if stage > 0 else None
    return None


# The compute op on either end of a message (its output is sent, its input received), and
# how the two ends pair up.
_CARRIES = {Op.RECV_F: Op.F, Op.SEND_F: Op.F, Op.RECV_B: Op.B, Op.SEND_B: Op.B}
_OTHER_END = {Op.RECV_F: Op.SEND_F, Op.SEND_F: Op.RECV_F, Op.RECV_B: Op.SEND_B, Op.SEND_B: Op.RECV_B}


def recv_of(action: Action) -> Action:
    """The RECV that brings F, B or I ``action`` its input from :func:`input_stage` when that
    stage lives on another rank: RECV_F for an activation, RECV_B for an input gradient."""
    op = Op.RECV_F if action.op is Op.F else Op.RECV_B
    return Action(op, action.pipe, action.stage, action.micro)


def send_of(action: Action) -> Action:
    """The SEND that carries F, B or I ``action``'s output to :func:`output_stage` when that
    stage lives on another rank."""
    op = Op.SEND_F if action.op is Op.F else Op.SEND_B
    return Action(op, action.pipe, action.stage, action.micro)


def peer_stage(comm: Action, stages: int) -> int | None:
    """The stage at the other end of a SEND or RECV: the one that consumes what a SEND
    carries, or the one that produced what a RECV waits for; None where the pipe ends (no
    such message exists)."""
    carried = _CARRIES[comm.op]
    if comm.op in (Op.RECV_F, Op.RECV_B):
        return _input_stage(carried, comm.stage, stages)
    return _output_stage(carried, comm.stage, stages)


def other_end(comm: Action, stages: int) -> Action | None:
    """The RECV that matches a SEND, or the SEND that matches a RECV (see :func:`peer_stage`)."""
    stage = peer_stage(comm, stages)
    return None if stage is None else Action(_OTHER_END[comm.op], comm.pipe, stage, comm.micro)


@dataclass(frozen=True)
class OpTimes:
    """Per-stage durations of F, B, I and W, and the p2p hop after each stage.

    The one table of per-op times: a cost model prices it for a placement
    (``chimera.sim.CostModel.op_times``), the list schedulers shape programs with it, the
    makespan bound and the planner's stage costs read it. ``f[s]`` is the forward of one
    micro-batch on stage s; ``hop[s]`` the message from stage s to s + 1 (or back), empty
    when messages are free.
    """

    f: tuple[float, ...]
    b: tuple[float, ...]
    i: tuple[float, ...]
    w: tuple[float, ...]
    hop: tuple[float, ...] = ()

    @classmethod
    def uniform(cls, stages: int, f: float, b: float, i: float | None = None,
                w: float | None = None) -> "OpTimes":
        """Every stage alike; I and W are half of B each unless given."""
        i = b / 2 if i is None else i
        w = b / 2 if w is None else w
        return cls((f,) * stages, (b,) * stages, (i,) * stages, (w,) * stages)

    def of(self, op: Op, stage: int) -> float:
        return {Op.F: self.f, Op.B: self.b, Op.I: self.i, Op.W: self.w}[op][stage]


@dataclass(frozen=True)
class Placement:
    """Maps (pipe, stage) to a rank. ``table[pipe][stage] = rank``."""

    style: str
    ranks: int
    table: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ScheduleError(f"a placement needs at least one rank, got {self.ranks}")
        if not self.table or len({len(row) for row in self.table}) != 1:
            raise ScheduleError("every pipe of a placement must have the same number of stages")
        for row in self.table:
            if any(not 0 <= r < self.ranks for r in row):
                raise ScheduleError(f"placement maps a stage outside ranks 0..{self.ranks - 1}")

    @property
    def pipes(self) -> int:
        return len(self.table)

    @property
    def stages(self) -> int:
        return len(self.table[0])

    def rank_of(self, pipe: int, stage: int) -> int:
        return self.table[pipe][stage]

    def replicas(self, stage: int) -> tuple[int, ...]:
        """Ranks holding a replica of ``stage``, one per pipe, in pipe order."""
        return tuple(row[stage] for row in self.table)

    def held(self, rank: int) -> list[tuple[int, int]]:
        """The (pipe, stage) replicas a rank holds."""
        return list(self._held[rank])

    @cached_property
    def _held(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per rank, its replicas in (pipe, stage) order: simulators ask for every rank often."""
        out: list[list[tuple[int, int]]] = [[] for _ in range(self.ranks)]
        for p, row in enumerate(self.table):
            for s, r in enumerate(row):
                out[r].append((p, s))
        return tuple(map(tuple, out))

    # -- the standard styles --------------------------------------------------------
    @classmethod
    def linear(cls, ranks: int) -> "Placement":
        return cls("linear", ranks, (tuple(range(ranks)),))

    @classmethod
    def loop(cls, ranks: int, chunks: int) -> "Placement":
        """Interleaved virtual stages: stage s on rank s mod D (Megatron)."""
        return cls("loop", ranks, (tuple(s % ranks for s in range(ranks * chunks)),))

    @classmethod
    def v(cls, ranks: int) -> "Placement":
        """Two chunks per rank in a V: stage s on rank s, stage 2D-1-s on rank s."""
        down = list(range(ranks))
        return cls("v", ranks, (tuple(down + down[::-1]),))

    @classmethod
    def chimera(cls, ranks: int, pipes: int = 2) -> "Placement":
        """Q = 2k pipes: k down pipes and k up pipes, pipe j of each shifted by j*D/k ranks."""
        if ranks % 2 or pipes % 2 or pipes < 2 or ranks % pipes:
            raise ScheduleError(
                f"chimera needs an even number of stages divisible by the even number of pipes; "
                f"got stages={ranks}, pipes={pipes}"
            )
        half, shift = pipes // 2, 2 * ranks // pipes
        down = [tuple((s + j * shift) % ranks for s in range(ranks)) for j in range(half)]
        up = [tuple((ranks - 1 - s - j * shift) % ranks for s in range(ranks)) for j in range(half)]
        # interleave so pipe 0 is down, pipe 1 is up, as in the paper's two-pipe figures
        table = tuple(row for pair in zip(down, up) for row in pair)
        return cls("chimera", ranks, table)

    def to_json(self) -> dict:
        return {"style": self.style, "ranks": self.ranks, "table": [list(r) for r in self.table]}

    @classmethod
    def from_json(cls, data: dict) -> "Placement":
        return cls(data["style"], int(data["ranks"]), tuple(tuple(r) for r in data["table"]))


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered programs plus the placement they run on.

    ``micro_pipe[m]`` is the pipe of micro-batch m. ``micro_scale`` is the size of one
    schedule micro-batch relative to the user's micro-batch (0.5 for backward halving, which
    splits each micro-batch in two). ``params`` records how the generator was called.
    """

    name: str
    placement: Placement
    micro_pipe: tuple[int, ...]
    programs: tuple[tuple[Action, ...], ...]
    micro_scale: float = 1.0
    params: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if len(self.programs) != self.placement.ranks:
            raise ScheduleError(
                f"schedule has {len(self.programs)} rank programs for {self.placement.ranks} ranks"
            )
        if any(not 0 <= p < self.placement.pipes for p in self.micro_pipe):
            raise ScheduleError("a micro-batch is assigned to a pipe the placement lacks")

    @property
    def ranks(self) -> int:
        return self.placement.ranks

    @property
    def stages(self) -> int:
        return self.placement.stages

    @property
    def micro_batches(self) -> int:
        return len(self.micro_pipe)

    @cached_property
    def ops(self) -> frozenset[Op]:
        """The ops that occur in the programs."""
        return frozenset(a.op for prog in self.programs for a in prog)

    @property
    def split_backward(self) -> bool:
        return Op.I in self.ops

    @property
    def lowered(self) -> bool:
        return not self.ops <= COMPUTE_OPS

    def actions(self) -> Iterator[tuple[int, int, Action]]:
        """(rank, index, action) for every action of every rank."""
        for rank, prog in enumerate(self.programs):
            for i, action in enumerate(prog):
                yield rank, i, action

    def compute_programs(self) -> tuple[tuple[Action, ...], ...]:
        return tuple(tuple(a for a in prog if a.op.is_compute) for prog in self.programs)

    def with_programs(self, programs: Iterable[Iterable[Action]]) -> "Schedule":
        return Schedule(
            self.name, self.placement, self.micro_pipe,
            tuple(tuple(p) for p in programs), self.micro_scale, dict(self.params),
        )

    # -- text and JSON --------------------------------------------------------------
    def to_text(self) -> str:
        """One line per rank: ``rank: action action ...``."""
        return "\n".join(f"{r}: " + " ".join(map(str, prog)) for r, prog in enumerate(self.programs))

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "placement": self.placement.to_json(),
            "micro_pipe": list(self.micro_pipe),
            "micro_scale": self.micro_scale,
            "params": self.params,
            "programs": [[str(a) for a in prog] for prog in self.programs],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json())

    @classmethod
    def from_json(cls, data: dict) -> "Schedule":
        try:
            return cls(
                data["name"],
                Placement.from_json(data["placement"]),
                tuple(int(p) for p in data["micro_pipe"]),
                tuple(tuple(Action.parse(a) for a in prog) for prog in data["programs"]),
                float(data.get("micro_scale", 1.0)),
                dict(data.get("params", {})),
            )
        except (KeyError, TypeError) as exc:
            raise ScheduleError(f"not a schedule JSON object: missing or bad field {exc}") from None

    @classmethod
    def loads(cls, text: str) -> "Schedule":
        return cls.from_json(json.loads(text))
