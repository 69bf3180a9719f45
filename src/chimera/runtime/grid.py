"""The process grid: P = W·D ranks, global rank = w·D + d, and one group per stage."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from chimera.check.comm_plan import CommPlan
from chimera.ir import Placement
from chimera.runtime.transport import Transport, current


def collective_device(transport: Transport | None = None) -> torch.device:
    """Where tensors handed to a collective of the default group must live: the current CUDA
    device under NCCL (which rejects CPU tensors), the CPU otherwise. ``transport``: default
    the one in effect (:func:`chimera.runtime.transport.current`)."""
    transport = transport if transport is not None else current()
    if transport.is_initialized() and transport.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class ProcessGrid:
    """Where this process sits: data-parallel replica ``w`` of pipeline rank ``d``.

    ``stage_groups[s]`` is the process group over every replica of stage s (one per pipe on
    each of the W pipeline copies); None where that is a single rank (nothing to reduce).
    """

    placement: Placement
    data_parallel: int
    rank: int  # global
    stage_groups: dict[int, object] = field(default_factory=dict)
    stage_ranks: dict[int, list[int]] = field(default_factory=dict)

    @property
    def depth(self) -> int:
        return self.placement.ranks

    @property
    def world(self) -> int:
        return self.depth * self.data_parallel

    @property
    def w(self) -> int:
        return self.rank // self.depth

    @property
    def d(self) -> int:
        return self.rank % self.depth

    def global_rank(self, d: int, w: int | None = None) -> int:
        """Global rank of pipeline rank ``d`` in data-parallel replica ``w`` (default: ours)."""
        return (self.w if w is None else w) * self.depth + d

    def peer(self, pipe: int, stage: int) -> int:
        """Global rank holding (pipe, stage) in our pipeline copy."""
        return self.global_rank(self.placement.rank_of(pipe, stage))

    def held(self) -> list[tuple[int, int]]:
        return self.placement.held(self.d)

    def build_groups(self, transport: Transport | None = None) -> None:
        """Create one group per stage; every rank calls new_group for every stage, in order."""
        transport = transport if transport is not None else current()
        for stage in range(self.placement.stages):
            ranks = sorted({self.global_rank(d, w) for w in range(self.data_parallel)
                            for d in self.placement.replicas(stage)})
            self.stage_ranks[stage] = ranks
            group = transport.new_group(ranks) if len(ranks) > 1 else None
            if self.rank in ranks:
                self.stage_groups[stage] = group

    def pairs(self, plan: CommPlan) -> list[tuple[int, int]]:
        """Every pair of global ranks that exchanges p2p messages, sorted."""
        inner = {tuple(sorted(msg.ranks(plan.schedule))) for msg in plan.order}
        return sorted((self.global_rank(a, w), self.global_rank(b, w))
                      for w in range(self.data_parallel) for a, b in inner)

    def warm_up(self, plan: CommPlan, device: torch.device, transport: Transport | None = None) -> None:
        """Create every communicator now, in one order on every rank.

        NCCL creates a communicator at its first use, and creation blocks until every member
        arrives: inside the pipeline that is a barrier nobody planned for. So, before the
        first iteration: a one-element allreduce on each stage group (stages in order), then
        a one-element exchange for each pair of ranks that talks (pairs in sorted order).
        Each rank's list is a subsequence of one global list, so these blocking steps cannot
        wait on each other in a cycle. Cheap on gloo, where it only opens the connections.
        """
        transport = transport if transport is not None else current()
        one = torch.zeros(1, device=device)
        for stage in sorted(self.stage_groups):
            if self.stage_groups[stage] is not None:
                transport.all_reduce(one, group=self.stage_groups[stage])
        for a, b in self.pairs(plan):
            if self.rank == a:
                transport.send(one, dst=b)
            elif self.rank == b:
                transport.recv(one, src=a)
