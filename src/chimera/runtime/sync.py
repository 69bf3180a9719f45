"""Gradient sync: one flat gradient buffer per stage replica, allreduced asynchronously.

Each replica's parameters get ``.grad`` views into one flat buffer (as DDP's
``gradient_as_bucket_view``), so backward accumulates straight into it and SYNC launches a
single allreduce over the stage's replica group without copies. STEP waits for all of them.

On the device path (:func:`comm_choices`), a replica whose stage the plan lets bucket
(:attr:`chimera.check.comm_plan.CommPlan.early`: decided per stage, so every replica of the stage
does the same) does not wait for its Launch: during its last backward, hooks launch the
allreduce of each bucket (a contiguous slice of the flat buffer, last layers first: the
order backward finishes them) as soon as all of its gradients are final, so the reduction
overlaps the rest of the backward as in DDP. Buckets launch in a fixed order on every
replica (a bucket waits for the ones before it) with the same boundaries (the same
parameters), which is what matching collectives need; the Launch issues whatever is left.
The plan allows it only where no send lies between that backward and the Launch, so the
rank's order of operations is the same as without buckets (one stream per rank survives
it); that leaves mostly stage 0, whose last backward sends nothing.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
from torch import nn

from chimera.runtime.p2p import peers_text, wait_work
from chimera.runtime.transport import Transport

BUCKET_BYTES = 4 * 2**20  # allreduce granularity inside the last backward (0: one allreduce at SYNC)


@dataclass(frozen=True)
class CommChoices:
    """What the device path and the CPU path decide differently about a replica's gradient
    collectives. ``bucket_bytes``: bucket size inside the last backward, where the plan
    allows (:attr:`chimera.check.comm_plan.CommPlan.early`; 0: one allreduce at the Launch);
    ``reduce_scatter``: a sharded replica reduces by reduce-scatter (else by an allreduce of
    its whole buffer, whose owned slice is copied out)."""

    bucket_bytes: int
    reduce_scatter: bool


def comm_choices(device: torch.device, device_collectives: bool = False,
                 device_plan: int = 0) -> CommChoices:
    """The device path's choices on CUDA or where the transport's collectives run on the
    device (NCCL); the CPU path's elsewhere, where buckets measured no faster
    (benchmarks/RESULTS.md, "Making the runtime fast") and gloo's reduce-scatter is slower
    than its allreduce (:mod:`chimera.runtime.shard`).

    ``device_plan`` (:class:`chimera.runtime.context.RuntimeOptions`; ``--device-plan`` or
    ``CHIMERA_DEVICE_PLAN``): 1 makes a CPU run take the device path's choices, so CPU tests
    issue exactly the collectives a GPU run issues; above 1 it also sets the bucket size in
    bytes, so a tiny test model is cut into several buckets. Every rank must have the same
    (:func:`chimera.runtime.nccl_emulation.agree`)."""
    if device.type == "cuda" or device_collectives or device_plan:
        return CommChoices(device_plan if device_plan > 1 else BUCKET_BYTES, True)
    return CommChoices(0, False)


class ReplicaGrads:
    """The flat gradient buffer of one (pipe, stage) replica.

    ``.grad`` of each parameter is a view into ``flat``. PyTorch habits detach it:
    ``optimizer.zero_grad()`` sets ``.grad`` to None by default, and user code may assign a
    new tensor; the allreduce would then reduce a buffer that backward no longer writes.
    ``attach`` (run before every iteration) points each ``.grad`` back at its view, keeping
    the values a kept gradient had.
    """

    def __init__(self, module: nn.Module, device: torch.device | None = None, multiple: int = 1):
        self.params = [p for p in module.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in self.params)
        numel = -(-numel // multiple) * multiple  # a reduce-scatter over n needs n | size
        dtype = self.params[0].dtype if self.params else torch.float32
        # a frozen stage's one-element buffer lives on the runtime's device too (NCCL)
        device = self.params[0].device if self.params else (device or torch.device("cpu"))
        # one element at least: a frozen stage still takes part in its replicas' allreduce
        self.flat = torch.zeros(max(numel, 1), dtype=dtype, device=device)
        self.offsets, self.views, offset = [], [], 0
        for p in self.params:
            view = self.flat[offset:offset + p.numel()].view_as(p)
            p.grad = view
            self.views.append(view)
            self.offsets.append(offset)
            offset += p.numel()

    def attach(self, keep: bool = False) -> None:
        """Re-point detached ``.grad``s at the flat buffer; zero it unless ``keep`` (then a
        ``.grad`` set to None counts as zero and an assigned tensor's values are copied in)."""
        for p, view in zip(self.params, self.views):
            g = p.grad
            if g is not None and g.data_ptr() == view.data_ptr() and g.shape == view.shape:
                continue
            if keep:
                view.copy_(g) if g is not None else view.zero_()
            p.grad = view
        if not keep:
            self.flat.zero_()

    def buckets(self, cap_bytes: int) -> list[tuple[int, int, list[nn.Parameter]]]:
        """(start, end, parameters) of consecutive slices of at least ``cap_bytes`` (the last
        may be smaller), from the end of the buffer to its start."""
        out, end, members, size = [], self.flat.numel(), [], 0
        for p, offset in zip(reversed(self.params), reversed(self.offsets)):
            members.append(p)
            size += p.numel() * p.element_size()
            if size >= cap_bytes:
                out.append((offset, end, members))
                end, members, size = offset, [], 0
        if members:
            out.append((0, end, members))
        return out

    def zero(self) -> None:
        self.attach(keep=False)


class GradSync:
    """Launches each replica's allreduce where the CommPlan puts its Launch; waits at STEP.

    Launches follow the plan's global order of collectives on every rank (what NCCL needs of
    communicators used concurrently); ``arm`` is called only for replicas the plan allows to
    reduce bucket by bucket inside their last backward.
    """

    def __init__(self, grads: dict[tuple[int, int], ReplicaGrads], groups: dict[int, object],
                 rank: int, timeout_s: float | None, bucket_bytes: int,
                 transport: Transport, shards: dict | None = None):
        self.grads, self.groups, self.rank = grads, groups, rank
        self.shards = shards or {}  # (pipe, stage) -> StageShard: its slice of the group's sum (ZeRO-1)
        # the stage collectives' transport (the NCCL emulation's collective stream, under it);
        # held, not looked up: bucket hooks may run on autograd's device thread
        self.transport = transport
        self.timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        self.bucket_bytes = bucket_bytes
        self.inflight: list[tuple[object, tuple[int, int]]] = []
        self.early: dict[tuple[int, int], _EarlySync] = {}
        self.peers = {stage: self.transport.get_process_group_ranks(g) for stage, g in groups.items() if g}

    def arm(self, pipe: int, stage: int) -> None:
        """Called right before the replica's last backward: reduce buckets as they finish."""
        group = self.groups.get(stage)
        if group is not None and self.bucket_bytes > 0 and (pipe, stage) not in self.shards:
            self.early[(pipe, stage)] = _EarlySync(self, pipe, stage, group)

    def launch(self, pipe: int, stage: int, tensor: torch.Tensor, group) -> None:
        work = self.transport.all_reduce(tensor, group=group, async_op=True)
        self.inflight.append((work, (pipe, stage)))

    def start(self, pipe: int, stage: int) -> None:
        early = self.early.pop((pipe, stage), None)
        if early is not None:
            early.finish()
            return
        group = self.groups.get(stage)
        if group is None:  # the only replica of this stage: nothing to reduce
            return
        shard = self.shards.get((pipe, stage))
        if shard is not None:
            work = shard.reduce(self.grads[(pipe, stage)].flat, self.transport)
            self.inflight.append((work, (pipe, stage)))
            return
        self.launch(pipe, stage, self.grads[(pipe, stage)].flat, group)

    def wait_all(self) -> None:
        for work, (pipe, stage) in self.inflight:
            what = (f"gradient allreduce of stage {stage} (pipe {pipe}) with "
                    f"{peers_text(self.rank, self.peers[stage])}")
            wait_work(work, self.timeout, self.rank, what, self.peers[stage])
        self.inflight.clear()


class _EarlySync:
    """The bucket allreduces of one replica, launched by gradient hooks in a fixed order."""

    def __init__(self, sync: GradSync, pipe: int, stage: int, group):
        self.sync, self.key, self.group = sync, (pipe, stage), group
        self.flat = sync.grads[(pipe, stage)].flat
        self.buckets = sync.grads[(pipe, stage)].buckets(sync.bucket_bytes)
        self.missing = [len(members) for _, _, members in self.buckets]
        self.bucket_of = {id(p): k for k, (_, _, members) in enumerate(self.buckets) for p in members}
        self.next = 0
        self.handles = [p.register_post_accumulate_grad_hook(self._ready)
                        for _, _, members in self.buckets for p in members]

    def _ready(self, param: torch.Tensor) -> None:
        self.missing[self.bucket_of[id(param)]] -= 1
        while self.next < len(self.buckets) and self.missing[self.next] <= 0:
            self._launch()

    def _launch(self) -> None:
        start, end, _ = self.buckets[self.next]
        self.sync.launch(*self.key, self.flat[start:end], self.group)
        self.next += 1

    def finish(self) -> None:
        """At SYNC: no more hooks; launch the buckets still waiting (e.g. unused parameters)."""
        for h in self.handles:
            h.remove()
        while self.next < len(self.buckets):
            self._launch()
