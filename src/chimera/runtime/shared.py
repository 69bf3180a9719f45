"""State that must agree across copies after an iteration: tied weights and buffers.

A tie is one logical parameter that several layers use (GPT-2's ``wte`` and ``lm_head``).
When those layers sit in different stages, each stage holds a copy: the copies start equal,
and after every iteration each copy's gradient is replaced by the sum over every copy and
replica, so equal optimizer steps keep them equal. After the stage allreduce each replica of
a stage holds that stage's whole gradient, so the tie sums one gradient per tied stage:

- where every rank holding a copy holds a replica of every tied stage (Chimera's first and
  last stages share ranks), the sum is a local add, in stage order, the same on all of them;
- elsewhere (1F1B: first and last stage on different ranks), one allreduce over the tie's
  holders, each stage's gradient contributed by one rank only (the first of its replicas).

Collectives here run after the pipeline's iteration, in one fixed order on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tie:
    """Model-wide parameter names of one logical parameter (the first is its name) and the
    stage of each."""

    names: tuple[str, ...]
    stages: tuple[int, ...]

    @property
    def stage_set(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.stages)))


class TieSync:
    """Equalizes tied copies (at start and after a load) and sums their gradients."""

    def __init__(self, ties: list[Tie], runtime):
        self.runtime, self.grid = runtime, runtime.grid
        self.ties = [t for t in ties if len(t.stage_set) > 1]  # same-stage ties share one Parameter
        self.plans = [self._plan(t) for t in self.ties]  # new_group on every rank, in tie order

    def _plan(self, tie: Tie) -> tuple[list[int], object, bool]:
        """(holders at our TP position, their group, whether every holder holds every tied
        stage). With tensor parallelism each TP position sums its own shards: a group per t,
        every one created by every rank, t in order."""
        grid, mine = self.grid, None
        for t in range(grid.tensor_parallel):
            holders = sorted({r for s in tie.stage_set for r in grid.stage_ranks_at(s, t)})
            held = {r: {s for _, s in grid.placement.held(grid.d_of(r))} for r in holders}
            local = all(set(tie.stage_set) <= held[r] for r in holders)
            group = None if local or len(holders) == 1 else self.runtime.transport.new_group(holders)
            if t == grid.t:
                mine = holders, group, local
        return mine

    def copies(self, tie: Tie) -> dict[int, list[torch.nn.Parameter]]:
        """stage -> this rank's copies of the tied parameter in that stage (all replicas)."""
        out: dict[int, list] = {}
        for (pipe, stage), module in sorted(self.runtime.modules.items()):
            for name, s in zip(tie.names, tie.stages):
                if s == stage:
                    out.setdefault(stage, []).append(module.get_parameter(name))
                    break
        return out

    def _combine(self, tie: Tie, plan, values: dict[int, torch.Tensor], reduce: bool) -> torch.Tensor:
        """Sum (``reduce``) or the first tied stage's value, identical on every holder."""
        holders, group, local = plan
        order = tie.stage_set
        if local:
            if not reduce:
                return values[order[0]].clone()
            total = values[order[0]].clone()
            for s in order[1:]:
                total += values[s]
            return total
        some = next(iter(values.values()))
        total = torch.zeros_like(some)
        for s in (order if reduce else order[:1]):
            if s in values and self.grid.rank == self.grid.stage_ranks[s][0]:
                total += values[s]
        if group is not None:
            self.runtime.all_reduce(total, group)  # in the rank's one order (strict emulation)
        return total

    def reduce_grads(self) -> None:
        for tie, plan in zip(self.ties, self.plans):
            if self.grid.rank not in plan[0]:
                continue
            copies = self.copies(tie)
            if not next(iter(copies.values()))[0].requires_grad:
                continue  # a frozen tie: nothing to sum (frozen alike on every holder)
            total = self._combine(tie, plan, {s: ps[0].grad for s, ps in copies.items()}, True)
            for ps in copies.values():
                for p in ps:
                    p.grad.copy_(total)

    @torch.no_grad()
    def equalize(self) -> None:
        """Every copy takes the value of the copy in the first tied stage."""
        for tie, plan in zip(self.ties, self.plans):
            if self.grid.rank not in plan[0]:
                continue
            copies = self.copies(tie)
            value = self._combine(tie, plan, {s: ps[0].detach() for s, ps in copies.items()}, False)
            for ps in copies.values():
                for p in ps:
                    p.copy_(value)

    def counted_elsewhere(self) -> set[int]:
        """ids of this rank's tied copies outside the tie's first stage (a norm counts the
        tie once, in that stage)."""
        return {id(p) for t in self.ties for s, ps in self.copies(t).items()
                if s != t.stages[0] for p in ps}


def counters(runtime) -> dict[int, torch.Tensor]:
    """A copy of every integer buffer (``num_batches_tracked``) this rank holds, by id: taken
    before an iteration, when every replica of a stage agrees (``sync_buffers``)."""
    return {id(b): b.clone() for m in runtime.modules.values() for b in m.buffers()
            if not b.is_floating_point() and b.dtype != torch.bool}


@torch.no_grad()
def sync_buffers(runtime, before: dict[int, torch.Tensor] | None = None) -> None:
    """Average the floating buffers (BatchNorm running statistics) of each stage over its
    replicas, stage by stage, so every replica continues from the same state. Integer buffers
    (``num_batches_tracked``) count micro-batches: given their values ``before`` the
    iteration (``counters``), each replica's count becomes the start plus every replica's
    increase, the micro-batches the stage ran in all, as one device running them counts."""
    grid, place = runtime.grid, runtime.grid.placement
    for stage in range(place.stages):
        group = grid.stage_groups.get(stage)
        mine = [m for (p, s), m in sorted(runtime.modules.items()) if s == stage]
        if not mine or group is None:
            continue
        if before is not None:
            _add_counts(runtime, mine, before, group)
        bufs = [[b for b in m.buffers() if b.is_floating_point()] for m in mine]
        if not bufs[0]:
            continue
        flat = torch.stack([torch.cat([b.reshape(-1).double() for b in bs]) for bs in bufs]).sum(0)
        runtime.all_reduce(flat, group)  # in the rank's one order (strict emulation)
        flat /= place.pipes * grid.data_parallel
        for bs in bufs:
            offset = 0
            for b in bs:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()


def _add_counts(runtime, mine: list, before: dict[int, torch.Tensor], group) -> None:
    """Integer buffers of one stage's replicas on this rank: the sum of the increases over
    the stage's replica group, added to the common start."""
    bufs = [[b for b in m.buffers() if id(b) in before] for m in mine]
    if not bufs[0]:
        return
    rises = torch.stack([torch.cat([(b - before[id(b)]).reshape(-1).long() for b in bs])
                         for bs in bufs]).sum(0)
    runtime.all_reduce(rises, group)  # in the rank's one order (strict emulation)
    for bs in bufs:
        offset = 0
        for b in bs:
            b.copy_((before[id(b)].reshape(-1).long() + rises[offset:offset + b.numel()])
                    .view_as(b).to(b.dtype))
            offset += b.numel()
