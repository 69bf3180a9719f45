"""Text for training: the pieces of a text source, as bytes or through a tokenizer.

A text source (the stdlib, a text file or folder, a ``.jsonl`` file's text field, a
``datasets`` text column) is a sequence of documents, each followed by a newline, exactly
the bytes ``load_corpus`` reads for files. Documents longer than ``PIECE_CHARS`` are cut
after a newline, so a tokenizer never holds a whole large file (a file is read a block at
a time); ``chimera train --tokenizer`` and ``chimera tokenize`` cut at the same places, so
they make the same ids. The last piece of a document is a ``DocEnd``: a tokenizer with an
end-of-text token (``EOS_TOKENS``) puts that token's id after it, so a training window that
crosses documents sees where one ends.
"""

from __future__ import annotations

import codecs
import itertools
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from chimera.data import (MAX_CORPUS_BYTES, check_total_size, stdlib_documents, text_files,
                          walk_sorted)
from chimera.data.tokens import id_dtype
from chimera.errors import UserError

PIECE_CHARS = 2**16             # documents are cut after a newline into pieces this long at most
BATCH_CHARS = 2**18             # characters a tokenizer encodes in one call (in parallel): its
                                # encodings take about 100 bytes a character while they live
BAR_BYTES = 2**24               # a progress bar over tokenizing from this many bytes on
MASK_TOKENS = ("[MASK]", "<mask>")  # BERT's and RoBERTa's masked-LM token (and their kin's)
EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>")  # GPT-2's, Llama's and RoBERTa's, Gemma's
READ_BYTES = 2**20              # a text file is read this much at a time


class DocEnd(str):
    """The last piece of a document (a ``str`` to everything else)."""

    __slots__ = ()


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
    return _special_id(tokenizer, MASK_TOKENS)


def eos_id_of(tokenizer) -> int | None:
    """The id of the tokenizer's end-of-text token (a special token named as in
    ``EOS_TOKENS``; ``chimera tokenize`` reserves ``<|endoftext|>``), None if none."""
    return _special_id(tokenizer, EOS_TOKENS)


def _special_id(tokenizer, names: tuple[str, ...]) -> int | None:
    special = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    return next((special[name] for name in names if name in special), None)


# ---------------------------------------------------------------------------------------
# Documents and pieces

# A text format's ``pieces`` (its entry in ``chimera.data.formats.FORMATS``): (training
# pieces, held-out pieces or None: the last ids of the one stream are held out).
# ``check_size``: refuse text beyond what is read into memory (``chimera tokenize`` streams
# it, and does not).

def stdlib_pieces(spec, check_size: bool = True) -> tuple[Iterator[str], Iterator[str]]:
    """The stdlib's files, holding out a seeded choice of them
    (``chimera.data.stdlib_documents``); capped at a byte count, so a last character may be
    cut: it is replaced."""
    train, val = stdlib_documents()
    return _docs_pieces(train), _docs_pieces(val)


def file_pieces(spec, check_size: bool = True) -> tuple[Iterator[str], None]:
    """A text file, or the text files of a folder, each a document."""
    return _files_pieces(Path(spec.path), check_size), None


def jsonl_pieces(spec, check_size: bool = True) -> tuple[Iterator[str], None]:
    """Each object's ``spec.field`` of a JSON lines file, a document."""
    return doc_pieces(_jsonl(Path(spec.path), spec.field, check_size)), None


def doc_pieces(docs: Iterable[str]) -> Iterator[str]:
    """The pieces of documents, each followed by a newline (its last piece a ``DocEnd``)."""
    return (piece for doc in docs for piece in _mark_last(cut(doc + "\n")))


def _docs_pieces(docs: list[bytes]) -> Iterator[str]:
    for doc in docs:
        yield from _mark_last(cut(doc.decode("utf-8", errors="replace")))


def _mark_last(pieces: Iterable[str]) -> Iterator[str]:
    """The pieces, the last one a ``DocEnd``."""
    last = None
    for piece in pieces:
        if last is not None:
            yield last
        last = piece
    if last is not None:
        yield DocEnd(last)


def cut(doc: str, limit: int = PIECE_CHARS) -> Iterator[str]:
    """``doc`` in pieces of at most ``limit`` characters, each ending after a newline
    where there is one (a longer line is cut where the limit falls)."""
    start = 0
    while len(doc) - start > limit:
        end = _piece_end(doc, start, limit)
        yield doc[start:end]
        start = end
    if start < len(doc):
        yield doc[start:]


def _piece_end(doc: str, start: int, limit: int) -> int:
    end = doc.rfind("\n", start, start + limit) + 1
    return start + limit if end <= start else end


def _files_pieces(p: Path, check_size: bool) -> Iterator[str]:
    files = text_files(p) if p.is_dir() else [p]
    if check_size:
        check_total_size(str(p), files, None)
    for f in files:
        yield from _file_pieces(f)


def _file_pieces(f: Path, limit: int = PIECE_CHARS) -> Iterator[str]:
    """The pieces of one file and a newline, read ``READ_BYTES`` at a time: the same
    pieces ``cut`` makes of the whole text, without holding it."""
    decoder, text, start, offset = codecs.getincrementaldecoder("utf-8")(), "", 0, 0
    with open(f, "rb") as stream:
        while block := stream.read(READ_BYTES):
            text = text[start:] + _decode_block(decoder, block, f, offset)
            start, offset = 0, offset + len(block)
            while len(text) - start > limit:  # the document goes on past this window: as cut()
                end = _piece_end(text, start, limit)
                yield text[start:end]
                start = end
        text = text[start:] + _decode_block(decoder, b"", f, offset)
    yield from _mark_last(cut(text + "\n", limit))


