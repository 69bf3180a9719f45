"""The TP group and the four collectives a tensor-parallel layer issues, as autograd functions.

Every collective goes through the run's :class:`~chimera.runtime.transport.Transport`, so
virtual ranks run TP, the NCCL emulation gates its collectives and a recorded run holds them
(``VirtualWorld(record=True)``) like the pipeline's own. The mappings are Megatron-LM's:

- ``copy_to_tp``: before a column-parallel projection; forward the identity, backward an
  allreduce of the input gradient (each rank's projection saw only its output features);
- ``reduce_from_tp``: after a row-parallel projection; forward an allreduce of the partial
  outputs, backward the identity;
- ``gather_from_tp``: the head's logits; forward an all-gather along a dim, backward this
  rank's slice of the gradient;
- ``split_to_tp``: a row-parallel projection given its whole input (HF's ``rowwise_rep``);
  forward this rank's slice of the last dim, backward an all-gather.

A block built from them takes a replicated input and returns a replicated, plain tensor,
after one allreduce per sub-block each way.
"""

from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass

import torch

from chimera.runtime.p2p import peers_text, wait_work
from chimera.runtime.transport import ReduceOp, Transport


@dataclass(frozen=True)
class TPGroup:
    """Rank ``rank`` (t) of a TP group of ``size`` (T) ranks: ``group`` is the
    ``transport.new_group`` of its ranks (None when T is 1). ``random``: this rank's
    dropout streams (``chimera.tp.random``; None: a dropout rate above 0 is refused). ``timeout``: how long a
    collective may wait (the run's ``--comm-timeout`` where waits are timed; None: the
    backend's own, NCCL's watchdog); a peer that died or hangs then ends the wait in a
    ``CommTimeout`` naming this rank and the group's others."""

    transport: Transport
    group: object
    rank: int
    size: int
    timeout: datetime.timedelta | None = None
    random: object = None  # a chimera.tp.random.TPRandom: dropout's streams (None: no dropout)

    @functools.cached_property
    def _peers(self) -> tuple[int, list[int], str]:
        """(this global rank, the group's ranks, who they are in words): asked once, not per
        collective (every block's forward and backward waits twice)."""
        me = self.transport.get_rank()
        ranks = self.transport.get_process_group_ranks(self.group)
        return me, ranks, peers_text(me, ranks)

    def _wait(self, work, what: str) -> None:
        me, ranks, peers = self._peers
        wait_work(work, self.timeout, me, f"tensor-parallel {what} with {peers}", ranks)

    def __deepcopy__(self, memo) -> "TPGroup":
        return self  # a handle on a communicator: a copied layer talks over the same one

    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM) -> None:
        """``tensor`` (contiguous) reduced over the group (summed; ``op``: another
        ``ReduceOp``), in place; blocking."""
        if self.size > 1:
            self._wait(self.transport.all_reduce(tensor, op=op, group=self.group, async_op=True),
                       "allreduce")

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``tensor`` (the same shape on each) concatenated along ``dim``, in t
        order. One ``all_gather_single`` into a flat buffer: the collective every transport,
        the NCCL emulation included, implements."""
        if self.size == 1:
            return tensor
        local = tensor.contiguous()
        out = local.new_empty((self.size * local.numel(),))
        self._wait(self.transport.all_gather_single(out, local.view(-1), group=self.group,
                                                    async_op=True), "all-gather")
        return torch.cat(out.view(self.size, *local.shape).unbind(0), dim=dim)

    def slice(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's one of T equal slices of ``tensor`` along ``dim`` (a view)."""
        part = tensor.shape[dim] // self.size
        return tensor.narrow(dim, self.rank * part, part)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # a copy: autograd may hand the same gradient to another branch (a residual's add)
        grad = grad.clone(memory_format=torch.contiguous_format)
        ctx.tp.all_reduce(grad)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        if x.is_contiguous() and x._base is None:  # a projection's fresh output: summed in place
            ctx.mark_dirty(x)
        else:
            x = x.clone(memory_format=torch.contiguous_format)
        tp.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        return tp.all_gather(x, dim)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.slice(grad, ctx.dim).contiguous(), None, None


class _SplitToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        return tp.slice(x, dim).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_gather(grad, ctx.dim), None, None


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """``x``; its gradient allreduced over the group."""
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """``x`` summed over the group (a fresh contiguous ``x`` is summed in place); its
    gradient passed through."""
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


def gather_from_tp(x: torch.Tensor, tp: TPGroup, dim: int = -1) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``; the gradient's own slice back."""
    return x if tp.size == 1 else _GatherFromTP.apply(x, tp, dim)


def split_to_tp(x: torch.Tensor, tp: TPGroup, dim: int = -1) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim``; the gradients gathered back."""
    return x if tp.size == 1 else _SplitToTP.apply(x, tp, dim)
