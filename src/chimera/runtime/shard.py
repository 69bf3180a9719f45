"""ZeRO-1 over a stage's replica group: each replica owns 1/n of the stage's optimizer.

Chimera keeps two replicas of every stage (2W with data parallelism) whose gradients are
summed anyway. With sharding, the replica's collective at its Launch is a reduce-scatter
instead of an allreduce: member k of the group (n members) receives the sum of slice k of
the stage's flat gradient only. The optimizer updates that slice (its AdamW state is 1/n of
the stage's); after the step an all-gather hands every replica the whole updated stage.
Reduce-scatter and all-gather are the two halves of an allreduce, so the bytes on the wire
stay those of one allreduce, while optimizer state and work fall by n. The all-gathers are
issued right after the optimizer step and each is waited for just before its replica's
first forward of the next iteration (``PipelineRuntime.gather_parameters``): the gathers of
the stages a rank runs later overlap the forwards it runs first, as FSDP's prefetch.

On the CPU path (gloo, the virtual ranks; :func:`chimera.runtime.sync.comm_choices`) the
reduction is an allreduce of the whole flat gradient, whose owned slice is then copied out:
gloo's reduce-scatter took more than its allreduce of the same buffer (two processes here,
12.8 MB: 19 ms wall and 14 ms of CPU against 12 and 7), and with two replicas both add each
element once, so the values are the same. The device path (NCCL, or the device plan forced
on CPU) keeps the reduce-scatter, which moves half the bytes. A replica with nothing to
train (frozen layers) has no shard: it keeps the one-element allreduce every replica of its
stage issues alike, and no all-gather.

The slicing is the one ``PipelineRuntime.owned_sq_norm`` already uses (slice k of size
ceil(numel / n)), so the global norm reads each owned slice once. Parameters become views
into one flat buffer per replica (padded to a multiple of n); the optimizer sees *pieces*:
for each parameter, its part inside the owned slice, as a Parameter sharing the flat
buffer's memory, with a ``.grad`` viewing the reduce-scatter output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from chimera.runtime.transport import Transport

OPTIM_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass
class Piece:
    """The part ``start:end`` of ``param`` (which starts at ``offset`` in the flat buffer)
    inside this rank's slice."""

    piece: nn.Parameter
    param: nn.Parameter
    start: int
    end: int
    offset: int


class _SliceOfAllreduce:
    """An allreduce of a whole flat gradient; waiting for it also copies the owned slice out."""

    def __init__(self, work, reduced: torch.Tensor, grad: torch.Tensor):
        self.work, self.reduced, self.grad = work, reduced, grad

    def wait(self, timeout=None):
        ok = self.work.wait() if timeout is None else self.work.wait(timeout)
        if ok is not False:
            self.grad.copy_(self.reduced)
        return ok


