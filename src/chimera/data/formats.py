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

Each row is one entry of ``FORMATS`` (a ``Format``: how the path is recognized, and its
text pieces or its ids); ``detect(spec)`` asks the entries in turn, ``describe(spec)``
finds the format and the vocabulary without reading the tokens (a config check), and
``open_data(spec)`` reads them into a ``Corpus`` and checks every id.
Ids it makes in memory (text through a tokenizer, a datasets column) ``to_token_file``
writes to a file, so a launcher makes them once and its ranks map them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from chimera.data import datasets, text
from chimera.data import BYTE_VOCAB, VAL_FRACTION, Corpus, check_corpus_path, file_ends, load_corpus
from chimera.data.documents import check_fraction, eos_ends
from chimera.data.mixture import Mixture, parse_mix
from chimera.data.meta import MAX_VOCAB, meta_mask, read_meta, token_dtype
from chimera.data.meta import META, META_FORMAT  # noqa: F401  (imported from here, as before)
from chimera.data.tokens import TOKEN_DTYPES, TokenFile, bin_file, npy_file
from chimera.errors import UserError

TEXT_SUFFIXES = (".jsonl",)
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
    val_data: str | None = None      # held-out data read as path is (None: held out of path)
    val_fraction: float | None = None  # the documents held out of path (None: VAL_FRACTION)
    mix: tuple[str, ...] = ()        # PATH:WEIGHT sources mixed by weight, instead of path
    eos_id: int | None = None        # the id that ends each document of token ids (None: the
                                     # tokenizer's or meta.json's, if they name one)

    def __post_init__(self) -> None:
        if self.mix:
            parse_mix(self.mix)
            if self.path is not None:
                raise UserError("--data and --data-mix both say what trains: give one")
        if self.val_fraction is not None:
            check_fraction(self.val_fraction)
            if self.path is None and not self.mix:
                raise UserError("--val-fraction applies to --data: the standard library's "
                                 "held-out files are a fixed choice (1 in 20)")
            if self.val_data is not None and self.val_fraction:
                raise UserError("--val-fraction and --val-data both say what is held out: "
                                 "give one (with --val-data every document of --data trains)")
        if self.token_dtype is not None and self.token_dtype not in TOKEN_DTYPES:
            raise UserError(f"--token-dtype must be one of {', '.join(TOKEN_DTYPES)}, "
                             f"got {self.token_dtype!r}")
        v = self.vocab_size
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 2 <= v <= MAX_VOCAB):
            raise UserError(f"--vocab-size must be an integer from 2 to {MAX_VOCAB:,}, got {v!r}")
        if self.text_field is not None and (not isinstance(self.text_field, str) or not self.text_field):
            raise UserError(f"--text-field must be a column name, got {self.text_field!r}")
        e = self.eos_id
        if e is not None and (not isinstance(e, int) or isinstance(e, bool) or not 0 <= e < MAX_VOCAB):
            raise UserError(f"--eos-id must be an id from 0 to {MAX_VOCAB - 1:,}, got {e!r}")

    @property
    def field(self) -> str:
        return self.text_field or "text"

    def parts(self) -> list[tuple["DataSpec", float]]:
        """Each source of ``mix`` as a spec of its own, and its weight."""
        return [(dataclasses.replace(self, path=path, mix=()), weight)
                for path, weight in parse_mix(self.mix)]

    @property
    def fraction(self) -> float:
        """The share of documents of ``path`` held out: none when ``val_data`` is held out."""
        if self.val_data is not None:
            return 0.0
        return VAL_FRACTION if self.val_fraction is None else self.val_fraction

    def validation(self) -> "DataSpec":
        """``val_data`` read with the flags ``path`` is read with, all of it held out."""
        return dataclasses.replace(self, path=self.val_data, val_data=None, val_fraction=0.0)


@dataclass(frozen=True)
class DataInfo:
    """What ``describe`` finds: the format, and the vocabulary the ids come from."""

    format: str          # a key of FORMATS: stdlib | text | bin | token-folder | npy | ...
    vocab_size: int
    is_bytes: bool       # text read as bytes (no tokenizer)
    text: bool           # text (as bytes or through the tokenizer), not token ids
    tokenizer: str | None = None
    column: str | None = None  # the column read (a datasets folder)
    mask_id: int | None = None  # the tokenizer's mask token: BERT masks with it
    eos_id: int | None = None   # the end-of-text id that ends each document of token ids


