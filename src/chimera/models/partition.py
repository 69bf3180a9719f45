"""Stage partitioning as data: a stage is a contiguous ``range`` of the flat layer list.

``partition`` balances by cost (exact: minimizes the most expensive stage);
``parse_partition`` and ``partition_from_sizes`` let the user override it.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from chimera.errors import UserError
from chimera.modelcfg import layer_costs, partition  # noqa: F401  (torch-free, re-exported)


def partition_from_sizes(sizes: Sequence[int], n_layers: int | None = None) -> list[range]:
    """Consecutive ranges of the given sizes: ``[3, 4, 3] -> [0-2, 3-6, 7-9]``."""
    if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
        raise UserError(f"stage sizes must be positive integers, got {list(sizes)}")
    if n_layers is not None and sum(sizes) != n_layers:
        raise UserError(f"stage sizes {list(sizes)} sum to {sum(sizes)}, "
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
        raise UserError(f"bad stage {piece!r}: expected 'first-last' (inclusive) or 'index'")
    return range(lo, hi + 1)


def parse_partition(spec: str, n_layers: int | None = None) -> list[range]:
    """Parse ``"0-3,4-7"`` (inclusive layer ranges, contiguous from 0) into ranges."""
    ranges = [_parse_piece(piece) for piece in spec.split(",")]
    expected = 0
    for rng in ranges:
        if rng.start != expected:
            raise UserError(f"partition {spec!r}: stage {rng.start}-{rng.stop - 1} should "
                             f"start at layer {expected} (stages must be contiguous from 0)")
        expected = rng.stop
    if n_layers is not None and expected != n_layers:
        raise UserError(f"partition {spec!r} covers {expected} layers, "
                         f"but the model has {n_layers}")
    return ranges


def build_stage(layers: Sequence[nn.Module], rng: range) -> nn.Sequential:
    """The stage holding ``layers[rng]`` (the same module objects, not copies)."""
    if rng.step != 1 or len(rng) == 0 or rng.start < 0 or rng.stop > len(layers):
        raise UserError(f"stage {rng} is not a non-empty contiguous range "
                         f"within the {len(layers)} layers")
    return nn.Sequential(*(layers[i] for i in rng))
