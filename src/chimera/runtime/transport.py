"""The transport: the ``torch.distributed`` calls the runtime makes, as an object it is given.

A :class:`Transport` has ``torch.distributed``'s names and arguments for what the runtime
uses (``get_rank``, ``isend``, ``all_reduce``, ``new_group``, ...), so code reads as it would
against ``dist``. The implementations:

- :class:`TorchDist`: ``torch.distributed`` itself (gloo, NCCL): the default.
- :class:`OneRank`: a world of one, collectives are the identity (a single-process run).
- :class:`chimera.runtime.nccl_emulation.NcclEmulation`: wraps another transport and gives its
  p2p and async collectives NCCL's rendezvous semantics.
- :class:`chimera.runtime.virtual.VirtualRank`: one rank of an in-process world of threads.

A run is handed its transport in its :class:`~chimera.runtime.context.RunContext`, made once
where the run starts and passed down (``api.Pipeline -> PipelineRuntime -> Executor``, the
trainer, checkpoints, fault reports, the bench). :func:`current` and :func:`using` remain for
the launchers only: ``run_virtual`` puts each virtual rank's transport in effect on its
thread, and ``RunContext.here()`` reads it once, where a run in that thread starts. Setting
up and tearing down process groups (``init_process_group``) is the launchers' job, not the
transport's (:mod:`chimera.runtime.workers`, ``train.launch``).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from typing import Iterator

import torch
import torch.distributed as dist

__all__ = ["Done", "OneRank", "ReduceOp", "TorchDist", "Transport", "Wrapping", "current",
           "local_store", "using"]

ReduceOp = dist.ReduceOp  # an enum only: usable with any transport, initialized or not


def local_store():
    """A rendezvous store shared by the threads of this process (the ranks of an in-process
    world), with the methods of the default process group's."""
    return dist.HashStore()


