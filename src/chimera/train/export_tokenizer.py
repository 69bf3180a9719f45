"""The tokenizer files of an exported folder, so that ``AutoTokenizer`` gives the run's ids.

``tokenizer.json`` alone makes transformers fall back to the architecture's defaults (GPT-2's
adds ``<|endoftext|>`` at id = vocabulary size, outside the model). So beside it go
``tokenizer_config.json`` (the tokenizer class that reads ``tokenizer.json`` as it is, the
context length, the special tokens by name) and ``special_tokens_map.json``; the
end-of-text id also goes into ``config.json`` (``eos_token_id``, ``bos_token_id``: GPT-2's
convention, one token for both) and ``generation_config.json``, so HF ``generate`` stops at it.

A run on UTF-8 bytes gets a byte tokenizer: id b is byte b, and ``<|endoftext|>`` is id 255
(0xFF, which UTF-8 never holds, so no text encodes to it; the model never saw it, so it does
not end text by itself, but a batch pads with it as with any eos).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from chimera.data.text import EOS_TOKENS, eos_id_of, load_tokenizer
from chimera.train import checkpoint
from chimera.train.checkpoint import CheckpointError

BYTE_VOCAB = 256
BYTE_EOS = "<|endoftext|>"
# transformers' attribute -> the token names it may be (BERT's and Llama's spellings)
_NAMED = {"unk_token": ("[UNK]", "<unk>"), "pad_token": ("[PAD]", "<pad>"),
          "cls_token": ("[CLS]",), "sep_token": ("[SEP]",), "mask_token": ("[MASK]", "<mask>")}


def byte_tokenizer():
    """Id b is byte b (GPT-2's byte-to-character map, no merges); ``<|endoftext|>`` is 255."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers  # optional extra (hf)

    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(BYTE_VOCAB - 1)}  # 0xFF: the end-of-text token
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(BYTE_EOS, special=True)])
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable character for each byte (what ``ByteLevel`` maps bytes to)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_tokenizer(meta: dict, source: Path, folder: Path, vocab: int, context: int,
                    causal: bool = True) -> tuple[dict[str, int], list[str]]:
    """The run's tokenizer (the copy in the checkpoint folder ``source``; CheckpointError when
    it cannot be read) or the byte tokenizer, and its config, into ``folder``: (the
    ids of its ``eos`` and ``bos`` tokens where it has them, notes for the user: a causal
    model's tokenizer without an end-of-text token)."""
    path, missing = checkpoint.tokenizer_path(meta, source)
    if missing is not None:  # an export without the tokenizer its ids need is no export
        raise CheckpointError(f"checkpoint {source}: {missing}: no tokenizer to export")
    if path is not None:
        shutil.copyfile(path, folder / "tokenizer.json")
        tokenizer = load_tokenizer(path)
    elif vocab == BYTE_VOCAB:
        tokenizer = byte_tokenizer()
        tokenizer.save(str(folder / "tokenizer.json"))
    else:
        return {}, ["the run recorded no tokenizer (bare token ids): no tokenizer written"]
    specials = _special_tokens(tokenizer)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context,
              "clean_up_tokenization_spaces": False, **specials}
    _write_json(folder / "tokenizer_config.json", config)
    _write_json(folder / "special_tokens_map.json", specials)
    ids = {k[:-len("_token")]: tokenizer.token_to_id(specials[k])
           for k in ("eos_token", "bos_token") if k in specials}
    if "eos" in ids or not causal:
        return ids, []
    return ids, [f"the tokenizer has no end-of-text token ({', '.join(EOS_TOKENS)}): HF "
                 "generate stops at max_new_tokens only"]


def _special_tokens(tokenizer) -> dict[str, str]:
    """transformers' special-token attributes -> the tokenizer's tokens: the end-of-text
    token is eos, and bos too unless there is a ``<s>`` (GPT-2's convention: one for both)."""
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    out = {}
    eos = eos_id_of(tokenizer)
    if eos is not None:
        out["eos_token"] = out["bos_token"] = tokenizer.id_to_token(eos)
    if "<s>" in special:
        out["bos_token"] = "<s>"
    for attr, names in _NAMED.items():
        name = next((n for n in names if n in special), None)
        if name is not None:
            out[attr] = name
    return out


def stamp_ids(folder: Path, ids: dict[str, int]) -> None:
    """``eos_token_id`` and ``bos_token_id`` into ``config.json`` and ``generation_config.json``
    (whose ``pad_token_id`` is the eos too: the usual choice for a model with no pad token)."""
    if "eos" not in ids:
        return
    from transformers import GenerationConfig  # start-up time: transformers loads when exporting

    eos, bos = ids["eos"], ids.get("bos", ids["eos"])
    config = json.loads((folder / "config.json").read_text())
    config.update(eos_token_id=eos, bos_token_id=bos)
    _write_json(folder / "config.json", config)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos).save_pretrained(str(folder))


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
