"""What a sharded parameter is, and the way between its local slice and the whole tensor.

Every parameter ``parallelize`` shards is a plain ``nn.Parameter`` holding this rank's slice
and carrying a :class:`Shard` (``p._tp_shard``): which dim of the whole tensor is split, in
how many fused parts, the whole (unpadded) shape and the padded size of that dim. A
parameter without one is replicated: every rank of the TP group holds it whole, and its
gradient is the same on each (norms, row-parallel biases, whatever the plan leaves alone).

Slicing. Dim ``dim`` is padded with zeros to ``padded`` rows (a vocabulary T does not
divide), then cut in T equal slices, slice t on rank t. A fused projection (``parts`` = 3:
GPT-2's q/k/v in one weight) is cut part by part, so rank t holds slice t of q, of k and of
v, back to back: whole heads of each, and the same layout at any T for ``full_tensor``.

Gradient norms: the squared norm of the whole model's gradients is the sum over the TP group
of every rank's sharded squares, plus the replicated squares once (not once per rank: the
ranks would then clip by different norms and drift apart). Padding rows hold zero gradients
and count nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from chimera.tp.group import TPGroup

ATTRIBUTE = "_tp_shard"


@dataclass(frozen=True)
class Shard:
    """How a parameter is cut over the TP group (see the module docstring)."""

    dim: int
    parts: int
    full_shape: tuple
    padded: int


def padded_size(rows: int, tp: int) -> int:
    """``rows`` rounded up to a multiple of ``tp``."""
    return -(-rows // tp) * tp


def shard_of(p: torch.Tensor) -> Shard | None:
    """The :class:`Shard` of a parameter ``parallelize`` made, None for a replicated one."""
    return getattr(p, ATTRIBUTE, None)


def mark(p: nn.Parameter, shard: Shard | None) -> nn.Parameter:
    """``p`` carrying ``shard`` (None: nothing, replicated)."""
    if shard is not None:
        setattr(p, ATTRIBUTE, shard)
    return p


def replicated_mask(params: Iterable[torch.Tensor]) -> list[bool]:
    """Per parameter: True where it is replicated (carries no Shard)."""
    return [shard_of(p) is None for p in params]


def local_slice(full: torch.Tensor, shard: Shard | None, tp: TPGroup) -> torch.Tensor:
    """This rank's slice of the whole ``full`` (no communication; a new tensor), the
    vocabulary padded: the inverse of :func:`full_tensor`."""
    if shard is None:
        return full
    rows = full.shape[shard.dim]
    if shard.padded > rows:
        pad = full.new_zeros((*full.shape[:shard.dim], shard.padded - rows, *full.shape[shard.dim + 1:]))
        full = torch.cat([full, pad], dim=shard.dim)
    parts = full.chunk(shard.parts, dim=shard.dim)
    return torch.cat([tp.slice(part, shard.dim) for part in parts], dim=shard.dim).contiguous()


def full_tensor(local: torch.Tensor, shard: Shard | None, tp: TPGroup) -> torch.Tensor:
    """The whole tensor from every rank's ``local`` slice (a parameter or its gradient), in
    its original layout and without padding: an all-gather over the TP group, which every
    rank calls (a replicated tensor is returned as it is, with no collective)."""
    if shard is None:
        return local
    gathered = tp.all_gather(local, shard.dim)                    # T x (parts x slice)
    if shard.parts > 1:  # rank-major -> part-major: all of q, then k, then v
        blocks = gathered.chunk(tp.size * shard.parts, dim=shard.dim)
        gathered = torch.cat([blocks[r * shard.parts + j] for j in range(shard.parts)
                              for r in range(tp.size)], dim=shard.dim)
    return gathered.narrow(shard.dim, 0, shard.full_shape[shard.dim])


def full_grad(p: nn.Parameter, tp: TPGroup) -> torch.Tensor | None:
    """The whole gradient of ``p`` (see :func:`full_tensor`), None where it has none. Every
    rank calls it for the same parameters: a rank without a gradient would leave the others
    waiting."""
    return None if p.grad is None else full_tensor(p.grad, shard_of(p), tp)


def full_state_dict(module: nn.Module, tp: TPGroup) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every tensor whole and unpadded, as one process holds it
    (for export; an all-gather per sharded tensor, so every rank of the TP group calls it)."""
    # keep_vars: the parameters themselves, which carry their Shard (detach would drop it)
    return {name: full_tensor(t, shard_of(t), tp).detach()
            for name, t in module.state_dict(keep_vars=True).items()}


def squared_norm_share(params: Iterable[nn.Parameter], tp: TPGroup) -> torch.Tensor:
    """This rank's share of the squared L2 norm of the gradients of ``params`` (float64,
    0-dim; no communication): summed over the TP group it is the squared norm of the whole
    model's gradients. Replicated parameters count on t = 0 only (exact, where dividing by T
    would round); parameters without a gradient count zero."""
    sums = [p.grad.detach().double().pow(2).sum() for p in params
            if p.grad is not None and (tp.rank == 0 or shard_of(p) is not None)]
    return torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.float64)
