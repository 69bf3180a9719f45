"""torch.distributed.pipelining's rows with W pipeline copies (``chimera bench --emulate
--data-parallel W``), combined with data parallelism the way torch's users combine them.

torchtitan (and torch's pipelining tests) lay ranks out as a (dp, pp) mesh: copy w runs its
schedule over its own pipeline group, ranks ``w*D .. w*D + D-1``, and every stage module is
wrapped for data parallelism over the data-parallel group of its pipeline rank d, ranks
``{w*D + d}`` (``replicate`` or FSDP's ``fully_shard``). torch's schedules then reduce a
stage's gradients at the ``REDUCE_GRAD`` action they place right after the stage's last
backward (``PipelineStage.perform_reduce_grad``; a single-stage schedule, GPipe or 1F1B,
calls it when its step's backwards are done), which is also where our lowering puts a
replica's SYNC.

The bench issues that reduction at that place itself, an asynchronous allreduce of the
stage's gradients over its data-parallel group through the bench's transport, so that it is
priced as ours are (:class:`chimera.bench.links.PricedTransport`: the bytes' time, one
collective after another on the rank's channel), and waits for it when the schedule's step
returns, before the loss is read (ours waits at STEP). The wrappers themselves are not used:
their collectives would bypass the transport that prices them, and on these CPU ranks
DDP's wait at the end of a backward would block the emulated device, which a GPU's stream
wait does not.
"""

from __future__ import annotations

import functools

import torch

from chimera.runtime.transport import Transport

# (world, D) -> (pipeline group of each copy, data-parallel group of each pipeline rank):
# every rank builds its rows in one order, so every rank creates these groups in one order
_GROUPS: dict[tuple[int, int], tuple[list, list]] = {}


def copy_groups(transport: Transport, stages: int, copies: int) -> tuple[list, list]:
    """The pipeline group of each copy and the data-parallel group of each pipeline rank
    (made once per process and layout: a collective of every rank)."""
    key = (stages, copies)
    if key not in _GROUPS:
        pipes = [transport.new_group(list(range(w * stages, (w + 1) * stages)))
                 for w in range(copies)]
        dp = [transport.new_group([w * stages + d for w in range(copies)]) for d in range(stages)]
        _GROUPS[key] = (pipes, dp)
    return _GROUPS[key]


class StageReduction:
    """The data-parallel gradient reduction of the stages a rank holds, issued at torch's
    ``REDUCE_GRAD`` of each (its ``perform_reduce_grad``, wrapped on the stage object) and
    waited for by :meth:`wait`: the copies' mean gradient lands in every ``.grad``."""

    def __init__(self, stages: list, group, transport: Transport, copies: int):
        self.group, self.transport, self.copies = group, transport, copies
        self.pending: list[tuple[object, torch.Tensor, list[torch.Tensor]]] = []
        for stage in stages:
            stage.perform_reduce_grad = functools.partial(self._reduce, stage,
                                                          stage.perform_reduce_grad)

    def _reduce(self, stage, torch_own, grad_scale_factor: int) -> None:
        torch_own(grad_scale_factor)  # scales by 1/N (and would run FSDP's post-backward)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p)
                 for p in stage.submod.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = self.transport.all_reduce(flat, group=self.group, async_op=True)
        self.pending.append((work, flat, grads))

    def wait(self) -> None:
        for work, flat, grads in self.pending:
            work.wait()
            flat /= self.copies
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
        self.pending.clear()
