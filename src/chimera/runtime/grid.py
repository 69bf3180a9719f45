"""The process grid: P = W·D·T ranks, global rank = (w·D + d)·T + t, and its groups.

Tensor parallelism is innermost (the T ranks of a pipeline rank sit on one node, where its
two allreduces per block are cheap), pipeline depth next, data parallelism outermost, as
Megatron-LM and torchtitan lay them out. The T ranks of pipeline rank d hold the same stage
replicas, each a shard, and run the same lowered program in lockstep; a message goes from
(d, t) to (d', t) of the same data-parallel copy; a stage's replicas reduce their gradients
per t (over local shards), in a group over every pipe's and every copy's replica of the
stage at that t. Every group is created by every rank in one global order
(:func:`group_order`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from chimera.check.comm_plan import CommPlan
from chimera.ir import Placement
from chimera.runtime.transport import Transport


def stage_ranks(placement: Placement, data_parallel: int, tensor_parallel: int, stage: int,
                t: int) -> list[int]:
    """The global ranks of every replica of ``stage`` at TP position ``t``, ascending."""
    depth = placement.ranks
    return sorted({(w * depth + d) * tensor_parallel + t for w in range(data_parallel)
                   for d in placement.replicas(stage)})


def group_order(placement: Placement, data_parallel: int, tensor_parallel: int = 1) -> list[tuple]:
    """Every group of the grid, in the one order every rank creates them:
    ``("stage", stage, t, ranks)`` for each stage and TP position (stages in order), then
    ``("tp", w, d, ranks)`` for each pipeline rank of each data-parallel copy when T > 1.
    Ranks ascending; a single-rank group is listed (it is not created: nothing to reduce)."""
    depth, t_count = placement.ranks, tensor_parallel
    out: list[tuple] = []
    for stage in range(placement.stages):
        for t in range(t_count):
            out.append(("stage", stage, t,
                        stage_ranks(placement, data_parallel, t_count, stage, t)))
    if t_count > 1:
        for w in range(data_parallel):
            for d in range(depth):
                out.append(("tp", w, d, [(w * depth + d) * t_count + t for t in range(t_count)]))
    return out


@dataclass
class ProcessGrid:
    """Where this process sits: TP position ``t`` of pipeline rank ``d`` in data-parallel
    copy ``w``.

    ``stage_ranks[s]`` are the ranks of every replica of stage s at our ``t`` (one per pipe
    on each of the W pipeline copies), for every stage; ``stage_groups[s]`` their process
    group, for the stages we hold; None where that is a single rank (nothing to reduce). ``tp_group`` is the group of our pipeline rank's T ranks (None when T = 1).
    """

    placement: Placement
    data_parallel: int
    rank: int  # global
    tensor_parallel: int = 1
    stage_groups: dict[int, object] = field(default_factory=dict)
    stage_ranks: dict[int, list[int]] = field(default_factory=dict)
    tp_group: object = None
    tp_ranks: list[int] = field(default_factory=list)
    built: bool = False  # build_groups ran (the groups exist; it runs once)

    @property
    def depth(self) -> int:
        return self.placement.ranks

    @property
    def world(self) -> int:
        return self.depth * self.data_parallel * self.tensor_parallel

    @property
    def t(self) -> int:
        return self.rank % self.tensor_parallel

    @property
    def d(self) -> int:
        return (self.rank // self.tensor_parallel) % self.depth

    @property
    def w(self) -> int:
        return self.rank // (self.tensor_parallel * self.depth)

    def global_rank(self, d: int, w: int | None = None, t: int | None = None) -> int:
        """Global rank of TP position ``t`` of pipeline rank ``d`` in data-parallel copy ``w``
        (default: ours)."""
        w = self.w if w is None else w
        t = self.t if t is None else t
        return (w * self.depth + d) * self.tensor_parallel + t

    def stage_ranks_at(self, stage: int, t: int) -> list[int]:
        """The ranks of every replica of ``stage`` at TP position ``t``, ascending."""
        return stage_ranks(self.placement, self.data_parallel, self.tensor_parallel, stage, t)

    def d_of(self, rank: int) -> int:
        """The pipeline rank of global rank ``rank``."""
        return (rank // self.tensor_parallel) % self.depth

    def peer(self, pipe: int, stage: int) -> int:
        """Global rank holding (pipe, stage) at our TP position in our pipeline copy."""
        return self.global_rank(self.placement.rank_of(pipe, stage))

    def held(self) -> list[tuple[int, int]]:
        return self.placement.held(self.d)

    def build_groups(self, transport: Transport) -> None:
        """Create every group of :func:`group_order`; every rank calls new_group for each
        group of more than one rank, in that order, and keeps its own. Once: the API builds
        the groups before the stages (a stage's TP layers need their group), the runtime
        after them."""
        if self.built:
            return
        self.built = True
        for kind, a, b, ranks in group_order(self.placement, self.data_parallel,
                                             self.tensor_parallel):
            group = transport.new_group(ranks) if len(ranks) > 1 else None
            if kind == "stage" and b == self.t:  # every stage's ranks at our t; our groups
                self.stage_ranks[a] = ranks
                if self.rank in ranks:
                    self.stage_groups[a] = group
            elif kind == "tp" and self.rank in ranks:
                self.tp_ranks, self.tp_group = ranks, group

    def pairs(self, plan: CommPlan) -> list[tuple[int, int]]:
        """Every pair of global ranks that exchanges p2p messages, sorted."""
        inner = {tuple(sorted(msg.ranks(plan.schedule))) for msg in plan.order}
        return sorted((self.global_rank(a, w, t), self.global_rank(b, w, t))
                      for w in range(self.data_parallel) for t in range(self.tensor_parallel)
                      for a, b in inner)

    def warm_up(self, plan: CommPlan, device: torch.device, transport: Transport) -> None:
        """Create every communicator now, in one order on every rank.

        NCCL creates a communicator at its first use, and creation blocks until every member
        arrives: inside the pipeline that is a barrier nobody planned for. So, before the
        first iteration: a one-element allreduce on each stage group (stages in order), one
        on the TP group, then a one-element exchange for each pair of ranks that talks
        (pairs in sorted order). Each rank's list is a subsequence of one global list, so
        these blocking steps cannot wait on each other in a cycle. Cheap on gloo, where it
        only opens the connections.
        """
        one = torch.zeros(1, device=device)
        for stage in sorted(self.stage_groups):
            if self.stage_groups[stage] is not None:
                transport.all_reduce(one, group=self.stage_groups[stage])
        if self.tp_group is not None:
            transport.all_reduce(one, group=self.tp_group)
        for a, b in self.pairs(plan):
            if self.rank == a:
                transport.send(one, dst=b)
            elif self.rank == b:
                transport.recv(one, src=a)
