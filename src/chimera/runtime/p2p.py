"""Point-to-point messages of a lowered schedule, issued in the order of its CommPlan.

The plan (:mod:`chimera.check.comm_plan`) fixes where every receive is posted; this module only
carries it out: :meth:`Mailbox.post` at a Post, :meth:`Mailbox.receive` at a RECV (waits for
the posted receive), :meth:`Mailbox.send` at a SEND. Receive buffers are allocated once and
reused every iteration; a sent tensor is released as soon as its send is complete.

Waits: on gloo a wait takes ``--comm-timeout`` (gloo has no watchdog, and a CPU wait is what
gloo does anyway). On NCCL ``Work.wait()`` only makes the compute stream wait for the
communication stream: no CPU blocking and no polling in the hot path; hangs are the process
group's timeout and watchdog's job (``init_process_group(timeout=--comm-timeout)``).

The calls go through the :class:`~chimera.runtime.transport.Transport` the runtime is given,
so that CI can run the same calls under an emulation of NCCL's rendezvous semantics on gloo
(:mod:`chimera.runtime.nccl_emulation`) or on virtual ranks (:mod:`chimera.runtime.virtual`).
"""

from __future__ import annotations

import datetime
import re
from collections import deque

import torch

from chimera.check.comm_plan import CommPlan, Message
from chimera.ir import Action, Op
from chimera.runtime.transport import Transport

__all__ = ["CommTimeout", "Mailbox", "Message", "peers_text"]


class CommTimeout(RuntimeError):
    """A p2p or collective wait ran past ``--comm-timeout`` or failed (a peer died).

    ``rank`` (global), ``action`` (the Action waited on, None for a collective outside the
    program), ``peer`` (a rank or a list of ranks) and ``what`` say where; so does the message.
    """

    def __init__(self, message: str, rank: int | None = None, action: Action | None = None,
                 peer=None, what: str | None = None):
        super().__init__(message)
        self.rank, self.action, self.peer, self.what = rank, action, peer, what


_PEER_GONE = re.compile(r"connection|closed|reset by peer|broken pipe", re.IGNORECASE)


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


def wait_work(work, timeout: datetime.timedelta | None, rank: int, what: str, peer,
              action: Action | None = None) -> None:
    """Wait for ``work``; a failure or a timeout becomes a CommTimeout naming ``what``."""
    try:
        ok = work.wait() if timeout is None else work.wait(timeout)
    except RuntimeError as exc:
        limit = f" (--comm-timeout {timeout.total_seconds():g}s)" if timeout else ""
        raise CommTimeout(f"rank {rank}: {what} failed{limit}: {str(exc).splitlines()[0]}",
                          rank, action, peer, what) from exc
    if ok is False:
        raise CommTimeout(f"rank {rank}: {what} timed out after {timeout.total_seconds():g}s",
                          rank, action, peer, what)


