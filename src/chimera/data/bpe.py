"""``chimera tokenize``: train a byte-level BPE tokenizer on local text, write token files.

The folder it writes is what ``chimera train --data DIR`` reads:

- ``tokenizer.json``: a HF ``tokenizers`` byte-level BPE (GPT-2's pre-tokenizer), so every
  text encodes and the ids decode back to exactly that text, with one special token,
  ``<|endoftext|>`` (id 0), which follows every document in the ids;
- ``train.bin`` and ``val.bin``: the ids (uint16 below 65,536 ids, else uint32), a seeded
  ``VAL_FRACTION`` of the documents in ``val.bin``, whole: the same choice ``chimera train``
  makes of the text itself (``chimera.data.documents``; one document: its last ids; the
  stdlib's held-out files for the default corpus);
- ``meta.json``: format, dtype, vocabulary size, token counts, the tokenizer's file name,
  its mask token's id (``mask_id``: BERT masks with it; null for a trained BPE, which
  has none) and its end-of-text id (``eos_id``).

The text is read in the pieces ``chimera.data.text`` makes, so ``chimera train --data TEXT
--tokenizer DIR/tokenizer.json`` trains on the same ids. The ids stream to disk: only a
batch of pieces is in memory at once (the tokenizer trains from an iterator too, holding
its word counts, not the text). The folder appears complete or not at all.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from chimera.data import text
from chimera.data import BYTE_VOCAB, VAL_FRACTION, split_corpus_bytes
from chimera.data.documents import held_out_mask, runs
from chimera.data.formats import FORMATS, DataSpec, describe, detect, text_pieces
from chimera.data.meta import MAX_VOCAB, META, META_FORMAT
from chimera.data.tokens import id_dtype
from chimera.errors import UserError

FILES = {"train": "train.bin", "val": "val.bin"}
COPY_CHUNK = 2**24              # ids copied at once when val.bin is cut off
EOS = "<|endoftext|>"           # GPT-2's end-of-text token, reserved by every trained BPE


def train_bpe(pieces, vocab_size: int, progress: bool = False):
    """A byte-level BPE ``tokenizers.Tokenizer`` of at most ``vocab_size`` ids (fewer when
    the text runs out of pairs to merge), ``EOS`` the first. Deterministic for the same text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # optional extra (hf): tokenizers

    if not isinstance(vocab_size, int) or not BYTE_VOCAB < vocab_size <= MAX_VOCAB:
        raise UserError(f"--vocab-size must be more than {BYTE_VOCAB} (the byte alphabet and "
                         f"{EOS}) and at most {MAX_VOCAB:,}, got {vocab_size!r}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[EOS])
    tokenizer.train_from_iterator(pieces, trainer)
    return tokenizer


def tokenize(spec: DataSpec, out: str | os.PathLike, vocab_size: int | None,
             progress: bool = False) -> dict:
    """Train a tokenizer on ``spec``'s text (or use ``spec.tokenizer``) and write ``out``
    (which must not exist, or be empty). Returns the ``meta.json`` written."""
    fmt = FORMATS[detect(spec)]
    if fmt.pieces is None:
        raise UserError(f"{spec.path} holds token ids already: chimera tokenize reads text")
    field = spec.text_field or ("text" if fmt.column is not None else None)  # not its input_ids
    info = describe(DataSpec(spec.path, text_field=field))  # the text, read as a source
    spec = DataSpec(spec.path, text_field=field, tokenizer=spec.tokenizer)
    out = Path(out)
    _check_out(out)
    if spec.tokenizer is not None:
        tokenizer = text.load_tokenizer(spec.tokenizer)
    else:
        tokenizer = train_bpe(text_pieces(spec, info.format, check_size=False),
                              vocab_size, progress)
    vocab = tokenizer.get_vocab_size()
    if vocab_size is not None and vocab_size < vocab:
        raise UserError(f"--vocab-size {vocab_size} is smaller than the tokenizer's {vocab} ids")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the folder is an ordinary one
    try:
        meta = _write(tokenizer, spec, info.format, vocab, tmp, progress)
        if out.exists():
            out.rmdir()  # empty (checked): replaced by the complete folder
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty folder: choose a new one")


def _write(tokenizer, spec: DataSpec, fmt: str, vocab: int, tmp: Path, progress: bool) -> dict:
    tokenizer.save(str(tmp / "tokenizer.json"))
    dtype = id_dtype(vocab)
    train, held = FORMATS[fmt].pieces(spec, False)
    total = FORMATS[fmt].size(spec)
    ends: list = []  # where each document ends in train.bin
    with open(tmp / FILES["train"], "wb") as f:  # every id goes to train.bin; some move to val.bin
        n = _stream_ids(tokenizer, train, vocab, f, progress, total, ends)
        cut = n if held is not None else None
        if held is not None:  # the stdlib's held-out files follow, and are val.bin
            n += _stream_ids(tokenizer, held, vocab, f)
    if n < 2:
        raise UserError(f"{spec.path or 'the text'} makes {n} token(s): too little to split")
    if cut is None and len(ends) >= 2:
        split = f"val.bin holds a seeded choice of {VAL_FRACTION:.0%} of the documents"
        cut = _move_documents(tmp / FILES["train"], tmp / FILES["val"], np.array(ends), dtype)
    else:
        split = (f"the last {VAL_FRACTION:.0%} of the ids is val.bin (one document)" if cut is None
                 else "val.bin holds a seeded choice of the files (1 in 20)")
        cut = split_corpus_bytes(n)[0].stop if cut is None else cut
        _move_tail(tmp / FILES["train"], tmp / FILES["val"], cut, dtype)
    meta = {"format": META_FORMAT, "version": 1, "dtype": str(np.dtype(dtype).name),
            "vocab_size": vocab, "tokenizer": "tokenizer.json",
            "mask_id": text.mask_id_of(tokenizer), "eos_id": text.eos_id_of(tokenizer),
            "files": FILES, "tokens": {"train": cut, "val": n - cut}, "source": spec.path or "stdlib",
            "text_field": spec.text_field, "split": split,
            "documents": "each document (file, record, row) is followed by a newline, then the "
                         "end-of-text token where the tokenizer has one"}
    (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def _stream_ids(tokenizer, pieces, vocab: int, f, progress: bool = False,
                total: int | None = None, ends: list | None = None) -> int:
    """Write the ids of ``pieces`` to the open file ``f``, a batch at a time; their count
    (``ends``: gets where each document ends)."""
    n = 0
    for ids in text.encode_chunks(tokenizer, pieces, vocab, progress, total, ends):
        ids.tofile(f)
        n += len(ids)
    return n


def _move_documents(train: Path, val: Path, ends: np.ndarray, dtype: np.dtype) -> int:
    """The held-out documents of ``train`` (``held_out_mask``) go to ``val``, the others
    close up in place (each run is written no later than it is read); the ids left."""
    held = held_out_mask(len(ends), VAL_FRACTION)
    width, kept = np.dtype(dtype).itemsize, 0
    with open(train, "r+b") as src, open(val, "wb") as dst:
        for start, length, out in sorted(
                [(s, n, None) for s, n in zip(*runs(held, ends, False))]
                + [(s, n, dst) for s, n in zip(*runs(held, ends, True))], key=lambda r: r[0]):
            for lo in range(0, length, COPY_CHUNK):
                src.seek((start + lo) * width)
                ids = np.fromfile(src, dtype=dtype, count=min(COPY_CHUNK, length - lo))
                if out is None:
                    src.seek((kept + lo) * width)
                    ids.tofile(src)
                else:
                    ids.tofile(out)
            kept += int(length) if out is None else 0
    os.truncate(train, kept * width)
    return kept


def _move_tail(train: Path, val: Path, cut: int, dtype: np.dtype) -> None:
    """Ids ``cut ..`` of ``train`` go to ``val``; ``train`` is truncated to ``cut``. Plain
    reads, not a memory map, whose pages would count in this process's memory."""
    width = np.dtype(dtype).itemsize
    with open(train, "rb") as src, open(val, "wb") as dst:
        src.seek(cut * width)
        while len(ids := np.fromfile(src, dtype=dtype, count=COPY_CHUNK)):
            ids.tofile(dst)
    os.truncate(train, cut * width)
