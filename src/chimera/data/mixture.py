"""Several training sources mixed by weight (``--data-mix a.txt:0.7 b.jsonl:0.3``).

Each source is read as ``--data`` would be (the same flags, its own held-out documents) and
all must give ids of one vocabulary. A mini-batch draws each row's source with probability
its weight, from a generator seeded by ``(seed, split, step)``, then takes that source's rows
as ``get_batch`` does for it alone: so the batch of a step is a function of the step and the
seed, the same on every rank and whatever the layout (``chimera.data.get_batch``). Held-out
batches mix the sources' held-out splits by the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chimera.errors import UserError


def parse_mix(entries) -> tuple[tuple[str, float], ...]:
    """``PATH:WEIGHT`` entries -> ((path, weight), ...), weights positive (any scale)."""
    out = []
    for entry in entries:
        path, sep, weight = str(entry).rpartition(":")
        try:
            value = float(weight) if sep and path else None
        except ValueError:
            value = None
        if value is None or not value > 0 or value == float("inf"):
            raise UserError(f"--data-mix entries are PATH:WEIGHT with a positive weight, got {entry!r}")
        out.append((path, value))
    if len(out) < 2:
        raise UserError(f"--data-mix mixes two or more sources, got {len(out)}: give one as --data")
    return tuple(out)


@dataclass(frozen=True, eq=False)
class Mixture:
    """Corpora (``chimera.data.Corpus``) of one vocabulary and their weights (summing to 1);
    the facts of their ids (``vocab_size``, ``is_bytes``, ``tokenizer``, ``mask_id``) are the
    first's, which the others share (checked when they are described)."""

    parts: tuple
    weights: tuple[float, ...]

    @property
    def first(self):
        return self.parts[0]

    vocab_size = property(lambda self: self.first.vocab_size)
    is_bytes = property(lambda self: self.first.is_bytes)
    tokenizer = property(lambda self: self.first.tokenizer)
    mask_id = property(lambda self: self.first.mask_id)
    where = property(lambda self: " + ".join(f"{p.where} ({w:.0%})" for p, w in
                                             zip(self.parts, self.weights)))

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def rows(self, global_batch: int, seed: int) -> torch.Tensor:
        """Which part each of ``global_batch`` rows comes from (seeded)."""
        gen = torch.Generator().manual_seed(seed)
        return torch.multinomial(torch.tensor(self.weights, dtype=torch.float64), global_batch,
                                 replacement=True, generator=gen)

    def split_length(self, split: str) -> int:
        """The shortest part's ``split``: every part must hold a sequence (a row may come from any)."""
        return min(len(p.train if split == "train" else p.val) for p in self.parts)
