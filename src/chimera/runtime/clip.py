"""Gradient clipping by the global 2-norm: the one rule every runner uses.

Callers differ only in the share of the squared norm a rank contributes (a pipeline rank
counts each stage once and each tied weight once; a single process counts everything) and in
how the shares are summed; the clipping itself is :func:`clip_by_global_norm_`: when the norm
exceeds ``max_norm``, scale by ``max_norm / (norm + eps)`` (as ``torch.nn.utils.clip_grad_norm_``
does); never when the norm is not finite.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

EPS = 1e-6


def sum_of_squares(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum(g.pow(2).sum())`` over ``grads`` as a float64 scalar (each norm in the gradient's
    own precision, the squares added in float64); 0 for no gradients."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack(torch._foreach_norm(list(grads))).double().pow(2).sum()


def clip_by_global_norm_(grads: Sequence[torch.Tensor], sq_share: torch.Tensor,
                         max_norm: float | None, eps: float = EPS,
                         all_reduce: Callable[[torch.Tensor], object] | None = None) -> torch.Tensor:
    """Scale ``grads`` in place so that the global norm is at most ``max_norm``; return the
    global norm (a float64 scalar tensor).

    ``sq_share`` is this rank's share of the squared norm; ``all_reduce`` sums the shares of
    all ranks in place (``None``: this process holds the whole model). ``max_norm=None``
    measures the norm and clips nothing. Call on every rank: the sum is a collective.
    """
    if all_reduce is not None:
        all_reduce(sq_share)
    norm = sq_share.sqrt()
    value = float(norm)
    if max_norm is None or not grads or not math.isfinite(value) or value <= max_norm:
        return norm
    coef = torch.tensor(max_norm / (value + eps), dtype=grads[0].dtype, device=grads[0].device)
    torch._foreach_mul_(list(grads), coef)
    return norm