def _decode_block(decoder, block: bytes, where: Path, offset: int) -> str:
    at = block.find(b"\0")
    if at >= 0:
        raise UserError(f"{str(where)!r} is binary (a NUL byte at offset {offset + at:,}), not "
                         "text: token files are .bin (with --token-dtype) or .npy")
    data = decoder.getstate()[0] + block  # what the decoder sees: a cut character's bytes first
    try:
        return decoder.decode(block, final=not block)
    except UnicodeDecodeError as exc:
        at = offset - (len(data) - len(block)) + exc.start
        raise UserError(f"{where} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                         f"{at:,}): a tokenizer reads text; without "
                         "--tokenizer it is read as bytes") from None


def _jsonl(p: Path, field: str, check_size: bool = True) -> Iterator[str]:
    if check_size and p.stat().st_size > MAX_CORPUS_BYTES:
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

def pieces_as_bytes(pieces: Iterable[str], where: str) -> tuple[torch.Tensor, np.ndarray]:
    """UTF-8 bytes of the pieces, as a uint8 tensor (what bytes-mode training reads), and
    where each document ends in them (after each ``DocEnd``)."""
    data, ends = bytearray(), []
    for piece in pieces:
        data += piece.encode("utf-8")
        if isinstance(piece, DocEnd):
            ends.append(len(data))
        if len(data) > MAX_CORPUS_BYTES:
            raise UserError(f"the text of {where} is more than the limit of "
                             f"{MAX_CORPUS_BYTES:,} bytes (every rank holds it in memory)")
    if not data.strip():
        raise UserError(f"{where} holds no text")
    return torch.frombuffer(data, dtype=torch.uint8), np.array(ends, dtype=np.int64)


def as_plain_text(tokenizer):
    """``tokenizer`` reading special tokens written in the text (a literal ``<|endoftext|>``)
    as the plain text they are: only the end-of-text id this module puts after a document marks
    one, so text that talks about a separator does not make one."""
    tokenizer.encode_special_tokens = True
    return tokenizer


def encode_chunks(tokenizer, pieces: Iterable[str], vocab: int, progress: bool = False,
                  total: int | None = None, ends: list | None = None) -> Iterator[np.ndarray]:
    """The ids of the pieces, a batch of pieces at a time: no special tokens added (one
    written in the text is text: ``as_plain_text``), but the tokenizer's end-of-text token (if
    it has one) after each document. ``ends``: a list that gets where each document ends,
    counted from the first id."""
    eos, bar, done = eos_id_of(tokenizer), None, 0
    as_plain_text(tokenizer)
    if progress and (total is None or total >= BAR_BYTES):
        from tqdm import tqdm  # only when a bar is drawn

        bar = tqdm(total=total, desc="tokenizing", unit="B", unit_scale=True, file=sys.stderr)
    batch, size = [], 0
    for piece in _then_none(pieces):
        if piece is not None:
            batch.append(piece)
            size += len(piece)
        if batch and (piece is None or size >= BATCH_CHARS):
            ids, batch_ends = _encode(tokenizer, batch, vocab, eos)
            if ends is not None:
                ends.extend(done + batch_ends)
            done += len(ids)
            yield ids
            if bar is not None:
                bar.update(sum(len(p.encode("utf-8")) for p in batch))
            batch, size = [], 0
    if bar is not None:
        bar.close()


def _encode(tokenizer, batch: list[str], vocab: int, eos: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The ids of a batch of pieces, and where in them each document ends."""
    # the fast batch skips character offsets: only the ids are kept
    encoded = tokenizer.encode_batch_fast([str(p) for p in batch], add_special_tokens=False)
    ends = [[eos] if eos is not None and isinstance(p, DocEnd) else [] for p in batch]
    sizes = np.cumsum([len(e.ids) + len(end) for e, end in zip(encoded, ends)], dtype=np.int64)
    doc_ends = sizes[[isinstance(p, DocEnd) for p in batch]]
    ids = np.fromiter(itertools.chain.from_iterable(
        itertools.chain(e.ids, end) for e, end in zip(encoded, ends)), dtype=np.int64)
    if ids.size and ids.max() >= vocab:  # before narrowing: an id must not wrap around
        raise UserError(f"the tokenizer made id {int(ids.max())}, outside the vocabulary of "
                         f"{vocab} ids")
    return ids.astype(id_dtype(vocab)), doc_ends


def _then_none(items: Iterable):
    yield from items
    yield None


def encode_all(tokenizer, pieces: Iterable[str], vocab: int, progress: bool = False,
               total: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """All ids of the pieces in one array (in memory: large text goes to chimera tokenize),
    and where each document ends in it."""
    ends: list = []
    chunks = list(encode_chunks(tokenizer, pieces, vocab, progress, total, ends))
    ids = np.concatenate(chunks) if chunks else np.zeros(0, id_dtype(vocab))
    return ids, np.array(ends, dtype=np.int64)
