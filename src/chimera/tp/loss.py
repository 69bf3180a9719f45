"""The LM cross-entropy on logits sharded over the vocabulary (Megatron-LM's vocab-parallel
cross-entropy), so that no rank holds the whole (B, S, V) logits.

A head that keeps its logits sharded (``ShardedHead``) returns :class:`ShardedLogits`: this
rank's columns of the padded vocabulary, (..., V_padded / T). :func:`cross_entropy` takes
either those or a plain tensor, and on sharded logits computes, per row, with three
reductions over the TP group instead of an all-gather of the logits:

1. the row's maximum (an allreduce MAX; it is only a shift, so it carries no gradient);
2. the sum of exp(logit - max) over every column, and 3. the target's shifted logit (on the
   rank whose columns hold it, 0 elsewhere): one allreduce (SUM) of the two, stacked;

loss = log(sum) - target logit. Its backward needs no collective: on each rank the gradient
of its columns is softmax - one_hot (times the row's weight), exactly what the whole logits
would get (the allreduce's backward is the identity: every rank computes the same loss, and
each differentiates it with respect to its own columns). The padding columns (a vocabulary
that T does not divide) are cut off before the maximum: they never win, never count and
get no gradient. Targets equal to ``ignore_index`` add 0 and get no gradient, as in
``F.cross_entropy``. Half-precision logits are computed on in float32 (this rank's columns
only: 1/T of the copy a whole-logits loss makes).

A loss function that takes :class:`ShardedLogits` says so with :func:`takes_sharded_logits`;
``Pipeline`` then lets the heads whose plan entry is ``VocabHead()`` (``logits="auto"``) keep
their logits sharded. Any other loss gets the whole logits, gathered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from chimera.runtime.transport import ReduceOp
from chimera.tp.group import TPGroup, gather_from_tp, reduce_from_tp

SHARDED_LOGITS = "takes_sharded_logits"  # the attribute :func:`takes_sharded_logits` sets


@dataclass(frozen=True, eq=False)
class ShardedLogits:
    """(..., V) logits held as this rank's columns: ``local`` (..., V_padded / T), columns
    ``t * V_padded / T`` on of the vocabulary (``vocab`` = V, the rest padding). Indexing
    takes leading dims only (``logits[:, :-1]``); ``full()`` gathers the whole logits (a
    collective: every rank of the group calls it)."""

    local: torch.Tensor
    tp: TPGroup
    vocab: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.local.shape[:-1], self.vocab))

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def start(self) -> int:
        """The vocabulary index of this rank's first column."""
        return self.tp.rank * self.local.shape[-1]

    @property
    def real(self) -> int:
        """How many of this rank's columns are real tokens (the others are padding)."""
        return max(0, min(self.local.shape[-1], self.vocab - self.start))

    def _with(self, local: torch.Tensor) -> "ShardedLogits":
        return ShardedLogits(local, self.tp, self.vocab)

    def __getitem__(self, index) -> "ShardedLogits":
        parts = index if isinstance(index, tuple) else (index,)
        if len(parts) >= self.local.dim() or any(p is Ellipsis or p is None for p in parts):
            raise IndexError("sharded logits are indexed on their leading dims only, not the "
                             f"vocabulary: got {index!r} for shape {tuple(self.shape)}")
        return self._with(self.local[index])

    def float(self) -> "ShardedLogits":
        return self._with(self.local.float())

    def detach(self) -> "ShardedLogits":
        return self._with(self.local.detach())

    def full(self) -> torch.Tensor:
        """The whole logits (..., V): gathered over the group, the padding stripped."""
        whole = gather_from_tp(self.local, self.tp)
        return whole if whole.shape[-1] == self.vocab else whole[..., :self.vocab]


def takes_sharded_logits(fn: Callable) -> Callable:
    """Mark loss function ``fn`` as one that takes :class:`ShardedLogits` (it computes its
    cross-entropy with :func:`cross_entropy`); returns it."""
    setattr(fn, SHARDED_LOGITS, True)
    return fn


def accepts_sharded_logits(fn: Callable) -> bool:
    """Whether ``fn`` (a function or a bound method) was marked by :func:`takes_sharded_logits`."""
    return bool(getattr(fn, SHARDED_LOGITS, False))


def cross_entropy(logits, targets: torch.Tensor, *, ignore_index: int = -100,
                  reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy`` of (..., V) ``logits`` (a tensor, or :class:`ShardedLogits`) and
    (...) ``targets``: ``"mean"`` over targets != ``ignore_index``, ``"sum"``, or ``"none"``
    (the targets' shape)."""
    if isinstance(logits, torch.Tensor):
        out = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                              ignore_index=ignore_index, reduction=reduction)
        return out.view(targets.shape) if reduction == "none" else out
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    losses, valid = _vocab_parallel(logits, targets.reshape(-1), ignore_index)
    if reduction == "none":
        return losses.view(targets.shape)
    total = losses.sum()
    return total if reduction == "sum" else total / valid.sum()


def _vocab_parallel(logits: ShardedLogits, targets: torch.Tensor,
                    ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row losses, 0 where ignored; the rows that count): the three reductions."""
    tp, real, start = logits.tp, logits.real, logits.start
    x = logits.local.reshape(-1, logits.local.shape[-1])[:, :real]   # (N, real): padding cut
    x = x.float() if x.dtype.itemsize < 4 else x  # as F.cross_entropy accumulates half precision
    rows = x.shape[0]
    peak = x.detach().amax(-1) if real else x.new_full((rows,), float("-inf"))
    tp.all_reduce(peak, op=ReduceOp.MAX)                             # (N,), the row's max
    z = x - peak.unsqueeze(-1)                                       # (N, real), <= 0
    valid = targets != ignore_index
    local = targets - start
    here = valid & (local >= 0) & (local < real)
    if real:
        picked = z.gather(-1, local.clamp(0, real - 1).unsqueeze(-1)).squeeze(-1)
        picked = picked.masked_fill(~here, 0.0)
    else:
        picked = z.new_zeros(rows)
    both = reduce_from_tp(torch.stack([z.exp().sum(-1), picked], -1), tp)  # (N, 2)
    losses = both[:, 0].log() - both[:, 1]
    return losses.masked_fill(~valid, 0.0), valid
