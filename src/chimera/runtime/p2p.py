"""Point-to-point messages of a lowered schedule: who sends what to whom, in which order.

Every RECV is posted in the order its *sender* issues the matching SENDs (backends such as
NCCL match messages between a pair of ranks by order, not by tag), and with a tag that names
the message (gloo checks it). On gloo all receives of an iteration are posted up front, so
data moves while the receiver computes; elsewhere a receive is posted just before it is
waited on. Buffers are allocated once and reused every iteration.
"""

from __future__ import annotations

import datetime
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from chimera.ir import Action, Op, Schedule


class CommTimeout(RuntimeError):
    """A p2p or collective wait ran past ``--comm-timeout`` or failed (a peer died).

    ``rank`` (global), ``action`` (the Action waited on, None for a collective outside the
    program), ``peer`` (a rank or a list of ranks) and ``what`` say where; so does the message.
    """

    def __init__(self, message: str, rank: int | None = None, action: Action | None = None,
                 peer=None, what: str | None = None):
        super().__init__(message)
        self.rank, self.action, self.peer, self.what = rank, action, peer, what


@dataclass(frozen=True)
class Message:
    kind: Op  # RECV_F (activation into `stage`) or RECV_B (gradient into `stage`)
    pipe: int
    stage: int
    micro: int

    def tag(self, schedule: Schedule) -> int:
        pipes, stages = schedule.placement.pipes, schedule.stages
        return (((self.micro * pipes + self.pipe) * stages + self.stage) << 1) | (self.kind is Op.RECV_B)

    def source_stage(self) -> int:
        return self.stage - 1 if self.kind is Op.RECV_F else self.stage + 1


def message_of_send(a: Action) -> Message:
    """The message a SEND action produces, named by its receiving side."""
    if a.op is Op.SEND_F:
        return Message(Op.RECV_F, a.pipe, a.stage + 1, a.micro)
    return Message(Op.RECV_B, a.pipe, a.stage - 1, a.micro)


def incoming_order(schedule: Schedule, rank: int) -> dict[int, list[Message]]:
    """For pipeline rank ``rank``: per source rank, its messages in the sender's order."""
    place = schedule.placement
    out: dict[int, list[Message]] = defaultdict(list)
    for src, prog in enumerate(schedule.programs):
        for a in prog:
            if a.op in (Op.SEND_F, Op.SEND_B):
                msg = message_of_send(a)
                if place.rank_of(msg.pipe, msg.stage) == rank:
                    out[src].append(msg)
    return dict(out)


def peers_text(rank: int, ranks) -> str:
    """``peer rank 1``, ``peer ranks 1, 3`` or ``its 63 peers (ranks 0-63)``: who ``rank``
    waited on in a group of ``ranks``."""
    others = [r for r in ranks if r != rank]
    if not others:
        return "no peer"
    if len(others) == 1:
        return f"peer rank {others[0]}"
    if len(others) > 4:
        return f"its {len(others)} peers (ranks {others[0]}-{others[-1]})"
    return "peer ranks " + ", ".join(map(str, others))


class Mailbox:
    """Posts, waits for, and sends the p2p messages of one rank, iteration after iteration."""

    def __init__(self, schedule: Schedule, grid, shape_of, dtype: torch.dtype,
                 device: torch.device, prepost: bool, timeout_s: float):
        self.schedule, self.grid = schedule, grid
        self.order = incoming_order(schedule, grid.d)
        self.src_of = {m: src for src, msgs in self.order.items() for m in msgs}
        self.index_of = {m: i for msgs in self.order.values() for i, m in enumerate(msgs)}
        self.buffers = {m: torch.empty(shape_of(m), dtype=dtype, device=device) for m in self.src_of}
        self.prepost, self.timeout = prepost, datetime.timedelta(seconds=timeout_s)
        self.dtype = dtype
        self.pending: dict[Message, object] = {}
        self.next_index: dict[int, int] = {}
        self.sends: list[tuple[object, torch.Tensor, Action, int]] = []

    def start_iteration(self) -> None:
        self.next_index = {src: 0 for src in self.order}
        if self.prepost:
            for src, msgs in self.order.items():
                self._post_until(src, len(msgs))

    def _post_until(self, src: int, count: int) -> None:
        msgs = self.order[src]
        while self.next_index[src] < count:
            msg = msgs[self.next_index[src]]
            peer = self.grid.global_rank(src)
            self.pending[msg] = dist.irecv(self.buffers[msg], src=peer, tag=msg.tag(self.schedule))
            self.next_index[src] += 1

    def receive(self, action: Action) -> torch.Tensor:
        msg = Message(action.op, action.pipe, action.stage, action.micro)
        src = self.src_of[msg]
        self._post_until(src, self.index_of[msg] + 1)
        work = self.pending.pop(msg)
        self._wait(work, action, self.grid.global_rank(src))
        return self.buffers[msg]

    def send(self, action: Action, tensor: torch.Tensor) -> None:
        msg = message_of_send(action)
        peer = self.grid.peer(msg.pipe, msg.stage)
        tensor = tensor.detach().to(self.dtype).contiguous()  # bf16 autocast may change it
        work = dist.isend(tensor, dst=peer, tag=msg.tag(self.schedule))
        self.sends.append((work, tensor, action, peer))

    def finish_iteration(self) -> None:
        """Wait for every send of the iteration (their buffers may be reused after this)."""
        for work, _, action, peer in self.sends:
            self._wait(work, action, peer)
        self.sends.clear()

    def _wait(self, work, action: Action, peer: int) -> None:
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as exc:
            raise CommTimeout(f"rank {self.grid.rank}: {action} with peer rank {peer} failed "
                              f"(--comm-timeout {self.timeout.total_seconds():g}s): "
                              f"{str(exc).splitlines()[0]}", self.grid.rank, action, peer) from exc
        if ok is False:
            raise CommTimeout(f"rank {self.grid.rank}: {action} with peer rank {peer} timed out "
                              f"after {self.timeout.total_seconds():g}s", self.grid.rank, action, peer)
