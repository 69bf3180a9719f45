"""Gradient sync: one flat gradient buffer per stage replica, allreduced asynchronously.

Each replica's parameters get ``.grad`` views into one flat buffer (as DDP's
``gradient_as_bucket_view``), so backward accumulates straight into it and SYNC launches a
single allreduce over the stage's replica group without copies. STEP waits for all of them.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch import nn

from chimera.runtime.p2p import CommTimeout


class ReplicaGrads:
    """The flat gradient buffer of one (pipe, stage) replica."""

    def __init__(self, module: nn.Module):
        self.params = [p for p in module.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in self.params)
        dtype = self.params[0].dtype if self.params else torch.float32
        device = self.params[0].device if self.params else torch.device("cpu")
        self.flat = torch.zeros(numel, dtype=dtype, device=device)
        offset = 0
        for p in self.params:
            p.grad = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def zero(self) -> None:
        self.flat.zero_()


class GradSync:
    """Launches each replica's allreduce at its SYNC action and waits for all at STEP."""

    def __init__(self, grads: dict[tuple[int, int], ReplicaGrads], groups: dict[int, object],
                 rank: int, timeout_s: float):
        self.grads, self.groups, self.rank = grads, groups, rank
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.inflight: list[tuple[object, tuple[int, int]]] = []

    def start(self, pipe: int, stage: int) -> None:
        group = self.groups.get(stage)
        if group is None:  # the only replica of this stage: nothing to reduce
            return
        work = dist.all_reduce(self.grads[(pipe, stage)].flat, group=group, async_op=True)
        self.inflight.append((work, (pipe, stage)))

    def wait_all(self) -> None:
        for work, (pipe, stage) in self.inflight:
            try:
                ok = work.wait(self.timeout)
            except RuntimeError as exc:
                raise self._error(pipe, stage, f"failed: {str(exc).splitlines()[0]}") from exc
            if ok is False:
                raise self._error(pipe, stage, f"timed out after {self.timeout.total_seconds():g}s")
        self.inflight.clear()

    def _error(self, pipe: int, stage: int, how: str) -> CommTimeout:
        peers = dist.get_process_group_ranks(self.groups[stage])
        what = f"gradient allreduce of stage {stage} (pipe {pipe}) with ranks {peers}"
        return CommTimeout(f"rank {self.rank}: {what} {how}", self.rank, peer=peers, what=what)
