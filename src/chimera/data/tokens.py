"""Token ids in files: ``.bin`` (raw ids of a stated dtype) and ``.npy`` (a 1-D integer
array), read per batch through a fresh memory map and checked by plain reads."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from chimera.data import check_corpus_path
from chimera.errors import UserError

TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SCAN_CHUNK = 2**24              # ids checked per read of a file
BAR_TOKENS = 2**27              # a progress bar over the id check from this many ids on


def id_dtype(vocab: int) -> np.dtype:
    """The narrowest unsigned dtype that holds ids below ``vocab``."""
    return np.dtype("<u2") if vocab <= 2**16 else np.dtype("<u4")


@dataclass(frozen=True)
class TokenFile:
    """Ids ``offset ..`` of a file, a 1-D array the sampler indexes: each read maps the file
    afresh (as nanoGPT does), so a long run does not keep every page it has touched mapped
    (and counted in its RSS). A slice is another ``TokenFile``, nothing is read."""

    path: str
    dtype: np.dtype
    offset: int      # bytes
    length: int      # ids

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(self.length)
            if step != 1:
                raise ValueError("a TokenFile slices with step 1 only")
            return TokenFile(self.path, self.dtype, self.offset + start * self.dtype.itemsize,
                             max(0, stop - start))
        ids = np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset,
                        shape=(self.length,))
        return np.array(ids[key])  # a copy: the map is dropped here

    def chunks(self, size: int = SCAN_CHUNK):
        """The ids in order, ``size`` at a time, by plain reads (no map)."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            for lo in range(0, self.length, size):
                yield lo, np.fromfile(f, dtype=self.dtype, count=min(size, self.length - lo))


def bin_file(p: Path, dtype: str, vocab: int | None, progress: bool) -> TokenFile:
    check_corpus_path(p)
    size, width = p.stat().st_size, TOKEN_DTYPES[dtype].itemsize
    if size == 0:
        raise UserError(f"{p} is empty")
    if size % width:
        raise UserError(f"{p} has {size:,} bytes, not a multiple of {width} ({dtype} ids): not "
                         "a token file of that dtype")
    ids = TokenFile(str(p), TOKEN_DTYPES[dtype], 0, size // width)
    if vocab is not None:
        check_ids(ids, vocab, str(p), progress)
    return ids


def npy_file(p: Path, vocab: int | None, progress: bool) -> TokenFile:
    try:
        array = np.load(p, mmap_mode="r", allow_pickle=False)  # reads the header only
    except ValueError as exc:  # object arrays need a pickle; a damaged header
        objects = "allow_pickle" in str(exc) or "Python objects" in str(exc)
        kind = "Python objects (a pickle)" if objects else str(exc).splitlines()[0]
        raise UserError(f"{p} holds {kind}, not token ids") from None
    except (OSError, EOFError) as exc:
        raise UserError(f"{p} is not a readable .npy file ({exc})") from None
    if not np.issubdtype(array.dtype, np.integer):
        raise UserError(f"{p} holds {array.dtype} values: token ids must be integers")
    if array.ndim != 1:
        raise UserError(f"{p} is {array.ndim}-D {tuple(array.shape)}: give a 1-D array of token ids")
    if array.size == 0:
        raise UserError(f"{p} is empty")
    ids = TokenFile(str(p), array.dtype, array.offset, len(array))
    if vocab is not None:
        check_ids(ids, vocab, str(p), progress)
    return ids


def check_ids(ids, vocab: int, where: str, progress: bool = False) -> None:
    """Every id in ``0 .. vocab - 1``; a ``TokenFile`` is read in chunks, not held whole."""
    chunks = ids.chunks() if isinstance(ids, TokenFile) else (
        (lo, ids[lo:lo + SCAN_CHUNK]) for lo in range(0, len(ids), SCAN_CHUNK))
    bar = _bar(len(ids), "checking token ids", progress and len(ids) >= BAR_TOKENS)
    for lo, chunk in chunks:
        bad = chunk >= vocab
        if np.issubdtype(chunk.dtype, np.signedinteger):
            bad |= chunk < 0
        if bad.any():
            at = int(np.argmax(bad))
            raise UserError(f"{where} holds token id {int(chunk[at])} (at position {lo + at:,}), "
                             f"outside the vocabulary of {vocab} ids")
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()


def _bar(total: int, desc: str, show: bool):
    if not show:
        return None
    from tqdm import tqdm  # only when a bar is drawn

    return tqdm(total=total, desc=desc, unit="tok", unit_scale=True, file=sys.stderr)
