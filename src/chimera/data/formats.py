"""What ``--data`` points at, read as token ids (the README's "Data formats").

=========================  ============================================  ====================
path                       read as                                       vocabulary
=========================  ============================================  ====================
(none)                     the stdlib's source, bytes or ``--tokenizer``  256 / the tokenizer
text file, text folder     bytes, or the ids of ``--tokenizer``           256 / the tokenizer
``*.bin``                  ids of ``--token-dtype`` (memory-mapped)       --vocab-size, meta
folder with ``train.bin``  train.bin, val.bin held out (memory-mapped)    --vocab-size, meta
``*.npy``                  a 1-D integer array (memory-mapped)            --vocab-size
``*.jsonl``                each object's ``--text-field``, as text        as text
``datasets`` folder        its ``input_ids`` column, else a text column   as ids / as text
=========================  ============================================  ====================

"meta" is the ``meta.json`` that ``chimera tokenize`` writes beside its token files (dtype,
vocabulary, tokenizer, its mask id); ``--tokenizer`` also gives token ids their vocabulary.
A tokenizer's mask token (``[MASK]``, ``<mask>``) is the id BERT masks with. Anything
else is refused with one line (``ValueError``): a JSON file, a pickle, an archive, a float
array, a binary file. Nothing unrecognized is read as bytes.

``describe(spec)`` finds the format and the vocabulary without reading the tokens (a
config check); ``open_data(spec)`` reads them into a ``Corpus`` and checks every id.
Ids it makes in memory (text through a tokenizer, a datasets column) ``to_token_file``
writes to a file, so a launcher makes them once and its ranks map them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from chimera.data import datasets, text
from chimera.data import BYTE_VOCAB, Corpus, check_corpus_path, load_corpus
from chimera.data.tokens import TOKEN_DTYPES, TokenFile, bin_file, npy_file
from chimera.errors import UserError

MAX_VOCAB = 2**24               # an embedding row per id: beyond this is a typo, not a model
META, META_FORMAT = "meta.json", "chimera-tokens"
TEXT_SUFFIXES = (".jsonl",)
TOKEN_FILES = ("bin", "token-folder", "npy")
# files a folder read as text must not hold: they are data in a format of their own
DATA_SUFFIXES = (".bin", ".npy", ".npz", ".jsonl", ".arrow", ".parquet", ".pkl", ".pickle",
                 ".pt", ".pth", ".safetensors")
_MAGIC = (  # the first bytes of formats that must never be read as text
    (b"PK\x03\x04", "a zip archive"), (b"PK\x05\x06", "a zip archive"),
    (b"\x1f\x8b", "gzip-compressed"), (b"BZh", "bzip2-compressed"),
    (b"\xfd7zXZ\x00", "xz-compressed"), (b"\x28\xb5\x2f\xfd", "zstd-compressed"),
    (b"\x93NUMPY", "a NumPy .npy file"), (b"ARROW1", "an Arrow file"),
    (b"\xff\xff\xff\xff", "an Arrow stream"), (b"PAR1", "a Parquet file"),
    (b"\x7fELF", "an executable"), (b"\x89PNG", "a PNG image"),
)
_SUFFIX_KIND = {".pkl": "a pickle", ".pickle": "a pickle", ".npz": "a NumPy .npz archive",
                ".zip": "a zip archive", ".gz": "gzip-compressed", ".parquet": "a Parquet file",
                ".pt": "a torch pickle", ".pth": "a torch pickle", ".safetensors": "model weights",
                ".arrow": "an Arrow file"}


@dataclass(frozen=True)
class DataSpec:
    """``--data`` and the flags that say how to read it."""

    path: str | None = None          # None: the standard library's source
    token_dtype: str | None = None   # uint16 | uint32: the ids of a .bin file
    vocab_size: int | None = None    # ids are below it; the model's vocabulary
    text_field: str | None = None    # the text of a .jsonl object or a datasets row
    tokenizer: str | None = None     # a tokenizer.json (HF tokenizers) for text

    def __post_init__(self) -> None:
        if self.token_dtype is not None and self.token_dtype not in TOKEN_DTYPES:
            raise UserError(f"--token-dtype must be one of {', '.join(TOKEN_DTYPES)}, "
                             f"got {self.token_dtype!r}")
        v = self.vocab_size
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 2 <= v <= MAX_VOCAB):
            raise UserError(f"--vocab-size must be an integer from 2 to {MAX_VOCAB:,}, got {v!r}")
        if self.text_field is not None and (not isinstance(self.text_field, str) or not self.text_field):
            raise UserError(f"--text-field must be a column name, got {self.text_field!r}")

    @property
    def field(self) -> str:
        return self.text_field or "text"


@dataclass(frozen=True)
class DataInfo:
    """What ``describe`` finds: the format, and the vocabulary the ids come from."""

    format: str          # stdlib | text | bin | token-folder | npy | jsonl | datasets
    vocab_size: int
    is_bytes: bool       # text read as bytes (no tokenizer)
    text: bool           # text (as bytes or through the tokenizer), not token ids
    tokenizer: str | None = None
    column: str | None = None  # datasets: the column read
    mask_id: int | None = None  # the tokenizer's mask token: BERT masks with it


# ---------------------------------------------------------------------------------------
# Which format

def detect(spec: DataSpec) -> str:
    """The format of ``spec.path`` (by its layout and suffix; a file's first bytes for
    binaries). Raises ``ValueError`` for anything that is not a supported format."""
    if spec.path is None:
        return "stdlib"
    p = Path(spec.path)
    check_corpus_path(p)
    if p.is_dir():
        return _detect_folder(p)
    suffix = p.suffix.lower()
    if suffix == ".bin":
        return "bin"
    if suffix == ".npy":
        return "npy"
    if suffix in TEXT_SUFFIXES:
        return "jsonl"
    if suffix == ".json":
        raise UserError(_json_refusal(p))
    with open(p, "rb") as f:
        head = f.read(16)
    kind = binary_kind(head, suffix)
    if kind:
        raise UserError(f"--data {p} is {kind}, not a supported data format: give text, .bin, "
                         ".npy, .jsonl or a datasets folder")
    return "text"


def binary_kind(head: bytes, suffix: str = "") -> str | None:
    """What a file is when its suffix or first bytes say it is not text (None: maybe text)."""
    if suffix in _SUFFIX_KIND:
        return _SUFFIX_KIND[suffix]
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "a pickle"
    return None


def _json_refusal(p: Path) -> str:
    if (p.parent / "state.json").exists() and (p.parent / "dataset_info.json").exists():
        hint = f"it is a datasets folder's metadata: pass the folder, --data {p.parent}"
    elif p.name == "tokenizer.json" or p.name.endswith("tokenizer.json"):
        hint = "a tokenizer goes to --tokenizer"
    else:
        hint = "give JSON lines (.jsonl, one object a line) with a text field"
    return f"--data {p} is a JSON file, not training data: {hint}"


def _detect_folder(p: Path) -> str:
    if (p / "dataset_dict.json").is_file():
        splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        raise UserError(f"--data {p} is a datasets DatasetDict (splits: {', '.join(splits)}): "
                         f"pass one split's folder, e.g. --data {p / (splits or ['train'])[0]}")
    if datasets.is_datasets_folder(p):
        return "datasets"
    if (p / "train.bin").is_file():
        return "token-folder"
    for f in text.folder_files(p):
        if f.suffix.lower() in DATA_SUFFIXES:
            raise UserError(f"--data {p} holds {f.relative_to(p)}, a data file: a folder is read "
                             "as text, so pass that file itself as --data")
    return "text"


# ---------------------------------------------------------------------------------------
# Which vocabulary (without reading the ids)

def describe(spec: DataSpec) -> DataInfo:
    """The format of ``spec`` and its vocabulary; refuses flags that do not apply."""
    fmt = detect(spec)
    _check_flags(spec, fmt)
    column = datasets.pick_column(spec) if fmt == "datasets" else None
    as_text = fmt in ("stdlib", "text", "jsonl") or column == spec.field
    if fmt in TOKEN_FILES:
        _token_arrays(spec, fmt)  # dtype, shape and size: a header and a stat
    known, mask_id = {}, None
    if spec.tokenizer is not None:
        tokenizer = text.load_tokenizer(spec.tokenizer)
        known[f"--tokenizer {spec.tokenizer}"] = tokenizer.get_vocab_size()
        mask_id = text.mask_id_of(tokenizer)
    meta = _meta_for(spec.path, fmt)
    if meta is not None:
        known[meta["path"]] = meta["vocab_size"]
    if as_text and spec.tokenizer is None:
        if spec.vocab_size is not None:
            raise UserError(f"--vocab-size applies to token ids: {_what(spec, fmt)} is read as "
                             f"bytes ({BYTE_VOCAB} ids; give --tokenizer to read it as tokens)")
        return DataInfo(fmt, BYTE_VOCAB, True, True, column=column)
    vocab = _resolve_vocab(spec, known, fmt)
    if spec.tokenizer is None and meta is not None:
        return DataInfo(fmt, vocab, False, as_text, meta["tokenizer_path"], column, _meta_mask(meta))
    return DataInfo(fmt, vocab, False, as_text, spec.tokenizer, column, mask_id)


def _what(spec: DataSpec, fmt: str) -> str:
    return "the standard library's source" if fmt == "stdlib" else spec.path


def _check_flags(spec: DataSpec, fmt: str) -> None:
    if spec.token_dtype is not None and fmt not in ("bin", "token-folder"):
        raise UserError(f"--token-dtype applies to .bin token files, not to {_what(spec, fmt)} "
                         "(a .npy and a datasets folder say their own dtype)")
    if spec.text_field is not None and fmt not in ("jsonl", "datasets"):
        raise UserError(f"--text-field applies to .jsonl files and datasets folders, not to "
                         f"{_what(spec, fmt)}")


def _resolve_vocab(spec: DataSpec, known: dict[str, int], fmt: str) -> int:
    if len(set(known.values())) > 1:
        raise UserError("the vocabulary sizes disagree: " + ", ".join(
            f"{k} says {v}" for k, v in known.items()))
    have = max(known.values()) if known else None
    if spec.vocab_size is None:
        if have is None:
            raise UserError(f"{spec.path} holds token ids but no vocabulary size: give "
                             "--vocab-size (e.g. 50257 for GPT-2's tokenizer) or --tokenizer")
        return have
    if have is not None and spec.vocab_size < have:
        source = next(iter(known))
        raise UserError(f"--vocab-size {spec.vocab_size} is smaller than the vocabulary of "
                         f"{source} ({have})")
    return spec.vocab_size


def _meta_for(path: str | None, fmt: str) -> dict | None:
    """The ``meta.json`` of ``chimera tokenize`` that covers this token file or folder."""
    if fmt not in ("bin", "token-folder"):
        return None
    folder, name = (Path(path), "train.bin") if fmt == "token-folder" else (Path(path).parent, Path(path).name)
    meta_path = folder / META
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"{meta_path} is not JSON") from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        return None  # another tool's meta.json: it says nothing about these ids
    if name not in meta.get("files", {}).values():
        return None
    if meta.get("dtype") not in TOKEN_DTYPES or not isinstance(meta.get("vocab_size"), int):
        raise UserError(f"{meta_path} is malformed: it needs dtype (uint16|uint32) and vocab_size")
    v = meta["vocab_size"]
    if isinstance(v, bool) or not 2 <= v <= MAX_VOCAB:  # the limit --vocab-size has
        raise UserError(f"{meta_path} is malformed: its vocab_size {v:,} is not from 2 to "
                        f"{MAX_VOCAB:,}")
    tok = meta.get("tokenizer")
    return {**meta, "path": str(meta_path), "tokenizer_path": str(folder / tok) if tok else None}


def _meta_mask(meta: dict) -> int | None:
    """The mask id a ``meta.json`` records; of one written before it recorded one, that of
    the tokenizer it names (if that file is still there and the optional tokenizers package
    reads it: the ids themselves never needed it, so its absence is no reason to refuse them)."""
    if "mask_id" not in meta:
        tok = meta["tokenizer_path"]
        if not tok or not Path(tok).is_file():
            return None
        try:
            return text.mask_id_of(text.load_tokenizer(tok))
        except UserError:
            return None
    mask_id = meta["mask_id"]
    if mask_id is not None and (not isinstance(mask_id, int) or not 0 <= mask_id < meta["vocab_size"]):
        raise UserError(f"{meta['path']} is malformed: its mask_id {mask_id!r} is not an id "
                         f"below its vocab_size {meta['vocab_size']}")
    return mask_id


# ---------------------------------------------------------------------------------------
# Reading

def open_data(spec: DataSpec, *, seq_len: int | None = None, progress: bool = False,
              scan: bool = True) -> Corpus:
    """Read ``spec`` into a ``Corpus`` (token files memory-mapped); check every id is below
    the vocabulary (``scan=False``: not the ids of token files, which another process of the
    run reads through) and the training split holds one sequence of ``seq_len`` + 1."""
    info = describe(spec)
    where = _what(spec, info.format)
    if info.format in ("stdlib", "text") and info.is_bytes:
        corpus = Corpus.of_bytes(load_corpus(spec.path, seq_len=seq_len), where)
    elif info.text:  # of a file, folder, .jsonl or datasets column, as bytes or through a tokenizer
        corpus = _text(spec, info, progress)
    elif info.format == "datasets":
        ids = datasets.token_ids(spec, info.column, info.vocab_size)
        corpus = Corpus.from_tokens(ids, info.vocab_size, where, tokenizer=info.tokenizer,
                                    mask_id=info.mask_id)
    else:
        corpus = _token_files(spec, info, progress, scan)
    _check_length(corpus, seq_len)
    return corpus


def _text(spec: DataSpec, info: DataInfo, progress: bool) -> Corpus:
    where = _what(spec, info.format)
    if info.is_bytes:
        data = text.pieces_as_bytes(text.text_pieces(spec, info.format), where)
        return Corpus.of_bytes(data, where)
    tokenizer = text.load_tokenizer(spec.tokenizer)
    pieces, held = text.split_pieces(spec, info.format)
    total = None if info.format == "stdlib" else data_size(spec)
    ids = text.encode_all(tokenizer, pieces, info.vocab_size, progress, total)
    if len(ids) == 0:
        raise UserError(f"{where} holds no text")
    facts = dict(tokenizer=spec.tokenizer, mask_id=info.mask_id)
    if held is None:
        return Corpus.from_tokens(ids, info.vocab_size, where, **facts)
    val = text.encode_all(tokenizer, held, info.vocab_size)  # the stdlib's held-out files
    return Corpus(ids, val, info.vocab_size, where, **facts)


def _token_files(spec: DataSpec, info: DataInfo, progress: bool, scan: bool = True) -> Corpus:
    train, val = _token_arrays(spec, info.format, info.vocab_size if scan else None, progress)
    facts = dict(tokenizer=info.tokenizer, mask_id=info.mask_id)
    if val is None:
        return Corpus.from_tokens(train, info.vocab_size, spec.path, **facts)
    return Corpus(train, val, info.vocab_size, spec.path, **facts)


def _token_arrays(spec: DataSpec, fmt: str, vocab: int | None = None, progress: bool = False):
    """(the ids, the held-out ids or None) of token files; every id is read and checked
    against ``vocab`` unless it is None (then only dtype, shape and size are)."""
    p = Path(spec.path)
    if fmt == "npy":
        return npy_file(p, vocab, progress), None
    meta = _meta_for(spec.path, fmt)
    dtype = spec.token_dtype or (meta or {}).get("dtype")
    if dtype is None:
        raise UserError(f"{p} holds raw token ids of no stated width: give --token-dtype "
                         "uint16 or uint32 (nanoGPT writes uint16)")
    if meta is not None and spec.token_dtype not in (None, meta["dtype"]):
        raise UserError(f"--token-dtype {spec.token_dtype} contradicts {meta['path']} "
                         f"(dtype {meta['dtype']})")
    if fmt == "bin":
        return bin_file(p, dtype, vocab, progress), None
    val = p / "val.bin"  # nanoGPT's layout: train.bin, and val.bin held out
    held = bin_file(val, dtype, vocab, progress) if val.is_file() else None
    return bin_file(p / "train.bin", dtype, vocab, progress), held


def ids_in_memory(info: DataInfo) -> bool:
    """Whether ``open_data`` makes the ids in memory: text through a tokenizer, a datasets
    folder's column (not bytes, which are the text itself, nor token files, mapped)."""
    return not info.is_bytes and info.format not in TOKEN_FILES


def to_token_file(corpus: Corpus, path: str | os.PathLike) -> Corpus:
    """The corpus over its ids written to ``path`` (read-only; training ids, then held-out
    ids): the processes that read it share its pages instead of each making the ids."""
    train, val = np.asarray(corpus.train), np.asarray(corpus.val)
    with open(path, "wb") as f:
        train.tofile(f)
        val.tofile(f)
    os.chmod(path, 0o444)
    return dataclasses.replace(corpus, train=TokenFile(str(path), train.dtype, 0, len(train)),
                               val=TokenFile(str(path), val.dtype, train.nbytes, len(val)))


def _check_length(corpus: Corpus, seq_len: int | None) -> None:
    if seq_len is not None and len(corpus.train) < seq_len + 1:
        raise UserError(f"{corpus.where} has {len(corpus.train):,} tokens in its training "
                         f"split: fewer than one sequence of {seq_len} + 1")


def data_size(spec: DataSpec) -> int:
    """Bytes on disk under ``spec.path`` (for progress bars)."""
    p = Path(spec.path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in text.folder_files(p))

