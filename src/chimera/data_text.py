"""Text for training: the pieces of a text source, as bytes or through a tokenizer.

A text source (the stdlib, a text file or folder, a ``.jsonl`` file's text field, a
``datasets`` text column) is a sequence of documents, each followed by a newline, exactly
the bytes ``load_corpus`` reads for files. Documents longer than ``PIECE_CHARS`` are cut
after a newline, so a tokenizer never holds a whole large file; ``chimera train
--tokenizer`` and ``chimera tokenize`` cut at the same places, so they make the same ids.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from chimera.data import (MAX_CORPUS_BYTES, check_not_binary, check_total_size, text_files,
                          walk_sorted, load_corpus)
from chimera.data_tokens import id_dtype
from chimera.errors import UserError

PIECE_CHARS = 2**20             # documents are cut after a newline into pieces this long at most
BATCH_CHARS = 2**23             # characters a tokenizer encodes in one call (in parallel)
BAR_BYTES = 2**24               # a progress bar over tokenizing from this many bytes on
MASK_TOKENS = ("[MASK]", "<mask>")  # BERT's and RoBERTa's masked-LM token (and their kin's)


def folder_files(p: Path) -> list[Path]:
    """Non-hidden files under a folder, sorted (what a text folder is made of)."""
    files = walk_sorted(p, lambda d: not d.startswith("."))
    return [f for f in files if not f.name.startswith(".") and f.is_file()]


def load_tokenizer(path: str):
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json``; one-line ``ValueError``s."""
    try:
        from tokenizers import Tokenizer  # optional extra (hf): tokenizers
    except ImportError:
        raise UserError("--tokenizer needs the tokenizers package "
                         "(pip install 'chimera-pipeline[hf]')") from None
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--tokenizer {path}: no such file")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise UserError(f"--tokenizer {path}: not a tokenizers JSON file "
                         f"({str(exc).splitlines()[0][:120]})") from None


def mask_id_of(tokenizer) -> int | None:
    """The id of the tokenizer's mask token: a special token named as in ``MASK_TOKENS``
    (a plain vocabulary entry spelled ``<mask>`` is text, not a mask); None if none."""
    special = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    return next((special[name] for name in MASK_TOKENS if name in special), None)


# ---------------------------------------------------------------------------------------
# Documents and pieces

def text_pieces(spec, fmt: str) -> Iterator[str]:
    """The pieces of a text source, in order (each document ends with a newline)."""
    for doc in _documents(spec, fmt):
        yield from cut(doc)


def cut(doc: str, limit: int = PIECE_CHARS) -> Iterator[str]:
    """``doc`` in pieces of at most ``limit`` characters, each ending after a newline
    where there is one (a longer line is cut where the limit falls)."""
    start = 0
    while len(doc) - start > limit:
        end = doc.rfind("\n", start, start + limit) + 1
        if end <= start:
            end = start + limit
        yield doc[start:end]
        start = end
    if start < len(doc):
        yield doc[start:]


def _documents(spec, fmt: str) -> Iterator[str]:
    if fmt == "stdlib":  # capped at a byte count, so its last character may be cut: replaced
        yield bytes(load_corpus(None).numpy()).decode("utf-8", errors="replace")
    elif fmt == "text":
        p = Path(spec.path)
        files = text_files(p) if p.is_dir() else [p]
        check_total_size(str(p), files, None)
        for f in files:
            data = f.read_bytes()
            check_not_binary(f, data)
            yield _decode(data, f) + "\n"
    elif fmt == "jsonl":
        for text in _jsonl(Path(spec.path), spec.field):
            yield text + "\n"
    else:  # a datasets folder's text column
        from chimera.data_datasets import text_rows

        for text in text_rows(spec, spec.field):
            yield text + "\n"


def _decode(data: bytes, where: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{where} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                         f"{exc.start:,}): a tokenizer reads text; without --tokenizer it is "
                         "read as bytes") from None


def _jsonl(p: Path, field: str) -> Iterator[str]:
    if p.stat().st_size > MAX_CORPUS_BYTES:
        raise UserError(f"{p} has {p.stat().st_size:,} bytes, more than the limit of "
                         f"{MAX_CORPUS_BYTES:,} (it is read into memory): write .bin token "
                         "files with chimera tokenize")
    with open(p, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise UserError(f"{p} line {n} is not JSON ({str(exc).splitlines()[0]})") from None
            if not isinstance(record, dict):
                raise UserError(f"{p} line {n} is a JSON {type(record).__name__}, not an object "
                                 f"with a {field!r} field")
            if field not in record:
                raise UserError(f"{p} line {n} has no {field!r} field (it has "
                                 f"{', '.join(map(repr, record)) or 'none'}): choose one with --text-field")
            if not isinstance(record[field], str):
                raise UserError(f"{p} line {n}: {field!r} is a {type(record[field]).__name__}, not text")
            yield record[field]


# ---------------------------------------------------------------------------------------
# Bytes or ids

def pieces_as_bytes(pieces: Iterable[str], where: str) -> torch.Tensor:
    """UTF-8 bytes of the pieces, as a uint8 tensor (what bytes-mode training reads)."""
    data = bytearray()
    for piece in pieces:
        data += piece.encode("utf-8")
        if len(data) > MAX_CORPUS_BYTES:
            raise UserError(f"the text of {where} is more than the limit of "
                             f"{MAX_CORPUS_BYTES:,} bytes (every rank holds it in memory)")
    if not data.strip():
        raise UserError(f"{where} holds no text")
    return torch.frombuffer(data, dtype=torch.uint8)


def encode_chunks(tokenizer, pieces: Iterable[str], vocab: int, progress: bool = False,
                  total: int | None = None) -> Iterator[np.ndarray]:
    """The ids of the pieces, a batch of pieces at a time (no special tokens added)."""
    bar = None
    if progress and (total is None or total >= BAR_BYTES):
        from tqdm import tqdm  # only when a bar is drawn

        bar = tqdm(total=total, desc="tokenizing", unit="B", unit_scale=True, file=sys.stderr)
    batch, size = [], 0
    for piece in _then_none(pieces):
        if piece is not None:
            batch.append(piece)
            size += len(piece)
        if batch and (piece is None or size >= BATCH_CHARS):
            yield _encode(tokenizer, batch, vocab)
            if bar is not None:
                bar.update(sum(len(p.encode("utf-8")) for p in batch))
            batch, size = [], 0
    if bar is not None:
        bar.close()


def _encode(tokenizer, batch: list[str], vocab: int) -> np.ndarray:
    encoded = tokenizer.encode_batch(batch, add_special_tokens=False)
    ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encoded), dtype=np.int64)
    if ids.size and ids.max() >= vocab:  # before narrowing: an id must not wrap around
        raise UserError(f"the tokenizer made id {int(ids.max())}, outside the vocabulary of "
                         f"{vocab} ids")
    return ids.astype(id_dtype(vocab))


def _then_none(items: Iterable):
    yield from items
    yield None


def encode_all(tokenizer, pieces: Iterable[str], vocab: int, progress: bool = False,
               total: int | None = None) -> np.ndarray:
    """All ids of the pieces in one array (in memory: large text goes to chimera tokenize)."""
    chunks = list(encode_chunks(tokenizer, pieces, vocab, progress, total))
    return np.concatenate(chunks) if chunks else np.zeros(0, id_dtype(vocab))
