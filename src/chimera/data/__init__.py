"""Training data as token ids, with a sampler that ignores the parallel layout.

The default corpus is the Python standard library's own ``.py`` source, read as bytes: it
is on every machine that runs this code, so the default job needs no download. It is read
in sorted path order and capped, so it is the same on every run with the same Python
install; a seeded choice of its files is held out (``stdlib_documents``), and generated
codec tables are left out. Token files, JSON lines and ``datasets`` folders are read by
``chimera.data.formats`` into a ``Corpus``: a training and a held-out split of token ids
and the vocabulary they come from.

``get_batch(corpus, step, ...)`` depends only on ``(step, seed, global_batch, seq_len)``:
the mini-batch of step ``s`` is the same set of sequences whatever W, D or N are. A
pipeline takes its micro-batches as row slices of it.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from chimera.data.documents import split_documents
from chimera.data.mixture import Mixture
from chimera.errors import UserError

DEFAULT_MAX_BYTES = 4 * 2**20
VAL_FRACTION = 0.05              # held out: 5% of the documents (chimera.data.documents)
# the stdlib's held-out files: one in HELD_OUT_ONE_IN, chosen by a seeded hash of the path
# (its tail is codec tables, text of another kind than the rest)
HELD_OUT_ONE_IN, HELD_OUT_SEED = 20, 0
# every rank holds the whole corpus in memory (one byte a token), read before training
MAX_CORPUS_BYTES = 2 * 2**30
KINDS = ("gpt2", "bert")
SPLITS = ("train", "val")
BYTE_VOCAB = 256
IGNORE_INDEX = -100
# BERT masking (Devlin et al.): 15% of positions; of those 80% [MASK], 10% random, 10% kept.
MASK_PROB, MASK_REPLACE, MASK_RANDOM = 0.15, 0.8, 0.1
_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")
_SNIFF_BYTES = 8192


def derive_seed(*parts) -> int:
    """A 63-bit seed from a tuple of ints/strings, stable across runs and platforms."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# ---------------------------------------------------------------------------------------
# Corpus

def walk_sorted(root: Path, keep_dir) -> list[Path]:
    """Files under ``root`` (directories pruned by ``keep_dir``), sorted by relative path."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if keep_dir(d)]
        found.extend(Path(dirpath, name) for name in filenames)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def stdlib_sources() -> list[Path]:
    """The standard library's ``.py`` files (no site-packages) in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = walk_sorted(root, lambda d: d not in _SKIP_DIRS)
    return [p for p in files if p.suffix == ".py" and p.is_file()]


def _looks_like_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" not in f.read(_SNIFF_BYTES)


def text_files(directory: Path) -> list[Path]:
    """Non-hidden files under ``directory`` that look like text, sorted."""
    files = walk_sorted(directory, lambda d: not d.startswith("."))
    return [p for p in files
            if not p.name.startswith(".") and p.is_file() and _looks_like_text(p)]


def check_not_binary(path: Path, data: bytes) -> None:
    """A single file given as text must be text: a NUL byte anywhere means it is not."""
    at = data.find(b"\0")
    if at >= 0:
        raise UserError(f"{str(path)!r} is binary (a NUL byte at offset {at:,}), not text: "
                         "token files are .bin (with --token-dtype) or .npy")


def file_ends(path: str | os.PathLike, length: int) -> np.ndarray | None:
    """Where each file's document ends in the ``length`` bytes ``load_corpus`` read from
    ``path`` (a file and a newline each); None if they are not those bytes."""
    p = Path(path)
    files = text_files(p) if p.is_dir() else [p]
    ends = np.cumsum([f.stat().st_size + 1 for f in files], dtype=np.int64)
    return ends if len(ends) and ends[-1] == length else None


def _read_files(files: list[Path], max_bytes: int | None) -> bytes:
    """Concatenate files (newline-separated), stopping once ``max_bytes`` is reached."""
    chunks, total = [], 0
    for p in files:
        if max_bytes is not None and total >= max_bytes:
            break
        data = p.read_bytes() + b"\n"
        chunks.append(data)
        total += len(data)
    joined = b"".join(chunks)
    return joined if max_bytes is None else joined[:max_bytes]


def held_out(relative: str) -> bool:
    """Whether the stdlib file at ``relative`` (a POSIX path) is in the held-out split: a
    seeded choice of documents, so the held-out text is of the same kind as the rest."""
    return derive_seed(HELD_OUT_SEED, "held-out", relative) % HELD_OUT_ONE_IN == 0


