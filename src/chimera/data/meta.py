"""The ``meta.json`` that ``chimera tokenize`` writes beside its token files (dtype,
vocabulary, tokenizer, its mask id), read back for the formats whose ids it may describe
(``chimera.data.formats.Format.meta_of``)."""

from __future__ import annotations

import json
from pathlib import Path

from chimera.data import text
from chimera.data.tokens import TOKEN_DTYPES
from chimera.errors import UserError

MAX_VOCAB = 2**24               # an embedding row per id: beyond this is a typo, not a model
META, META_FORMAT = "meta.json", "chimera-tokens"


def read_meta(path: str | None, meta_of) -> dict | None:
    """The ``meta.json`` of ``chimera tokenize`` that covers this token file or folder
    (``meta_of``: the folder and file name a format's ids are in; None: none covers it)."""
    if meta_of is None:
        return None
    folder, name = meta_of(Path(path))
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


def meta_mask(meta: dict) -> int | None:
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


def token_dtype(spec, meta: dict | None) -> str:
    """The dtype of ``.bin`` ids: ``--token-dtype``, else their ``meta.json``'s."""
    dtype = spec.token_dtype or (meta or {}).get("dtype")
    if dtype is None:
        raise UserError(f"{spec.path} holds raw token ids of no stated width: give --token-dtype "
                         "uint16 or uint32 (nanoGPT writes uint16)")
    if meta is not None and spec.token_dtype not in (None, meta["dtype"]):
        raise UserError(f"--token-dtype {spec.token_dtype} contradicts {meta['path']} "
                         f"(dtype {meta['dtype']})")
    return dtype
