"""The held-out split by documents: a seeded choice of whole documents, never a cut through one.

A source with documents (the files of a folder, the objects of a ``.jsonl``, the rows of a
``datasets`` folder, the spans of a token file that end with its end-of-text id) gives its ids
in one array and where each document ends. ``split_documents`` holds out each document with
probability ``fraction``, drawn from a generator seeded by ``HELD_OUT_SEED`` (fixed, not the
run's ``--seed``: runs with different seeds are evaluated on the same documents), at least one
document on each side. Each split is a ``Spans``: the runs of its documents in the one array,
read as one array (a sampled window may cross from one run into the next, as it crosses from
one document into the next within a run). A source of one document is cut at its last ids, as
before; so is a token file with no end-of-text id.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from chimera.errors import UserError

HELD_OUT_SEED = 0
SCAN_CHUNK = 2**24              # ids read at a time when a token file is searched for its eos id


@dataclass(frozen=True, eq=False)
class Spans:
    """Ranges ``[starts[i], starts[i] + lengths[i])`` of ``base`` (a uint8 tensor, a NumPy
    array or a ``TokenFile``), in order, read as one 1-D array: ``spans[index]`` for an array
    of positions, ``np.asarray(spans)`` for all of it."""

    base: object
    starts: np.ndarray
    lengths: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "offsets", np.concatenate([[0], np.cumsum(self.lengths)]))

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def positions(self, index) -> np.ndarray:
        """The positions in ``base`` of positions ``index`` of the spans."""
        index = np.asarray(index, dtype=np.int64)
        run = np.searchsorted(self.offsets, index, side="right") - 1
        return self.starts[run] + (index - self.offsets[run])

    def __getitem__(self, index) -> np.ndarray:
        if isinstance(index, slice):
            raise TypeError("a held-out split by documents is indexed by positions, not sliced")
        where = self.positions(index)
        if isinstance(self.base, torch.Tensor):
            return self.base[torch.from_numpy(where)].numpy()
        return np.asarray(self.base[where])

    def __array__(self, dtype=None, copy=None):
        parts = [np.asarray(self.base[int(s):int(s + n)]) for s, n in zip(self.starts, self.lengths)]
        whole = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return whole if dtype is None else whole.astype(dtype)


def check_fraction(fraction) -> None:
    """A share of documents to hold out: from 0 (none) to below 1."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
        raise UserError(f"--val-fraction must be a number from 0 (nothing held out) to below 1, "
                         f"got {fraction!r}")


def held_out_mask(count: int, fraction: float, seed: int = HELD_OUT_SEED) -> np.ndarray:
    """Which of ``count`` documents are held out: each with probability ``fraction`` (a
    document's draw depends on its index only, not on how many follow), at least one held out
    and one kept (the lowest and the highest draw) when there are two or more."""
    draws = np.random.Generator(np.random.PCG64(seed)).random(count)
    held = draws < fraction
    if count >= 2 and not held.any():
        held[np.argmin(draws)] = True
    if count >= 2 and held.all():
        held[np.argmax(draws)] = False
    return held


def runs(held: np.ndarray, ends: np.ndarray, keep: bool) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the maximal runs of documents whose ``held`` is ``keep``."""
    starts = np.concatenate([[0], ends[:-1]])
    pick = held == keep
    # a run starts where the membership changes to ``keep``
    first = pick & np.concatenate([[True], ~pick[:-1]])
    last = pick & np.concatenate([~pick[1:], [True]])
    return starts[first].astype(np.int64), (ends[last] - starts[first]).astype(np.int64)


def split_documents(ids, ends, fraction: float,
                    seed: int = HELD_OUT_SEED) -> tuple[Spans, Spans] | None:
    """(training, held-out) ``Spans`` of ``ids`` whose documents end at ``ends`` (increasing,
    the last ``len(ids)``); None for fewer than two documents (the caller cuts the tail)."""
    ends = np.asarray(ends, dtype=np.int64)
    if len(ends) < 2:
        return None
    if ends[-1] != len(ids) or np.any(np.diff(ends) <= 0) or ends[0] <= 0:
        raise ValueError(f"document ends must increase to {len(ids)}, got {ends[:5]}...")
    held = held_out_mask(len(ends), fraction, seed)
    return Spans(ids, *runs(held, ends, False)), Spans(ids, *runs(held, ends, True))


def eos_ends(ids, eos: int) -> np.ndarray:
    """Where the documents of a token array end: after each ``eos`` id (and at the end). A
    ``TokenFile`` is read in chunks, not held whole."""
    if hasattr(ids, "chunks"):
        chunks = ids.chunks(SCAN_CHUNK)
    else:
        chunks = ((lo, np.asarray(ids[lo:lo + SCAN_CHUNK])) for lo in range(0, len(ids), SCAN_CHUNK))
    found = [lo + np.flatnonzero(chunk == eos) + 1 for lo, chunk in chunks]
    ends = np.concatenate(found) if found else np.zeros(0, np.int64)
    if not len(ends) or ends[-1] != len(ids):
        ends = np.append(ends, len(ids))
    return ends.astype(np.int64)