def stdlib_documents(max_bytes: int | None = None) -> tuple[list[bytes], list[bytes]]:
    """The stdlib's files (each followed by a newline; no generated codec tables) in two
    splits, training and held out, capped at ``max_bytes`` together: the held-out files fill the last
    ``VAL_FRACTION`` (the cut ``split_corpus_bytes`` makes), the others the rest."""
    root = Path(sysconfig.get_paths()["stdlib"])
    max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    val_cap = max(1, int(max_bytes * VAL_FRACTION))
    files = [p for p in stdlib_sources() if not _generated(p)]
    val = [p for p in files if held_out(p.relative_to(root).as_posix())]
    train = [p for p in files if p not in set(val)]
    return _capped(train, max_bytes - val_cap), _capped(val, val_cap)


def _generated(path: Path) -> bool:
    """A codec table ``gencodec.py`` wrote (``encodings/cp437.py``...): 256-line tables of hex
    and character names, a tenth of the first 4 MiB, which a small model learns to repeat
    whatever the prompt."""
    with open(path, "rb") as f:
        return b"gencodec.py" in f.read(_SNIFF_BYTES)


def _capped(files: list[Path], cap: int) -> list[bytes]:
    """Each file's bytes and a newline, in order, the last cut so that they total ``cap``."""
    docs, total = [], 0
    for p in files:
        if total >= cap:
            break
        data = (p.read_bytes() + b"\n")[:cap - total]
        docs.append(data)
        total += len(data)
    return docs


def load_corpus(path: str | os.PathLike | None = None, *, max_bytes: int | None = None,
                seq_len: int | None = None) -> torch.Tensor:
    """Bytes of a file, of all text files in a directory, or (default) of the stdlib.

    Returns a 1-D uint8 tensor. The stdlib corpus is capped at ``DEFAULT_MAX_BYTES``
    unless ``max_bytes`` says otherwise, its held-out files last (``stdlib_documents``); a
    given path is read whole unless capped.
    Raises ``ValueError`` for a missing path, empty data, or (when ``seq_len`` is given)
    data too short for one training sequence.
    """
    if path is None:
        where = "the Python standard library"
        data = b"".join(b"".join(split) for split in stdlib_documents(max_bytes))
    else:
        where, p = str(path), Path(path)
        check_corpus_path(p)
        files = text_files(p) if p.is_dir() else [p]
        check_total_size(where, files, max_bytes)
        data = _read_files(files, max_bytes)
    if path is not None and not p.is_dir():
        check_not_binary(p, data)
    if not data.strip():
        raise UserError(f"corpus from {where!r} is empty (no text files or no bytes)")
    train = len(split_corpus_bytes(len(data))[0])
    if seq_len is not None and train < seq_len + 1:
        raise UserError(f"corpus from {where!r} has {len(data)} bytes: fewer than one sequence "
                         f"of {seq_len} + 1 in its training split ({train} bytes; the last "
                         f"{VAL_FRACTION:.0%} is held out)")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def special_kind(p: Path) -> str | None:
    """What ``p`` is when it is neither a regular file nor a directory ("a FIFO", ...): such a
    corpus would block forever (a FIFO) or never end (a device)."""
    mode = p.stat().st_mode
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
            else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a special file")


def check_corpus_path(p: Path) -> None:
    if not p.exists():
        raise UserError(f"corpus path {str(p)!r} does not exist")
    kind = special_kind(p)
    if kind:
        raise UserError(f"corpus path {str(p)!r} is {kind}: give a regular text file or a "
                         "directory of them")


def check_total_size(where: str, files: list[Path], max_bytes: int | None) -> None:
    total = sum(f.stat().st_size for f in files)
    if max_bytes is None and total > MAX_CORPUS_BYTES:
        raise UserError(f"corpus from {where!r} has {total:,} bytes, more than the limit of "
                         f"{MAX_CORPUS_BYTES:,} (every rank holds it in memory)")


def split_corpus_bytes(n: int, fraction: float = VAL_FRACTION) -> tuple[range, range]:
    """Positions of the training and the held-out split of an ``n``-byte corpus cut at its
    last ``fraction`` (0: nothing held out)."""
    cut = n if fraction == 0 else n - max(1, int(n * fraction))
    return range(0, cut), range(cut, n)


