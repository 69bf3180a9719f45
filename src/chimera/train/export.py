"""``chimera export``: a checkpoint as a Hugging Face ``save_pretrained`` folder.

The checkpoint holds every parameter once under its model-wide name (HF's for an HF model, a
tie under its source), whatever D, W or schedule wrote it, so one process reads it.
``HFModel.save_pretrained`` checks it is the whole model and writes ``config.json`` (the
run's config, vocabulary included) and ``model.safetensors``; a GPT-2 preset goes through
``chimera.hf.preset`` (HF's ``GPT2LMHeadModel``). ``AutoModelForCausalLM.from_pretrained(folder)``
gives the run's logits. The run's tokenizer (the byte tokenizer for a run on bytes) goes
beside them with the files ``AutoTokenizer`` reads (``chimera.train.export_tokenizer``), its
end-of-text id in ``config.json`` and ``generation_config.json`` (with a note where BERT
masked with an id that is not its mask token). Every file is an ordinary one (0644 under
the usual umask). The folder appears complete or not at all. A run with LoRA adapters is
exported merged, as its base weights, or as the adapter folder ``peft`` loads
(``chimera.train.export_lora``).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from chimera.data.text import load_tokenizer, mask_id_of
from chimera.errors import UserError
from chimera.train import checkpoint
from chimera.train.checkpoint import CheckpointError
from chimera.train.export_lora import prepare, write_adapter
from chimera.train.export_tokenizer import stamp_ids, write_tokenizer
from chimera.train.checkpoint.serve import choose
from chimera.train.generate import source_from_meta


@dataclass
class Exported:
    folder: Path
    checkpoint: Path
    step: int
    model: str
    files: list[str]
    notes: list[str]


def export(path: str | os.PathLike, out: str | os.PathLike,
           allow_in_doubt: bool = False, merge_lora: bool = True,
           adapter_only: bool = False) -> Exported:
    """Write the model of the checkpoint at ``path`` to the folder ``out`` (which must not
    exist or be empty). Raises ValueError (CheckpointError included) with one line; a
    checkpoint in doubt or not judged yet only with ``allow_in_doubt`` (``serve.choose``).
    With LoRA adapters: merged into their weights (``merge_lora``), or left out (the base
    model), or, with ``adapter_only``, the adapters alone as ``peft`` writes them."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out}: exists and is not an empty folder")
    where, served = choose(path, allow_in_doubt)
    meta = checkpoint.verify(where)
    source = source_from_meta(meta, where)
    if not hasattr(source, "export"):
        _check_preset(source, where)
    try:
        state = checkpoint.load_model_state(where)
    except checkpoint.CheckpointIOError as exc:
        raise CheckpointError(str(exc)) from None
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    lora = (meta.get("run") or {}).get("lora")
    try:
        if adapter_only:
            write_adapter(source, state, lora, tmp)
            notes = []
        else:
            notes = _write(source, prepare(source, state, lora, merge_lora), meta, where, tmp)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Exported(out, where, int(meta["step"]), meta["model"],
                    sorted(p.name for p in out.iterdir()), served + notes)


def _check_preset(source, where: Path) -> None:
    try:
        from chimera.hf.preset import gpt2_config  # optional extra (hf): transformers

        gpt2_config(source.config)
    except (ImportError, UserError) as exc:  # the hf extra is missing; a BERT preset
        raise CheckpointError(f"checkpoint {where} is {source.name}: {exc}") from None


def _write(source, state: dict, meta: dict, where: Path, tmp: Path) -> list[str]:
    """Weights, config and tokenizer files into ``tmp``; the notes for the user."""
    if hasattr(source, "export"):
        source.export(state, tmp)
    else:
        from chimera.hf.preset import export_preset  # optional extra (hf): transformers

        export_preset(source.config, state, tmp)
    ids, notes = write_tokenizer(meta, where, tmp, source.vocab_size, source.seq_len, source.kind == "gpt2")
    stamp_ids(tmp, ids)
    if (tmp / "tokenizer.json").is_file():
        notes += _mask_note(meta, str(tmp / "tokenizer.json"))
    _ordinary_modes(tmp)
    return notes


def _ordinary_modes(folder: Path) -> None:
    """Every file 0666 less the umask (0644 usually): safetensors writes its file 0600."""
    umask = os.umask(0)
    os.umask(umask)
    for p in folder.iterdir():
        os.chmod(p, 0o666 & ~umask)


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
