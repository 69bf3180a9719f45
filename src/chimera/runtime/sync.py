"""Gradient sync: one flat gradient buffer per stage replica, allreduced asynchronously.

Each replica's parameters get ``.grad`` views into one flat buffer (as DDP's
``gradient_as_bucket_view``), so backward accumulates straight into it and SYNC launches a
single allreduce over the stage's replica group without copies. STEP waits for all of them.

What each replica issues, and when, is :mod:`chimera.collectives`' (one definition that the
checks and the simulator read too). On the device path (:func:`comm_choices`), a replica whose stage the plan lets bucket
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

import torch
from torch import nn

from chimera.collectives import (AT_LAUNCH, Choices, Collective, bucketed, buckets, choices,
                                 flat_size, replica_collectives)
from chimera.runtime.p2p import peers_text, wait_work
from chimera.runtime.transport import Transport


def comm_choices(device: torch.device, device_collectives: bool = False,
                 device_plan: int = 0) -> Choices:
    """:func:`chimera.collectives.choices` for a run on ``device`` whose transport runs its
    collectives on the device (``device_collectives``: NCCL) or not; ``device_plan``
    (:class:`chimera.runtime.context.RuntimeOptions`; ``--device-plan`` or
    ``CHIMERA_DEVICE_PLAN``) forces the device path's choices on CPU. Every rank must have the
    same (:func:`chimera.runtime.nccl_emulation.agree`)."""
    return choices(device.type == "cuda" or device_collectives, device_plan)


class ReplicaGrads:
    """The flat gradient buffer of one (pipe, stage) replica (its size:
    :func:`chimera.collectives.flat_size`).

    ``.grad`` of each parameter is a view into ``flat``. PyTorch habits detach it:
    ``optimizer.zero_grad()`` sets ``.grad`` to None by default, and user code may assign a
    new tensor; the allreduce would then reduce a buffer that backward no longer writes.
    ``attach`` (run before every iteration) points each ``.grad`` back at its view, keeping
    the values a kept gradient had.
    """

    def __init__(self, module: nn.Module, device: torch.device | None = None, multiple: int = 1):
        self.params = [p for p in module.parameters() if p.requires_grad]
        dtype = self.params[0].dtype if self.params else torch.float32
        # a frozen stage's one-element buffer lives on the runtime's device too (NCCL)
        device = self.params[0].device if self.params else (device or torch.device("cpu"))
        self.flat = torch.zeros(flat_size([p.numel() for p in self.params], multiple),
                                dtype=dtype, device=device)
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
        """(start, end, parameters) of the buffer's buckets, from its end to its start
        (:func:`chimera.collectives.buckets`)."""
        return [(start, end, self.params[first:last]) for start, end, first, last in
                buckets([p.numel() for p in self.params], self.flat.element_size(), cap_bytes,
                        self.flat.numel())]

    def bucket_sizes(self, cap_bytes: int) -> tuple[int, ...]:
        """Element counts of the buckets in launch order; () with nothing to train."""
        return tuple(end - start for start, end, _ in self.buckets(max(cap_bytes, 1)))

    def zero(self) -> None:
        self.attach(keep=False)


def plan_collectives(grads: dict[tuple[int, int], ReplicaGrads], members: dict[int, int],
                     choices: Choices, early=None, sharded: bool = False
                     ) -> dict[tuple[int, int], tuple[Collective, ...]]:
    """Per replica, what it issues in an iteration (:func:`chimera.collectives.
    replica_collectives`): ``members`` per stage its group's size, ``early`` the replicas the
    plan lets reduce inside their last backward (``CommPlan.early``; None: every one)."""
    return {key: replica_collectives(g.bucket_sizes(choices.bucket_bytes), members.get(key[1], 1),
                                     choices, early=early is None or key in early, sharded=sharded)
            for key, g in grads.items()}


class GradSync:
    """Issues each replica's collectives (:func:`plan_collectives`) where the CommPlan puts
    them: inside its last backward (``arm``, bucket by bucket) or at its Launch (``start``);
    waits at STEP.

    Launches follow the plan's global order of collectives on every rank (what NCCL needs of
    communicators used concurrently); ``arm`` is called only for replicas the plan allows to
    reduce bucket by bucket inside their last backward.
    """

    def __init__(self, grads: dict[tuple[int, int], ReplicaGrads], groups: dict[int, object],
                 rank: int, timeout_s: float | None, choices: Choices, transport: Transport,
                 shards: dict | None = None, collectives: dict | None = None):
        self.grads, self.groups, self.rank = grads, groups, rank
        self.shards = shards or {}  # (pipe, stage) -> StageShard: its slice of the group's sum (ZeRO-1)
        # the stage collectives' transport (the NCCL emulation's collective stream, under it);
        # held, not looked up: bucket hooks may run on autograd's device thread
        self.transport = transport
        self.timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        self.bucket_bytes = choices.bucket_bytes
        self.inflight: list[tuple[object, tuple[int, int]]] = []
        self.early: dict[tuple[int, int], _EarlySync] = {}
        self.peers = {stage: self.transport.get_process_group_ranks(g) for stage, g in groups.items() if g}
        if collectives is None:  # every replica may bucket where ``arm`` is called
            collectives = plan_collectives(grads, {s: len(r) for s, r in self.peers.items()},
                                           choices, sharded=bool(self.shards))
        self.collectives = collectives

    def arm(self, pipe: int, stage: int) -> None:
        """Called right before the replica's last backward: reduce buckets as they finish."""
        if bucketed(self.collectives[(pipe, stage)]):
            self.early[(pipe, stage)] = _EarlySync(self, pipe, stage, self.groups[stage])

    def launch(self, pipe: int, stage: int, tensor: torch.Tensor, group) -> None:
        work = self.transport.all_reduce(tensor, group=group, async_op=True)
        self.inflight.append((work, (pipe, stage)))

    def start(self, pipe: int, stage: int) -> None:
        """At the replica's Launch: finish its buckets, or issue its collective (an allreduce
        of its flat buffer, or its shard's reduce)."""
        early = self.early.pop((pipe, stage), None)
        if early is not None:
            early.finish()
            return
        for c in self.collectives[(pipe, stage)]:
            if c.when != AT_LAUNCH:
                continue
            shard = self.shards.get((pipe, stage))
            if shard is not None:
                work = shard.reduce(self.grads[(pipe, stage)].flat, self.transport)
                self.inflight.append((work, (pipe, stage)))
            else:
                self.launch(pipe, stage, self.grads[(pipe, stage)].flat, self.groups[stage])

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