class Mailbox:
    """Posts, waits for, and sends the p2p messages of one rank, iteration after iteration."""

    def __init__(self, plan: CommPlan, grid, shape_of, dtype: torch.dtype,
                 device: torch.device, timeout_s: float | None, transport: Transport):
        self.schedule, self.grid = plan.schedule, grid
        self.order = plan.incoming[grid.d]  # the receives, in the order the plan posts them
        self.buffers = {m: torch.empty(shape_of(m), dtype=dtype, device=device) for m in self.order}
        self.sources = {m: (grid.peer(m.pipe, m.source_stage), m.tag(plan.schedule)) for m in self.order}
        self.timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        self.transport = transport
        self.dtype = dtype
        self.pending: dict[Message, object] = {}
        self.routes: dict[Action, tuple[Message, int, int]] = {}  # (message, peer, tag) per action
        self.begin_iteration()
        self.sends: deque[tuple[object, torch.Tensor | None, Action, int]] = deque()

    @property
    def transport(self) -> Transport:
        return self._transport

    @transport.setter
    def transport(self, transport: Transport) -> None:
        """Whether a rank about to wait posts the rest of its receives (gloo, see receive) is
        asked once per transport, not per receive."""
        self._transport = transport
        self.post_ahead = bool(transport.matches_by_tag)

    def _route(self, action: Action) -> tuple[Message, int, int]:
        """(message, peer rank, tag) of a SEND or RECV, worked out once per action."""
        route = self.routes.get(action)
        if route is None:
            msg = Message.of(action, self.schedule.stages)
            other = msg.source_stage if action.op in (Op.RECV_F, Op.RECV_B) else msg.stage
            route = self.routes[action] = (msg, self.grid.peer(msg.pipe, other), msg.tag(self.schedule))
        return route

    def begin_iteration(self) -> None:
        if self.pending:  # a run that stopped midway: a posted receive would take a new message
            raise RuntimeError(
                f"rank {self.grid.rank}: an earlier step stopped with receives still posted "
                f"({', '.join(map(str, sorted(self.pending)[:3]))}...); the pipeline cannot run "
                "another step: build it again")
        self.posted: set[Message] = set()  # receives posted so far this iteration
        self.ahead = False  # whether the rest were posted ahead (gloo: see receive)

    def post(self, msg: Message) -> None:
        """The program's Post (skipped when the receive was posted ahead)."""
        if msg not in self.posted:
            self._post(msg)

    def _post(self, msg: Message) -> None:
        src, tag = self.sources[msg]
        self.pending[msg] = self._issue(self.transport.irecv, self.buffers[msg], src, tag,
                                        Action(msg.kind, msg.pipe, msg.stage, msg.micro))
        self.posted.add(msg)

    def _post_ahead(self) -> None:
        """Post every receive of the iteration not posted yet, in the plan's order."""
        for msg in self.order:
            if msg not in self.posted:
                self._post(msg)
        self.ahead = True

    def receive(self, action: Action) -> torch.Tensor:
        msg, src, _ = self._route(action)
        work = self.pending.pop(msg)
        # Where messages match by tag and nothing waits in a stream (gloo), a rank about to
        # wait posts the rest of its receives now, while it is idle anyway: a later send then
        # finds its receive ready instead of waiting for the receiver to reach the plan's Post
        # and say so (one more hop on the critical path whenever the receiver was busy); the
        # posting costs no time a rank could have computed in (posted all at the start, it
        # delayed the first stage's first forward by ~7 ms at D=8). On NCCL and under its
        # emulation the plan's Posts are kept: their place is what makes the order safe there.
        if not self.ahead and self.post_ahead and not work.is_completed():
            self._post_ahead()
        wait_work(work, self.timeout, self.grid.rank, f"{action} with peer rank {src}", src, action)
        return self.buffers[msg]

    def send(self, action: Action, tensor: torch.Tensor) -> None:
        _, peer, tag = self._route(action)
        if tensor.requires_grad:
            tensor = tensor.detach()
        if tensor.dtype != self.dtype or not tensor.is_contiguous():  # bf16 autocast may change it
            tensor = tensor.to(self.dtype).contiguous()
        work = self._issue(self.transport.isend, tensor, peer, tag, action)
        self.sends.append((work, tensor, action, peer))
        self._release_sent()

    def _issue(self, call, tensor: torch.Tensor, peer: int, tag: int, action: Action):
        """``call(tensor, peer, tag)``, an isend or irecv of ``action``'s message. gloo refuses
        either at once when the peer's socket closed: the same CommTimeout as a failed wait."""
        try:
            return call(tensor, peer, tag)
        except RuntimeError as exc:
            if not _PEER_GONE.search(str(exc)):
                raise
            what = f"{action} with peer rank {peer}"
            raise CommTimeout(f"rank {self.grid.rank}: {what} failed: {str(exc).splitlines()[0]}",
                              self.grid.rank, action, peer, what) from exc

    def _release_sent(self) -> None:
        """Drop completed sends from the front (their tensors' memory goes back)."""
        while self.sends and self.sends[0][0].is_completed():
            self.sends.popleft()

    def finish_iteration(self) -> None:
        """Wait for every send of the iteration (their buffers may be reused after this)."""
        while self.sends:
            work, _, action, peer = self.sends.popleft()
            wait_work(work, self.timeout, self.grid.rank, f"{action} with peer rank {peer}",
                      peer, action)
        if self.pending:  # cannot happen with a plan from plan_comm: every Post has its RECV
            raise RuntimeError(f"rank {self.grid.rank}: receives never waited for: "
                               + ", ".join(map(str, self.pending)))