@dataclass(frozen=True, eq=False)
class Corpus:
    """Token ids in two splits, and the vocabulary they come from.

    ``train`` and ``val`` are 1-D arrays: a uint8 tensor for bytes, a NumPy array or a
    ``chimera.data.formats.TokenFile`` (ids in a file, memory-mapped per read) for token ids; every
    id is below ``vocab_size``. ``tokenizer`` is the ``tokenizer.json`` that made (or
    decodes) the ids, if any; ``mask_id`` its mask token (``[MASK]``, ``<mask>``), which
    BERT masks with, if it has one.
    """

    train: torch.Tensor | np.ndarray  # or a TokenFile
    val: torch.Tensor | np.ndarray
    vocab_size: int
    where: str
    is_bytes: bool = False
    tokenizer: str | None = None
    mask_id: int | None = None

    @classmethod
    def of_bytes(cls, data: torch.Tensor, where: str, **split) -> "Corpus":
        """Byte tokens, held out as ``from_tokens`` does."""
        return cls.from_tokens(data, BYTE_VOCAB, where, is_bytes=True, **split)

    @classmethod
    def from_tokens(cls, tokens, vocab_size: int, where: str, *, ends=None,
                    fraction: float = VAL_FRACTION, **kw) -> "Corpus":
        """One array of ids: where ``ends`` marks two or more documents, a seeded ``fraction``
        of them held out whole (``chimera.data.documents``), else its last ``fraction`` of ids;
        ``fraction`` 0 holds out nothing (the held-out data comes from elsewhere)."""
        split = None if ends is None or fraction == 0 else split_documents(tokens, ends, fraction)
        if split is not None:
            return cls(*split, vocab_size, where, **kw)
        train, val = split_corpus_bytes(len(tokens), fraction)
        return cls(tokens[:train.stop], tokens[val.start:], vocab_size, where, **kw)

    def __len__(self) -> int:
        return len(self.train) + len(self.val)


def model_vocab(corpus, kind: str) -> int:
    """The model vocabulary a corpus (or ``chimera.data.formats.DataInfo``; a bare tensor is bytes)
    needs: its own, plus for BERT a mask id after token ids whose tokenizer has no mask
    token of its own (byte data keeps 0xFF, which UTF-8 never holds, as the mask)."""
    if getattr(corpus, "is_bytes", True):
        return BYTE_VOCAB
    return corpus.vocab_size + (kind == "bert" and getattr(corpus, "mask_id", None) is None)


def bert_mask_id(corpus, vocab_size: int) -> int:
    """The id BERT masks with: the tokenizer's mask token where the data has one, else the
    last id of the model's ``vocab_size`` (byte 0xFF, or the id ``model_vocab`` appends)."""
    own = getattr(corpus, "mask_id", None)
    return vocab_size - 1 if own is None else own


def split_corpus(corpus: "Corpus | torch.Tensor", split: str) -> torch.Tensor | np.ndarray:
    """A ``Corpus``'s split, or of a bare array the first 95% (``"train"``) or the last 5%
    (``"val"``)."""
    if split not in SPLITS:
        raise UserError(f"split must be one of {SPLITS}, got {split!r}")
    if isinstance(corpus, Corpus):
        return corpus.train if split == "train" else corpus.val
    if isinstance(corpus, Mixture):  # a row may come from any part: the shortest part's split
        return min((split_corpus(part, split) for part in corpus.parts), key=len)
    train, val = split_corpus_bytes(len(corpus))
    return corpus[:train.stop] if split == "train" else corpus[val.start:]


# ---------------------------------------------------------------------------------------
# Batches