# ---------------------------------------------------------------------------------------
# The formats: one entry each

def data_size(spec: DataSpec) -> int:
    """Bytes on disk under ``spec.path`` (for progress bars)."""
    p = Path(spec.path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in text.folder_files(p))


_FLAGS = {  # a DataSpec field given for a format that does not take it is refused
    "token_dtype": "--token-dtype applies to .bin token files, not to {} (a .npy and a "
                   "datasets folder say their own dtype)",
    "text_field": "--text-field applies to .jsonl files and datasets folders, not to {}",
}


@dataclass(frozen=True)
class Format:
    """One kind of ``--data``: how it is recognized and read. ``detect``, ``describe``,
    ``open_data`` and ``chimera tokenize`` look a format up in ``FORMATS`` and branch on
    nothing else, so a new format is one entry there.

    A format holds text (``pieces``), token ids (``ids``), or either, by the column it
    reads (both, and ``column``: text when the column is ``spec.field``)."""

    name: str
    claims: Callable[[Path | None], bool]  # the path is of this format; may refuse a near miss
    pieces: Callable | None = None  # (spec, check_size) -> (training pieces, held-out or None)
    ids: Callable | None = None     # (spec, column, vocab or None: no id check, progress,
                                    # eos id or None) -> (ids, held-out ids or None: held out
                                    # of ids, where its documents end or None: not known)
    column: Callable | None = None  # (spec) -> the column read
    read_bytes: Callable | None = None  # (spec, seq_len) -> uint8 tensor (else: the pieces)
    meta_of: Callable | None = None  # (path) -> (folder, file) a chimera meta.json may cover
    flags: tuple[str, ...] = ()     # the DataSpec fields that apply to it (_FLAGS)
    mapped: bool = False            # ids memory-mapped from files: describe reads their headers
    size: Callable = data_size      # (spec) -> bytes it reads, or None (progress bars)
    fallback: bool = False          # claims what no other entry does: tried last

    def __post_init__(self) -> None:
        if self.pieces is None and self.ids is None:
            raise ValueError(f"format {self.name!r} reads neither text (pieces) nor ids")
        if (self.column is not None) != (self.pieces is not None and self.ids is not None):
            raise ValueError(f"format {self.name!r}: a column chooses between text and ids, "
                             "so it needs both pieces and ids (and only then)")
        if (self.mapped and self.ids is None) or (self.read_bytes is not None and self.pieces is None):
            raise ValueError(f"format {self.name!r}: mapped needs ids, read_bytes pieces")
        if set(self.flags) - set(_FLAGS):
            raise ValueError(f"format {self.name!r}: flags must be among {', '.join(_FLAGS)}")


def file_suffix(suffix: str) -> Callable[[Path | None], bool]:
    """A ``claims`` for files named ``*suffix`` (any case)."""
    return lambda p: p is not None and not p.is_dir() and p.suffix.lower() == suffix


def _is_stdlib(p: Path | None) -> bool:
    return p is None


def _is_datasets(p: Path | None) -> bool:
    if p is None or not p.is_dir():
        return False
    if (p / "dataset_dict.json").is_file():
        splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        raise UserError(f"--data {p} is a datasets DatasetDict (splits: {', '.join(splits)}): "
                         f"pass one split's folder, e.g. --data {p / (splits or ['train'])[0]}")
    return datasets.is_datasets_folder(p)


def _is_token_folder(p: Path | None) -> bool:
    return p is not None and p.is_dir() and (p / "train.bin").is_file()


def _is_jsonl(p: Path | None) -> bool:
    if p is not None and not p.is_dir() and p.suffix.lower() == ".json":
        raise UserError(_json_refusal(p))
    return p is not None and not p.is_dir() and p.suffix.lower() in TEXT_SUFFIXES