class Done:
    """The work of an operation that completed at the call (``wait`` as gloo's: True)."""

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Transport:
    """What the runtime asks of ``torch.distributed``; every method as ``dist``'s, by name
    and arguments. ``group=None`` is every rank. Works (``async_op=True``, ``isend``) answer
    ``wait(timeout)`` (False on timeout) and ``is_completed()``.

    Its traits, asked instead of the backend's name:

    - ``matches_by_tag``: a receive may be posted ahead without holding up other operations
      (gloo's tagged, buffered p2p), unlike NCCL's FIFO streams (``Mailbox.receive``);
    - ``device_collectives``: tensors handed to it must live on the device (NCCL's), so the
      runtime's small collectives (loss, norm, fingerprint) and its plan of buckets and
      reduce-scatters are the device path's;
    - ``timed_waits``: a wait blocks the host and takes ``--comm-timeout`` (gloo, virtual
      ranks); NCCL's waits only order streams, its own timeout and watchdog catch hangs.
    """

    matches_by_tag = False
    device_collectives = False
    timed_waits = True

    # -- who am I ---------------------------------------------------------------------
    def is_initialized(self) -> bool:
        raise NotImplementedError

    def get_rank(self, group=None) -> int:
        raise NotImplementedError

    def get_world_size(self, group=None) -> int:
        raise NotImplementedError

    def get_backend(self, group=None) -> str:
        raise NotImplementedError

    def get_process_group_ranks(self, group) -> list[int]:
        raise NotImplementedError

    def new_group(self, ranks):
        """A group over ``ranks``; every rank calls it for every group, in one order."""
        raise NotImplementedError

    def store(self):
        """The rendezvous store (``set``/``get``/``add``/``check``/``delete_key``) every rank
        of the world shares: the NCCL emulation's handshakes, the ranks' positions on a hang."""
        raise NotImplementedError

    # -- p2p --------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, group=None):
        raise NotImplementedError

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0, group=None):
        raise NotImplementedError

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0, group=None) -> None:
        self.isend(tensor, dst, tag, group).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0, group=None) -> None:
        self.irecv(tensor, src, tag, group).wait()

    # -- collectives ------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
        raise NotImplementedError

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, group=None,
                              async_op: bool = False):
        """The group's sum of ``input``, slice k (of equal slices) into member k's ``output``."""
        raise NotImplementedError

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, group=None,
                          async_op: bool = False):
        """Every member's ``input`` into ``output``, in rank order."""
        raise NotImplementedError

    def all_gather(self, tensor_list: list, tensor: torch.Tensor, group=None, async_op: bool = False):
        raise NotImplementedError

    def broadcast(self, tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
        raise NotImplementedError

    def broadcast_object_list(self, object_list: list, src: int = 0, group=None) -> None:
        raise NotImplementedError

    def all_gather_object(self, object_list: list, obj, group=None) -> None:
        raise NotImplementedError

    def gather_object(self, obj, object_gather_list: list | None = None, dst: int = 0,
                      group=None) -> None:
        raise NotImplementedError

    def barrier(self, group=None, device_ids: list[int] | None = None) -> None:
        raise NotImplementedError


class Wrapping(Transport):
    """A transport that passes every call to ``inner`` (a Transport, or the ``torch.distributed``
    module itself); a subclass overrides the calls it changes."""

    def __init__(self, inner):
        self.inner = inner

    # a wrapper keeps what its transport needs of tensors and waits; it matches by tag only
    # where it says so (the NCCL emulation, for one, does not)
    @property
    def device_collectives(self) -> bool:
        return bool(getattr(self.inner, "device_collectives", False))

    @property
    def timed_waits(self) -> bool:
        return bool(getattr(self.inner, "timed_waits", True))

    def is_initialized(self) -> bool:
        return self.inner.is_initialized()

    def get_rank(self, group=None) -> int:
        return self.inner.get_rank(group)

    def get_world_size(self, group=None) -> int:
        return self.inner.get_world_size(group)

    def get_backend(self, group=None) -> str:
        return self.inner.get_backend(group)

    def get_process_group_ranks(self, group) -> list[int]:
        return self.inner.get_process_group_ranks(group)

    def new_group(self, ranks):
        return self.inner.new_group(ranks)

    def store(self):
        return self.inner.store()

    def isend(self, tensor, dst, tag=0, group=None):
        return self.inner.isend(tensor, dst=dst, tag=tag, group=group)

    def irecv(self, tensor, src, tag=0, group=None):
        return self.inner.irecv(tensor, src=src, tag=tag, group=group)

    def send(self, tensor, dst, tag=0, group=None) -> None:
        self.inner.send(tensor, dst=dst, tag=tag, group=group)

    def recv(self, tensor, src, tag=0, group=None) -> None:
        self.inner.recv(tensor, src=src, tag=tag, group=group)

    def all_reduce(self, tensor, op=ReduceOp.SUM, group=None, async_op=False):
        return self.inner.all_reduce(tensor, op=op, group=group, async_op=async_op)

    def reduce_scatter_single(self, output, input, group=None, async_op=False):
        return self.inner.reduce_scatter_single(output, input, group=group, async_op=async_op)

    def all_gather_single(self, output, input, group=None, async_op=False):
        return self.inner.all_gather_single(output, input, group=group, async_op=async_op)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        return self.inner.all_gather(tensor_list, tensor, group=group, async_op=async_op)

    def broadcast(self, tensor, src, group=None, async_op=False):
        return self.inner.broadcast(tensor, src=src, group=group, async_op=async_op)

    def broadcast_object_list(self, object_list, src=0, group=None) -> None:
        self.inner.broadcast_object_list(object_list, src=src, group=group)

    def all_gather_object(self, object_list, obj, group=None) -> None:
        self.inner.all_gather_object(object_list, obj, group=group)

    def gather_object(self, obj, object_gather_list=None, dst=0, group=None) -> None:
        self.inner.gather_object(obj, object_gather_list, dst=dst, group=group)

    def barrier(self, group=None, device_ids=None) -> None:
        self.inner.barrier(group=group, device_ids=device_ids)


class TorchDist(Wrapping):
    """``torch.distributed``: the process group ``init_process_group`` set up."""

    def __init__(self):
        super().__init__(dist)

    def is_initialized(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def _backend(self) -> str | None:
        return self.get_backend() if self.is_initialized() else None

    @property
    def matches_by_tag(self) -> bool:
        return self._backend() == "gloo"

    @property
    def device_collectives(self) -> bool:
        return self._backend() == "nccl"

    @property
    def timed_waits(self) -> bool:
        return self._backend() != "nccl"

    # p2p in the default group (the mailbox's): the group's own send and receive, which is all
    # dist.isend/irecv do there for a plain tensor, without their argument handling (~4 of
    # 16 us warm per message on gloo, several times that on a host just woken from a wait)
    def isend(self, tensor, dst, tag=0, group=None):
        if group is None and type(tensor) is torch.Tensor and not tensor.is_complex():
            return dist.group.WORLD.send([tensor], dst, tag)
        return dist.isend(tensor, dst=dst, tag=tag, group=group)

    def irecv(self, tensor, src, tag=0, group=None):
        if group is None and type(tensor) is torch.Tensor and not tensor.is_complex():
            return dist.group.WORLD.recv([tensor], src, tag)
        return dist.irecv(tensor, src=src, tag=tag, group=group)

    def store(self):
        return dist.distributed_c10d._get_default_store()

    def __repr__(self) -> str:
        return "TorchDist()"


class _Solo:
    """The one group of a world of one."""

    ranks = [0]
    group_name = "solo"


class OneRank(Transport):
    """A world of one rank: collectives leave their tensors as they are (the sum, maximum,
    gather or broadcast of one contribution is itself); there is no peer to message."""

    def __init__(self):
        self._store = local_store()

    def is_initialized(self) -> bool:
        return True

    def get_rank(self, group=None) -> int:
        return 0

    def get_world_size(self, group=None) -> int:
        return 1

    def get_backend(self, group=None) -> str:
        return "one-rank"

    def get_process_group_ranks(self, group) -> list[int]:
        return [0]

    def new_group(self, ranks):
        if list(ranks) != [0]:
            raise ValueError(f"a world of one rank has no group over ranks {list(ranks)}")
        return _Solo()

    def store(self):
        return self._store

    def isend(self, tensor, dst, tag=0, group=None):
        raise RuntimeError(f"a world of one rank has no peer {dst} to send to")

    def irecv(self, tensor, src, tag=0, group=None):
        raise RuntimeError(f"a world of one rank has no peer {src} to receive from")

    @staticmethod
    def _done(async_op: bool):
        return Done() if async_op else None

    def all_reduce(self, tensor, op=ReduceOp.SUM, group=None, async_op=False):
        return self._done(async_op)

    def reduce_scatter_single(self, output, input, group=None, async_op=False):
        output.copy_(input.reshape(output.shape))
        return self._done(async_op)

    def all_gather_single(self, output, input, group=None, async_op=False):
        output.copy_(input.reshape(output.shape))
        return self._done(async_op)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        tensor_list[0].copy_(tensor)
        return self._done(async_op)

    def broadcast(self, tensor, src, group=None, async_op=False):
        return self._done(async_op)

    def broadcast_object_list(self, object_list, src=0, group=None) -> None:
        pass

    def all_gather_object(self, object_list, obj, group=None) -> None:
        object_list[0] = obj

    def gather_object(self, obj, object_gather_list=None, dst=0, group=None) -> None:
        if object_gather_list is not None:
            object_gather_list[0] = obj

    def barrier(self, group=None, device_ids=None) -> None:
        pass

    def __repr__(self) -> str:
        return "OneRank()"


_DEFAULT = TorchDist()
_local = threading.local()


def current() -> Transport:
    """The transport in effect on this thread: the innermost :func:`using`, else
    :class:`TorchDist`."""
    return getattr(_local, "transport", None) or _DEFAULT


@contextlib.contextmanager
def using(transport: Transport) -> Iterator[Transport]:
    """Within the block, :func:`current` on this thread is ``transport``."""
    saved = getattr(_local, "transport", None)
    _local.transport = transport
    try:
        yield transport
    finally:
        _local.transport = saved