def _check_batch_args(step: int, global_batch: int, seq_len: int, kind: str,
                      vocab_size: int, corpus=None) -> None:
    if kind not in KINDS:
        raise UserError(f"kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(step, int) or step < 0:
        raise UserError(f"step must be a non-negative integer, got {step!r}")
    for name, value in (("global_batch", global_batch), ("seq_len", seq_len)):
        if not isinstance(value, int) or value < 1:
            raise UserError(f"{name} must be a positive integer, got {value!r}")
    need = model_vocab(corpus, kind)
    if vocab_size < need:
        what = "byte data" if need == BYTE_VOCAB else f"{corpus.where} ({corpus.vocab_size} ids)"
        raise UserError(f"{what} needs vocab_size >= {need}, got {vocab_size}")


def mask_tokens(tokens: torch.Tensor, gen: torch.Generator, vocab_size: int = BYTE_VOCAB,
                mask_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masked-LM corruption of ``tokens`` (B, T) -> (inputs, targets).

    The mask token is ``mask_id``, a tokenizer's own; by default ``vocab_size - 1``, an id
    no data token has (byte 0xFF never occurs in UTF-8 text), which random replacements
    then never draw either. Each row gets at least one target, so every micro-batch (a
    slice of rows) has a finite loss.
    """
    appended = mask_id is None
    mask_id = vocab_size - 1 if appended else mask_id
    r = torch.rand(tokens.shape, generator=gen)                          # (B, T)
    selected = (r < MASK_PROB) | (r == r.min(dim=1, keepdim=True).values)
    action = torch.rand(tokens.shape, generator=gen)                     # (B, T)
    random_ids = torch.randint(0, vocab_size - appended, tokens.shape, generator=gen)  # (B, T)
    replace = selected & (action < MASK_REPLACE)
    randomize = selected & (action >= MASK_REPLACE) & (action < MASK_REPLACE + MASK_RANDOM)
    inputs = torch.where(replace, torch.full_like(tokens, mask_id), tokens)
    inputs = torch.where(randomize, random_ids, inputs)
    targets = torch.where(selected, tokens, torch.full_like(tokens, IGNORE_INDEX))
    return inputs, targets


def _take(data, index: torch.Tensor) -> torch.Tensor:
    """``data[index]`` as int64; of a file (``chimera.data.formats.TokenFile``) only the indexed
    pages are read."""
    if isinstance(data, torch.Tensor):
        return data[index].long()
    return torch.from_numpy(np.asarray(data[index.numpy()], dtype=np.int64))


def get_batch(corpus: "Corpus | torch.Tensor", step: int, global_batch: int, seq_len: int,
              seed: int, kind: str = "gpt2", *, split: str = "train",
              vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The mini-batch of ``step``: ``(inputs, targets)``, int64, (global_batch, seq_len).

    ``corpus`` is a ``Corpus`` or a bare byte tensor (split 95/5). GPT-2: targets are the
    inputs shifted by one. BERT: masked LM, targets are the original tokens at the selected
    positions and ``IGNORE_INDEX`` elsewhere; the mask id is the corpus's tokenizer's, else
    ``vocab_size - 1`` (default: ``model_vocab(corpus, kind)``).
    """
    vocab_size = model_vocab(corpus, kind) if vocab_size is None else vocab_size
    _check_batch_args(step, global_batch, seq_len, kind, vocab_size, corpus)
    if isinstance(corpus, Mixture):
        return _mixed_batch(corpus, step, global_batch, seq_len, seed, kind, split, vocab_size)
    data = split_corpus(corpus, split)
    need = seq_len + 1 if kind == "gpt2" else seq_len
    if len(data) < need:
        raise UserError(f"the {split!r} split has {len(data)} tokens, fewer than one "
                         f"sequence needs ({need})")
    gen = torch.Generator().manual_seed(derive_seed(seed, "batch", split, step))
    starts = torch.randint(0, len(data) - need + 1, (global_batch, 1), generator=gen)
    windows = _take(data, starts + torch.arange(need))                   # (B, need)
    if kind == "gpt2":
        return windows[:, :-1], windows[:, 1:]                           # (B, T) each
    return mask_tokens(windows, gen, vocab_size, getattr(corpus, "mask_id", None))


def _mixed_batch(mix: Mixture, step: int, global_batch: int, seq_len: int, seed: int,
                 kind: str, split: str, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row from the part a seeded draw by the weights gives it, those rows drawn from
    that part as ``get_batch`` draws them (``chimera.data.mixture``)."""
    which = mix.rows(global_batch, derive_seed(seed, "mix", split, step))   # (B,)
    inputs = torch.empty(global_batch, seq_len, dtype=torch.long)
    targets = torch.empty(global_batch, seq_len, dtype=torch.long)
    for k, part in enumerate(mix.parts):
        rows = (which == k).nonzero().flatten()
        if len(rows):
            inputs[rows], targets[rows] = get_batch(part, step, len(rows), seq_len,
                                                    derive_seed(seed, "part", k), kind,
                                                    split=split, vocab_size=vocab_size)
    return inputs, targets


@dataclass(frozen=True, eq=False)
class Batches:
    """``batches[step]`` is ``get_batch(corpus, step, ...)`` with the fields below."""

    corpus: Corpus | torch.Tensor
    global_batch: int
    seq_len: int
    seed: int
    kind: str = "gpt2"
    split: str = "train"
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        vocab = model_vocab(self.corpus, self.kind) if self.vocab_size is None else self.vocab_size
        _check_batch_args(0, self.global_batch, self.seq_len, self.kind, vocab, self.corpus)
        split_corpus(self.corpus, self.split)                # validates the split name

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return get_batch(self.corpus, step, self.global_batch, self.seq_len, self.seed,
                         self.kind, split=self.split, vocab_size=self.vocab_size)
