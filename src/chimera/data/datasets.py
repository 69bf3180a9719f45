"""``datasets`` folders written by ``save_to_disk``: the arrow streams ``state.json`` lists,
read with pyarrow (``datasets`` itself is not needed to read them)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from chimera.data import MAX_CORPUS_BYTES, check_corpus_path
from chimera.data.text import doc_pieces
from chimera.data.tokens import check_ids, id_dtype
from chimera.errors import UserError


def is_datasets_folder(p: Path) -> bool:
    return (p / "state.json").is_file() and (p / "dataset_info.json").is_file()


def _table(folder: Path):
    try:
        import pyarrow as pa  # optional extra (hf): pyarrow, with datasets
    except ImportError:
        raise UserError(f"--data {folder} is a datasets folder: reading it needs pyarrow "
                         "(pip install 'chimera-pipeline[hf]')") from None
    try:
        names = [f["filename"] for f in json.loads((folder / "state.json").read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{folder / 'state.json'} is not a datasets state file") from None
    files = [folder / n for n in names]
    total = sum(f.stat().st_size for f in files if f.is_file())
    if total > MAX_CORPUS_BYTES:
        raise UserError(f"--data {folder} has {total:,} bytes of arrow data, more than the limit "
                         f"of {MAX_CORPUS_BYTES:,} (it is read into memory): write .bin token files")
    tables = []
    for f in files:
        check_corpus_path(f)
        try:
            tables.append(pa.ipc.open_stream(pa.memory_map(str(f))).read_all())
        except (pa.ArrowInvalid, OSError) as exc:  # OSError: a truncated file
            raise UserError(f"{f} is not a whole arrow stream ({str(exc).splitlines()[0]}): "
                            "save the dataset again") from None
    return pa.concat_tables(tables) if tables else None


def pick_column(spec) -> str:
    """``--text-field`` if given, else ``input_ids`` if present, else ``text``."""
    table = _table(Path(spec.path))
    columns = table.column_names if table is not None else []
    want = spec.text_field or ("input_ids" if "input_ids" in columns else "text")
    if want not in columns:
        raise UserError(f"--data {spec.path} has columns {', '.join(columns) or '(none)'}: no "
                         f"{want!r} column (give input_ids, or choose a text column with --text-field)")
    return want


def token_ids(spec, column: str, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The ids of an ``input_ids`` column (lists of integers), rows concatenated, checked; and
    where each row (a document) ends in them."""
    import pyarrow as pa  # optional extra (hf)
    import pyarrow.compute as pc

    col = _table(Path(spec.path)).column(column)
    t = col.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)) \
            or not pa.types.is_integer(t.value_type):
        raise UserError(f"--data {spec.path}: column {column!r} holds {t}, not lists of "
                         "integer token ids")
    parts = [pc.list_flatten(chunk) for chunk in col.chunks]
    if col.null_count or any(part.null_count for part in parts):
        raise UserError(f"--data {spec.path}: column {column!r} has missing values")
    ids = np.concatenate([part.to_numpy() for part in parts] or [np.zeros(0, np.int64)])
    if ids.size == 0:
        raise UserError(f"--data {spec.path}: column {column!r} holds no token ids")
    check_ids(ids, vocab, spec.path)
    lengths = np.concatenate([pc.list_value_length(chunk).to_numpy(zero_copy_only=False)
                              for chunk in col.chunks])
    ends = np.cumsum(lengths, dtype=np.int64)
    return ids.astype(id_dtype(vocab)), ends[lengths > 0]


def text_pieces(spec, check_size: bool = True):
    """The pieces of the text column ``spec.field``, each row a document (the held-out
    split: the last ids, None). Its size is checked as it is read (``_table``)."""
    return doc_pieces(text_rows(spec, spec.field)), None


def text_rows(spec, column: str):
    """The rows of a datasets folder's text column."""
    import pyarrow as pa  # optional extra (hf)

    col = _table(Path(spec.path)).column(column)
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        raise UserError(f"--data {spec.path}: column {column!r} holds {col.type}, not text")
    if col.null_count:
        raise UserError(f"--data {spec.path}: column {column!r} has missing values")
    for chunk in col.chunks:
        yield from chunk.to_pylist()