@dataclass
class StageShard:
    """One replica's flat parameters and this rank's slice of them."""

    flat: torch.Tensor  # every parameter of the replica, padded to n * size
    grad: torch.Tensor  # the group's summed gradient of the owned slice (see ``reduce``)
    lo: int
    hi: int
    group: object
    scatter: bool = True  # reduce by reduce-scatter (the device plan); else allreduce and copy
    params: list[nn.Parameter] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)
    transport: Transport | None = None  # the group's (blocking gathers); set by build

    @classmethod
    def build(cls, params: list[nn.Parameter], offsets: list[int], padded: int, ranks: list[int],
              rank: int, group, scatter: bool, transport: Transport) -> "StageShard":
        """``params`` must not be empty: a replica with nothing to train has no shard (its
        one-element buffer cannot be cut into n slices; it keeps its allreduce)."""
        n, k = len(ranks), ranks.index(rank)
        if not params or padded % n:
            raise ValueError(f"a shard needs parameters and a multiple of {n} elements")
        size = padded // n
        ref = params[0]
        flat = torch.zeros(padded, dtype=ref.dtype, device=ref.device)
        shard = cls(flat, torch.zeros(size, dtype=ref.dtype, device=ref.device), k * size,
                    (k + 1) * size, group, scatter, list(params), list(offsets),
                    transport=transport)
        for p, off in zip(params, offsets):
            view = flat[off:off + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)  # the module now computes with the flat buffer's memory
            a, b = max(off, shard.lo), min(off + p.numel(), shard.hi)
            if a < b:
                piece = nn.Parameter(flat[a:b])  # shares flat's memory: a step updates p
                piece.grad = shard.grad[a - shard.lo:b - shard.lo]
                shard.pieces.append(Piece(piece, p, a - off, b - off, off))
        return shard

    def attach(self, keep: bool = False) -> None:
        """Re-point each piece's ``.grad`` at its part of ``self.grad`` (an optimizer's
        ``zero_grad(set_to_none=True)`` dropped it); with ``keep``, a dropped one counts as
        zero and an assigned tensor's values are copied in (as ``ReplicaGrads.attach``)."""
        for pc in self.pieces:
            view = self.grad[pc.offset + pc.start - self.lo:pc.offset + pc.end - self.lo]
            g = pc.piece.grad
            if g is not None and g.data_ptr() == view.data_ptr() and g.shape == view.shape:
                continue
            if keep:
                view.copy_(g) if g is not None else view.zero_()
            pc.piece.grad = view

    def reduce(self, flat_grad: torch.Tensor, transport: Transport | None = None):
        """Async: the group's sum of slice k of ``flat_grad`` into ``self.grad``, through
        ``transport`` (default the shard's; the NCCL emulation's collective stream under it).
        A reduce-scatter with ``scatter`` (the device plan); else an allreduce of the whole
        ``flat_grad`` in place (gloo's reduce-scatter is slower), whose owned slice is then
        copied out: ``flat_grad`` then holds the whole sum, which nothing reads."""
        transport = transport if transport is not None else self.transport
        if not self.scatter:
            work = transport.all_reduce(flat_grad, group=self.group, async_op=True)
            return _SliceOfAllreduce(work, flat_grad[self.lo:self.hi], self.grad)
        return transport.reduce_scatter_single(self.grad, flat_grad, group=self.group, async_op=True)

    def all_gather_async(self, transport: Transport | None = None):
        """Async: every member's updated slice into every member's parameters (through
        ``transport``, as :meth:`reduce`). Returns the work; the slice's copy it sends lives
        as long as the work (``work.source``)."""
        transport = transport if transport is not None else self.transport
        source = self.flat[self.lo:self.hi].clone()
        return transport.all_gather_single(self.flat, source, group=self.group, async_op=True), source

    def all_gather(self, flat: torch.Tensor | None = None) -> torch.Tensor:
        """Every member's slice of ``flat`` (default: the parameters) into every member's."""
        flat = self.flat if flat is None else flat
        self.transport.all_gather_single(flat, flat[self.lo:self.hi].clone(), group=self.group)
        return flat

    def gather_state(self, optimizer: torch.optim.Optimizer) -> dict[nn.Parameter, dict]:
        """The whole replica's AdamW state, per parameter (collective over the group)."""
        out: dict[nn.Parameter, dict] = {p: {} for p in self.params}
        step = torch.zeros((), dtype=torch.float32)
        for key in OPTIM_KEYS:
            full = torch.zeros_like(self.flat)
            for pc in self.pieces:
                state = optimizer.state.get(pc.piece)
                if state:
                    full[pc.offset + pc.start:pc.offset + pc.end].copy_(state[key])
                    step = state["step"]
            self.all_gather(full)
            for p, off in zip(self.params, self.offsets):
                out[p][key] = full[off:off + p.numel()].view_as(p)
        for p in out:
            out[p]["step"] = step.detach().clone()
        return out

    def scatter_state(self, optimizer: torch.optim.Optimizer, full: dict[nn.Parameter, dict]) -> None:
        """Load the whole replica's AdamW state: each piece takes its part."""
        for pc in self.pieces:
            src, state = full[pc.param], optimizer.state[pc.piece]
            for key in OPTIM_KEYS:
                state[key] = src[key].detach().reshape(-1)[pc.start:pc.end].clone()
            state["step"] = src["step"].detach().clone()
