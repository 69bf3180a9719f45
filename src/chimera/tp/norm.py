"""Parameters and gradients of a sharded layer, as clipping and export need them.

After ``parallelize`` a parameter is a DTensor (a shard on each rank, or a replicated
bias) or a plain tensor (norms, everything the plan does not name: replicated). Its
``.grad`` is of the same kind. A gradient norm over the whole model is then a sum over
the TP group of per-rank shares, where a shard counts on its own rank and a replicated
tensor on one rank only (t == 0: exact, where dividing it by T would round); summing
every rank's squares instead counts the replicated tensors T times, and the ranks of a TP
group then clip by different norms and drift apart.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from chimera.tp.vocab import PADDED_ROWS


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (replicated: the whole), a plain
    tensor itself. The storage is shared, so an in-place change reaches the parameter."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor, padded_like: torch.Tensor | None = None) -> torch.Tensor:
    """The whole of ``t`` in its original layout (a collective over the TP group for a
    sharded DTensor: every rank must call it), vocabulary padding stripped as marked on ``t``
    (a parameter) or on ``padded_like`` (the parameter of the gradient ``t``)."""
    full = t.full_tensor() if isinstance(t, DTensor) else t
    rows = getattr(t if padded_like is None else padded_like, PADDED_ROWS, None)
    return full if rows is None else full[:rows]


def full_grad(p: torch.Tensor) -> torch.Tensor | None:
    """The whole gradient of parameter ``p`` (see ``full_tensor``), None if it has none."""
    return None if p.grad is None else full_tensor(p.grad, padded_like=p)


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every tensor whole and unpadded, as one process holds it
    (for export; a collective per sharded tensor, so every rank of the TP group calls it)."""
    # keep_vars: the parameters themselves, which carry their padding mark (detach drops it)
    return {name: full_tensor(t).detach() for name, t in module.state_dict(keep_vars=True).items()}


def _rank_and_size(group) -> tuple[int, int]:
    """(t, T) of a ProcessGroup or a 1-D DeviceMesh (queries only, no communication)."""
    if hasattr(group, "get_local_rank"):
        return group.get_local_rank(), group.size()
    return group.rank(), group.size()


def _replicated(grad: torch.Tensor) -> bool:
    if not isinstance(grad, DTensor):
        return True
    if any(p.is_partial() for p in grad.placements):
        raise ValueError("tensor parallel: a gradient is a Partial DTensor (unreduced); "
                         "its squared norm has no per-rank share")
    return all(isinstance(p, Replicate) for p in grad.placements)


def squared_norm_share(params: Iterable[torch.Tensor], tp_group) -> torch.Tensor:
    """This rank's share of the squared L2 norm of the gradients of ``params`` (float64,
    0-dim): summed over the TP group (``tp_group``: its ProcessGroup or 1-D DeviceMesh) it
    is the squared norm of the unsharded model's gradients. Parameters without a gradient
    count zero."""
    t, _ = _rank_and_size(tp_group)
    sums = [local_tensor(p.grad).detach().double().pow(2).sum() for p in params
            if p.grad is not None and (t == 0 or not _replicated(p.grad))]
    return torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.float64)