def _is_text(p: Path | None) -> bool:
    """Text: what no other format claims, unless it shows it is not text."""
    if p is None:
        return False
    if p.is_dir():
        for f in text.folder_files(p):
            if f.suffix.lower() in DATA_SUFFIXES:
                raise UserError(f"--data {p} holds {f.relative_to(p)}, a data file: a folder is "
                                 "read as text, so pass that file itself as --data")
        return True
    with open(p, "rb") as f:
        head = f.read(16)
    kind = binary_kind(head, p.suffix.lower())
    if kind:
        raise UserError(f"--data {p} is {kind}, not a supported data format: give text, .bin, "
                         ".npy, .jsonl or a datasets folder")
    return True


def _beside(p: Path) -> tuple[Path, str]:
    return p.parent, p.name


def _inside(p: Path) -> tuple[Path, str]:
    return p, "train.bin"


def _eos_split(ids, held, eos: int | None):
    """Token ids whose documents end with ``eos`` (when it is known and nothing else is held
    out): where each ends, found by a read of the ids."""
    return ids, held, (None if held is not None or eos is None else eos_ends(ids, eos))


def _bin_ids(spec: DataSpec, column, vocab: int | None, progress: bool, eos: int | None = None):
    dtype = token_dtype(spec, read_meta(spec.path, _beside))
    return _eos_split(bin_file(Path(spec.path), dtype, vocab, progress), None, eos)


def _folder_ids(spec: DataSpec, column, vocab: int | None, progress: bool, eos: int | None = None):
    p = Path(spec.path)  # nanoGPT's layout: train.bin, and val.bin held out
    dtype = token_dtype(spec, read_meta(spec.path, _inside))
    held = None
    if (p / "val.bin").is_file() and spec.val_data is None:
        held = bin_file(p / "val.bin", dtype, vocab, progress)
    return _eos_split(bin_file(p / "train.bin", dtype, vocab, progress), held, eos)


def _npy_ids(spec: DataSpec, column, vocab: int | None, progress: bool, eos: int | None = None):
    return _eos_split(npy_file(Path(spec.path), vocab, progress), None, eos)


def _column_ids(spec: DataSpec, column: str, vocab: int | None, progress: bool, eos=None):
    ids, ends = datasets.token_ids(spec, column, vocab)  # each row a document
    return ids, None, ends


def _load_bytes(spec: DataSpec, seq_len: int | None):
    return load_corpus(spec.path, seq_len=seq_len)


FORMATS: dict[str, Format] = {f.name: f for f in (  # tried in this order, the fallback last
    Format("stdlib", _is_stdlib, pieces=text.stdlib_pieces, read_bytes=_load_bytes,
           size=lambda spec: None),
    Format("datasets", _is_datasets, pieces=datasets.text_pieces, ids=_column_ids,
           column=datasets.pick_column, flags=("text_field",)),
    Format("token-folder", _is_token_folder, ids=_folder_ids, meta_of=_inside,
           flags=("token_dtype",), mapped=True),
    Format("bin", file_suffix(".bin"), ids=_bin_ids, meta_of=_beside, flags=("token_dtype",),
           mapped=True),
    Format("npy", file_suffix(".npy"), ids=_npy_ids, mapped=True),
    Format("jsonl", _is_jsonl, pieces=text.jsonl_pieces, flags=("text_field",)),
    Format("text", _is_text, pieces=text.file_pieces, read_bytes=_load_bytes, fallback=True),
)}
TOKEN_FILES = tuple(name for name, f in FORMATS.items() if f.mapped)  # as the table stands


# ---------------------------------------------------------------------------------------
# Which format

def detect(spec: DataSpec) -> str:
    """The format of ``spec.path``: the first entry of ``FORMATS`` that claims it (by its
    layout and suffix; a file's first bytes for binaries). Raises ``ValueError`` for
    anything that is not a supported format."""
    p = None if spec.path is None else Path(spec.path)
    if p is not None:
        check_corpus_path(p)
    for fmt in sorted(FORMATS.values(), key=lambda f: f.fallback):
        if fmt.claims(p):
            return fmt.name
    raise UserError(f"--data {p} is not a supported data format: give text, .bin, .npy, "
                     ".jsonl or a datasets folder")


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


# ---------------------------------------------------------------------------------------
# Which vocabulary (without reading the ids)

