"""Stage partitioning as data: a stage is a contiguous ``range`` of the flat layer list.

``partition`` balances by cost (exact: minimizes the most expensive stage);
``parse_partition`` and ``partition_from_sizes`` let the user override it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from chimera.models.gpt2 import ModelConfig, flops_per_token


def layer_costs(cfg: ModelConfig) -> list[float]:
    """Relative forward cost of each layer: a block is 1.0, embedding and head by FLOPs."""
    flops = flops_per_token(cfg)
    block = flops[1]
    return [f / block for f in flops]


def _check_costs(costs: Sequence[float], parts: int) -> None:
    if not isinstance(parts, int) or parts < 1:
        raise ValueError(f"number of stages must be a positive integer, got {parts!r}")
    if any(not math.isfinite(c) or c < 0 for c in costs):
        raise ValueError(f"layer costs must be finite and non-negative, got {list(costs)}")
    if parts > len(costs):
        raise ValueError(f"cannot split {len(costs)} layers into {parts} stages: "
                         f"every stage needs at least one layer")


def _min_max_table(prefix: list[float], parts: int) -> list[list[int]]:
    """DP over (stages p, first i layers); returns, per cell, where the last stage starts."""
    n = len(prefix) - 1
    best = [prefix[i] for i in range(n + 1)]                   # one stage
    starts = [[0] * (n + 1)]
    for p in range(2, parts + 1):
        new_best, new_starts = [math.inf] * (n + 1), [0] * (n + 1)
        for i in range(p, n + 1):
            for j in range(p - 1, i):                          # last stage is [j, i)
                cost = max(best[j], prefix[i] - prefix[j])
                if cost < new_best[i]:                         # strict: first j wins ties
                    new_best[i], new_starts[i] = cost, j
        best = new_best
        starts.append(new_starts)
    return starts


def partition(costs: Sequence[float], parts: int) -> list[range]:
    """Cut ``costs`` into ``parts`` contiguous non-empty ranges minimizing the largest sum.

    Exact dynamic program, O(parts * n^2); deterministic (ties go to the earliest cut of
    the last stage, i.e. later stages take the extra layer).
    """
    _check_costs(costs, parts)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    starts = _min_max_table(prefix, parts)
    ranges, end = [], len(costs)
    for p in range(parts, 0, -1):
        start = starts[p - 1][end]
        ranges.append(range(start, end))
        end = start
    return ranges[::-1]


def partition_from_sizes(sizes: Sequence[int], n_layers: int | None = None) -> list[range]:
    """Consecutive ranges of the given sizes: ``[3, 4, 3] -> [0-2, 3-6, 7-9]``."""
    if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"stage sizes must be positive integers, got {list(sizes)}")
    if n_layers is not None and sum(sizes) != n_layers:
        raise ValueError(f"stage sizes {list(sizes)} sum to {sum(sizes)}, "
                         f"but the model has {n_layers} layers")
    ranges, start = [], 0
    for s in sizes:
        ranges.append(range(start, start + s))
        start += s
    return ranges


def _parse_piece(piece: str) -> range:
    first, _, last = piece.strip().partition("-")
    try:
        lo = int(first)
        hi = int(last) if last else lo
    except ValueError:
        lo = hi = -1
    if lo < 0 or hi < lo:
        raise ValueError(f"bad stage {piece!r}: expected 'first-last' (inclusive) or 'index'")
    return range(lo, hi + 1)


def parse_partition(spec: str, n_layers: int | None = None) -> list[range]:
    """Parse ``"0-3,4-7"`` (inclusive layer ranges, contiguous from 0) into ranges."""
    ranges = [_parse_piece(piece) for piece in spec.split(",")]
    expected = 0
    for rng in ranges:
        if rng.start != expected:
            raise ValueError(f"partition {spec!r}: stage {rng.start}-{rng.stop - 1} should "
                             f"start at layer {expected} (stages must be contiguous from 0)")
        expected = rng.stop
    if n_layers is not None and expected != n_layers:
        raise ValueError(f"partition {spec!r} covers {expected} layers, "
                         f"but the model has {n_layers}")
    return ranges


def build_stage(layers: Sequence[nn.Module], rng: range) -> nn.Sequential:
    """The stage holding ``layers[rng]`` (the same module objects, not copies)."""
    if rng.step != 1 or len(rng) == 0 or rng.start < 0 or rng.stop > len(layers):
        raise ValueError(f"stage {rng} is not a non-empty contiguous range "
                         f"within the {len(layers)} layers")
    return nn.Sequential(*(layers[i] for i in rng))
