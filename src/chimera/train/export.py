"""``chimera export``: a checkpoint of a Hugging Face model as a ``save_pretrained`` folder.

The checkpoint holds every parameter once under HF's name (a tie under its source), whatever
D, W or schedule wrote it, so one process reads it, and ``HFModel.save_pretrained`` checks it
is the whole model and writes ``config.json`` (the run's config, vocabulary included) and
``model.safetensors``: ``AutoModelForCausalLM.from_pretrained(folder)`` gives the run's logits.
The run's tokenizer (``tokenizer.json``), if it recorded one that is still the same file,
goes beside them (with a note where BERT masked with an id that is not its mask token).
The folder appears complete or not at all.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from chimera.data_text import load_tokenizer, mask_id_of
from chimera.errors import UserError
from chimera.train import checkpoint
from chimera.train.checkpoint import CheckpointError
from chimera.train.generate import resolve, source_from_meta


@dataclass
class Exported:
    folder: Path
    checkpoint: Path
    step: int
    model: str
    files: list[str]
    notes: list[str]


def export(path: str | os.PathLike, out: str | os.PathLike) -> Exported:
    """Write the model of the checkpoint at ``path`` to the folder ``out`` (which must not
    exist or be empty). Raises ValueError (CheckpointError included) with one line."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out}: exists and is not an empty folder")
    where = resolve(path)
    meta = checkpoint.verify(where)
    source = source_from_meta(meta, where)
    if not hasattr(source, "export"):
        raise CheckpointError(f"checkpoint {where} is {meta['model']}, a chimera preset, not a "
                              "Hugging Face model: chimera export writes Hugging Face folders (train "
                              "with --model hf-llama-tiny, hf-gpt2-small or hf:PATH)")
    try:
        state = checkpoint.load_model_state(where)
    except checkpoint.CheckpointIOError as exc:
        raise CheckpointError(str(exc)) from None
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        source.export(state, tmp)
        notes = _copy_tokenizer(meta, tmp)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Exported(out, where, int(meta["step"]), meta["model"],
                    sorted(p.name for p in out.iterdir()), notes)


def _copy_tokenizer(meta: dict, folder: Path) -> list[str]:
    """The run's tokenizer file beside the weights; a note instead where it is gone or changed."""
    record = (meta.get("data") or {}).get("tokenizer")
    path = record.get("path") if isinstance(record, dict) else None
    if not path:
        return []
    if not os.path.isfile(path) or checkpoint.sha256_of(Path(path)) != record.get("sha256"):
        return [f"the run's tokenizer {path} is gone or changed since the run: not copied"]
    shutil.copyfile(path, folder / "tokenizer.json")
    return _mask_note(meta, path)


def _mask_note(meta: dict, tokenizer: str) -> list[str]:
    """A BERT run masks with the tokenizer's mask token, or one appended after its ids:
    then the copied tokenizer lacks it, which a fill-mask user must know."""
    trained = (meta.get("data") or {}).get("mask_id")
    if trained is None:  # a causal model, or a checkpoint from before mask ids were recorded
        return []
    own = mask_id_of(load_tokenizer(tokenizer))
    if own == trained:
        return []
    has = "no mask token" if own is None else f"its mask token at id {own}"
    return [f"BERT was trained with mask id {trained}, tokenizer.json has {has}: add a mask "
            f"token at id {trained} to use them together"]