def describe(spec: DataSpec) -> DataInfo:
    """The format of ``spec`` and its vocabulary (and of ``--val-data``, which must read as
    the same vocabulary); refuses flags that do not apply."""
    if spec.mix:  # the first source's facts, which every other must share
        infos = [(part.path, describe(part)) for part, _ in spec.parts()]
        for path, other in infos[1:]:
            if (other.is_bytes, other.vocab_size) != (infos[0][1].is_bytes, infos[0][1].vocab_size):
                raise UserError(f"--data-mix: {path} reads as {_ids_of(other)}, {infos[0][0]} as "
                                 f"{_ids_of(infos[0][1])}: mixed sources must share a vocabulary")
        return infos[0][1]
    info = _describe(spec)
    if spec.val_data is not None:
        try:
            held = _describe(spec.validation())
        except UserError as exc:
            raise UserError(f"--val-data: {exc}") from None
        if (held.is_bytes, held.vocab_size) != (info.is_bytes, info.vocab_size):
            raise UserError(f"--val-data {spec.val_data} reads as {_ids_of(held)}, --data as "
                             f"{_ids_of(info)}: held-out data must be in the training vocabulary")
    return info


def _ids_of(info: DataInfo) -> str:
    return "bytes" if info.is_bytes else f"ids of a vocabulary of {info.vocab_size}"


def _describe(spec: DataSpec) -> DataInfo:
    fmt = FORMATS[detect(spec)]
    _check_flags(spec, fmt)
    column = fmt.column(spec) if fmt.column is not None else None
    as_text = fmt.ids is None or column == spec.field
    if fmt.mapped:
        fmt.ids(spec, column, None, False)  # dtype, shape and size: a header and a stat
    known, mask_id, eos_id = {}, None, None
    if spec.tokenizer is not None:
        tokenizer = text.load_tokenizer(spec.tokenizer)
        known[f"--tokenizer {spec.tokenizer}"] = tokenizer.get_vocab_size()
        mask_id, eos_id = text.mask_id_of(tokenizer), text.eos_id_of(tokenizer)
    meta = read_meta(spec.path, fmt.meta_of)
    if meta is not None:
        known[meta["path"]] = meta["vocab_size"]
    if as_text and spec.tokenizer is None:
        for name, value in (("--vocab-size", spec.vocab_size), ("--eos-id", spec.eos_id)):
            if value is not None:
                raise UserError(f"{name} applies to token ids: {_what(spec)} is read as bytes "
                                 f"({BYTE_VOCAB} ids; give --tokenizer to read it as tokens)")
        return DataInfo(fmt.name, BYTE_VOCAB, True, True, column=column)
    vocab = _resolve_vocab(spec, known)
    if spec.tokenizer is None and meta is not None:
        mask_id, eos_id, tokenizer = meta_mask(meta), meta.get("eos_id"), meta["tokenizer_path"]
        said = meta["path"]
    else:
        tokenizer, said = spec.tokenizer, f"--tokenizer {spec.tokenizer}"
    eos_id = _resolve_eos(spec, eos_id, said, vocab)
    return DataInfo(fmt.name, vocab, False, as_text, tokenizer, column, mask_id, eos_id)


def _resolve_eos(spec: DataSpec, known: int | None, said: str, vocab: int) -> int | None:
    """The end-of-text id: ``--eos-id`` (raw token files name none), else the tokenizer's or
    meta.json's; one that contradicts them, or is not below the vocabulary, is refused."""
    if spec.eos_id is None:
        return known
    if known is not None and known != spec.eos_id:
        raise UserError(f"--eos-id {spec.eos_id} contradicts {said} (end-of-text id {known})")
    if spec.eos_id >= vocab:
        raise UserError(f"--eos-id {spec.eos_id} is not below the vocabulary ({vocab} ids)")
    return spec.eos_id


def _what(spec: DataSpec) -> str:
    return "the standard library's source" if spec.path is None else spec.path


def _check_flags(spec: DataSpec, fmt: Format) -> None:
    for flag, refusal in _FLAGS.items():
        if getattr(spec, flag) is not None and flag not in fmt.flags:
            raise UserError(refusal.format(_what(spec)))


def _resolve_vocab(spec: DataSpec, known: dict[str, int]) -> int:
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


# ---------------------------------------------------------------------------------------
# Reading

