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
returns, before the loss is read (ours waits at STEP). Sharded (``fully_shard`` without
resharding after forward, the counterpart of our ZeRO-1 rows): a reduce-scatter there
instead, and an all-gather of each stage's parameters issued when the step starts and waited
for before the stage's first forward (FSDP's unshard), each half an allreduce's bytes. The wrappers themselves are not used:
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
    waited for by :meth:`wait`: the copies' mean gradient lands in every ``.grad``. With
    ``sharded``, a reduce-scatter (each copy keeps its slice of the sum, which nothing here
    reads) and, from :meth:`gather` at the step's start, an all-gather of every stage's
    parameters that its first forward waits for."""

    def __init__(self, stages: list, group, transport: Transport, copies: int,
                 sharded: bool = False):
        self.group, self.transport, self.copies, self.sharded = group, transport, copies, sharded
        self.pending: list[tuple[object, torch.Tensor, list[torch.Tensor]]] = []
        self.gathering: dict[int, object] = {}
        for stage in stages:
            stage.perform_reduce_grad = functools.partial(self._reduce, stage,
                                                          stage.perform_reduce_grad)
            if sharded:
                stage.submod.register_forward_pre_hook(functools.partial(self._gathered, stage))
        self.stages = stages

    def _reduce(self, stage, torch_own, grad_scale_factor: int) -> None:
        torch_own(grad_scale_factor)  # scales by 1/N (and would run FSDP's post-backward)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p)
                 for p in stage.submod.parameters()]
        flat = self._padded([g.reshape(-1) for g in grads])
        if self.sharded:
            mine = flat.new_empty(flat.numel() // self.copies)
            work = self.transport.reduce_scatter_single(mine, flat, group=self.group, async_op=True)
            self.pending.append((work, flat, []))  # the slice is what an optimizer would read
            return
        work = self.transport.all_reduce(flat, group=self.group, async_op=True)
        self.pending.append((work, flat, grads))

    def _padded(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """``parts`` in one flat tensor, padded to a multiple of the copies when sharded."""
        flat = torch.cat(parts)
        short = -flat.numel() % self.copies if self.sharded else 0
        return torch.cat([flat, flat.new_zeros(short)]) if short else flat

    def gather(self) -> None:
        """Sharded: start every held stage's parameter all-gather (stages in order, alike on
        every copy)."""
        for stage in self.stages if self.sharded else ():
            flat = self._padded([p.detach().reshape(-1) for p in stage.submod.parameters()])
            size, k = flat.numel() // self.copies, self.transport.get_rank(self.group)
            self.gathering[id(stage)] = self.transport.all_gather_single(
                flat, flat[k * size:(k + 1) * size].clone(), group=self.group, async_op=True)

    def _gathered(self, stage, module, args) -> None:
        work = self.gathering.pop(id(stage), None)
        if work is not None:
            work.wait()

    def wait(self) -> None:
        for work, flat, grads in self.pending:
            work.wait()
            if grads:
                flat /= self.copies
                for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(part.view_as(g))
        self.pending.clear()
        for work in self.gathering.values():  # a stage that ran no forward (none do)
            work.wait()
        self.gathering.clear()
