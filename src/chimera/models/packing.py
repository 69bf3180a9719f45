"""Documents packed into one sequence, kept apart: each attends only to itself and counts its
positions from 0, as if run alone (the ``segments`` argument the decoders take).

``segments`` (B, T) numbers the documents of each row: a document ends with the end-of-text
id (``document_segments``), which belongs to the document it ends. From it come the positions
(``document_positions``: 0 at each document's first token) and the attention mask
(``document_mask``: causal, and within a document), which any decoder's attention and
position embedding use in place of ``arange(T)`` and ``is_causal``.
"""

from __future__ import annotations

import torch


def document_segments(ids: torch.Tensor, eos: int) -> torch.Tensor:
    """(B, T) int64: the index of each token's document in its row (an ``eos`` closes one)."""
    ends = (ids == eos).long()                                      # (B, T)
    return ends.cumsum(1) - ends                                    # (B, T)


def document_positions(segments: torch.Tensor) -> torch.Tensor:
    """(B, T) int64: each token's position inside its document."""
    T = segments.shape[1]
    t = torch.arange(T, device=segments.device).expand_as(segments)  # (B, T)
    start = torch.ones_like(segments, dtype=torch.bool)
    start[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(start, t, torch.zeros_like(t)).cummax(1).values  # (B, T)
    return t - first


def document_mask(segments: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool: a query sees the keys of its own document up to itself."""
    T = segments.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()   # (T, T)
    same = segments[:, :, None] == segments[:, None, :]                         # (B, T, T)
    return (same & causal)[:, None]