def open_data(spec: DataSpec, *, seq_len: int | None = None, progress: bool = False,
              scan: bool = True) -> Corpus:
    """Read ``spec`` into a ``Corpus`` (token files memory-mapped); check every id is below
    the vocabulary (``scan=False``: not the ids of token files, which another process of the
    run reads through) and the training split holds one sequence of ``seq_len`` + 1. The
    held-out split is ``--val-data`` whole, else whole documents of ``--data``
    (``Corpus.from_tokens``). ``--data-mix``: a ``Mixture`` of each source read so."""
    if spec.mix:
        describe(spec)  # one vocabulary
        parts = [(open_data(part, seq_len=seq_len, progress=progress, scan=scan), weight)
                 for part, weight in spec.parts()]
        total = sum(weight for _, weight in parts)
        return Mixture(tuple(p for p, _ in parts), tuple(w / total for _, w in parts))
    corpus = _open(spec, describe(spec), seq_len, progress, scan)
    if spec.val_data is not None:
        held = spec.validation()
        corpus = dataclasses.replace(corpus, val=_open(held, _describe(held), None, progress,
                                                       scan).train)
    _check_length(corpus, seq_len)
    return corpus


def _open(spec: DataSpec, info: DataInfo, seq_len: int | None, progress: bool,
          scan: bool) -> Corpus:
    fmt = FORMATS[info.format]
    if info.text:  # as bytes or through a tokenizer
        return _text(spec, fmt, info, seq_len, progress)
    vocab = info.vocab_size if scan or not fmt.mapped else None
    train, val, ends = fmt.ids(spec, info.column, vocab, progress, info.eos_id)
    return _of_ids(train, val, info, spec, ends, tokenizer=info.tokenizer)


def _text(spec: DataSpec, fmt: Format, info: DataInfo, seq_len: int | None,
          progress: bool) -> Corpus:
    where, split = _what(spec), {"fraction": spec.fraction}
    if info.is_bytes:
        if fmt.read_bytes is not None:  # the stdlib (its held-out files last), a text file or folder
            data = fmt.read_bytes(spec, seq_len)
            ends = None if spec.path is None else file_ends(spec.path, len(data))
            return Corpus.of_bytes(data, where, ends=ends, **split)
        data, ends = text.pieces_as_bytes(text_pieces(spec, fmt.name), where)
        return Corpus.of_bytes(data, where, ends=ends, **split)
    tokenizer = text.load_tokenizer(spec.tokenizer)
    pieces, held = fmt.pieces(spec, True)
    ids, ends = text.encode_all(tokenizer, pieces, info.vocab_size, progress, fmt.size(spec))
    if len(ids) == 0:
        raise UserError(f"{where} holds no text")
    held = None if held is None else text.encode_all(tokenizer, held, info.vocab_size)[0]
    return _of_ids(ids, held, info, spec, ends, tokenizer=spec.tokenizer)


def _of_ids(train, val, info: DataInfo, spec: DataSpec, ends, tokenizer: str | None) -> Corpus:
    """A ``Corpus`` of ids, ``val`` held out (None: held out of ``train``, by the documents
    that end at ``ends`` where they are known)."""
    facts = dict(tokenizer=tokenizer, mask_id=info.mask_id)
    if val is None or spec.fraction == 0:
        return Corpus.from_tokens(train, info.vocab_size, _what(spec), ends=ends,
                                  fraction=spec.fraction, **facts)
    return Corpus(train, val, info.vocab_size, _what(spec), **facts)


def text_pieces(spec: DataSpec, fmt: str, check_size: bool = True):
    """All the pieces of a text format's source, the held-out ones last."""
    train, held = FORMATS[fmt].pieces(spec, check_size)
    return train if held is None else itertools.chain(train, held)


def ids_in_memory(info: DataInfo) -> bool:
    """Whether ``open_data`` makes the ids in memory: text through a tokenizer, a datasets
    folder's column (not bytes, which are the text itself, nor token files, mapped)."""
    return not info.is_bytes and not FORMATS[info.format].mapped


def to_token_file(corpus: Corpus, path: str | os.PathLike) -> Corpus:
    """The corpus over its ids written to ``path`` (read-only; training ids, then held-out
    ids): the processes that read it share its pages instead of each making the ids. A
    ``Mixture``: each part to ``path.K``."""
    if isinstance(corpus, Mixture):
        return Mixture(tuple(to_token_file(part, f"{path}.{k}") for k, part in enumerate(corpus.parts)),
                       corpus.weights)
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

