"""Sample text from a trained checkpoint in one process (``chimera generate``).

A checkpoint is keyed by parameter name (``chimera.train.checkpoint``), so whatever D, W or
schedule trained it, one process rebuilds the single-device model from ``meta.json`` and
loads it. Three pieces can be swapped independently:

- the model source, :func:`build_model_from_meta`: the run's ``chimera.train.sources``
  source, rebuilt from the config ``meta.json`` records (a chimera preset, or a Hugging Face
  model: its config; ``chimera.hf`` layers, the ones the run trained);
- the codec that turns text into token ids and back, :func:`codec_for`: bytes by default, a
  HF ``tokenizers`` file when the run recorded one in ``meta.json`` (``data.tokenizer``:
  ``{"path", "sha256"}``) or when ``--tokenizer`` names one;
- the sampler, :func:`sample`: greedy at temperature 0, otherwise softmax(logits / T) over
  the top k, drawn from a generator seeded by ``seed`` (float64 on the CPU, so a seed gives
  the same text on any device).

The model sees at most its context (``seq_len``) tokens: a longer prompt keeps its last
``seq_len`` tokens, and each new token is predicted from the last ``seq_len`` before it
(no key/value cache: every token costs one forward of the window).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from chimera.errors import UserError
from chimera.train import checkpoint
from chimera.train.checkpoint import CheckpointError

BYTE_VOCAB = 256


# -- text <-> token ids --------------------------------------------------------------------
class ByteCodec:
    """UTF-8 bytes as tokens (what ``chimera train`` trains on without a tokenizer)."""

    name = "bytes"
    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")  # a cut character shows as U+FFFD


class TokenizerCodec:
    """A Hugging Face ``tokenizers`` file (``tokenizer.json``); no special tokens are added."""

    def __init__(self, path: str | os.PathLike):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise UserError("a tokenizer file needs the `tokenizers` package "
                             "(pip install tokenizers)") from None
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 -- its errors are plain Exceptions
            raise UserError(f"tokenizer {path}: not a tokenizers file ({str(exc).splitlines()[0]})") from None
        self.name = str(path)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def codec_for(meta: dict, where: Path, override: str | None = None):
    """The codec of a run: ``override`` (a tokenizer file), else the tokenizer ``meta.json``
    records (which must still be the file the run used), else bytes."""
    if override is not None:
        if not os.path.isfile(override):
            raise UserError(f"--tokenizer {override}: no such file")
        return TokenizerCodec(override)
    record = (meta.get("data") or {}).get("tokenizer")
    if not record:
        return ByteCodec()
    path = record.get("path") if isinstance(record, dict) else None
    if not isinstance(path, str) or not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {where} was trained with the tokenizer {path!r}, which "
                              "is gone: pass --tokenizer FILE")
    if record.get("sha256") and checkpoint.sha256_of(Path(path)) != record["sha256"]:
        raise CheckpointError(f"checkpoint {where}: the tokenizer {path} changed since the run "
                              "(its SHA-256 differs); pass --tokenizer FILE to use it anyway")
    return TokenizerCodec(path)


# -- the model -----------------------------------------------------------------------------
@dataclass
class Loaded:
    """A checkpoint's model in one process, ready to predict the next token."""

    model: nn.Module  # (B, T) token ids -> (B, T, V) logits
    context: int      # the longest sequence it takes
    vocab_size: int
    meta: dict
    path: Path


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint folder (``step-<n>``, with ``meta.json``), or the newest one in a run's
    ``--checkpoint-dir``. Raises CheckpointError naming what is missing."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"--checkpoint {path}: no such directory")
    if not p.is_dir():
        raise CheckpointError(f"--checkpoint {path}: not a directory (give a run's "
                              "--checkpoint-dir or one of its step-<n> folders)")
    if (p / checkpoint.META).exists():
        return p
    newest, passed = checkpoint.resumable(p)  # those in doubt passed over, as --resume does
    if newest is None and passed:
        raise CheckpointError(f"--checkpoint {path}: every checkpoint in it is in doubt (newest "
                              f"{passed[0][0].name}: {passed[0][1]}); give a step-<n> folder")
    if newest is None:
        raise CheckpointError(f"--checkpoint {path}: no checkpoint in it (no step-<n> folder "
                              f"and no {checkpoint.META})")
    return newest


def source_from_meta(meta: dict, where: Path):
    """The ``chimera.train.sources`` source of the run ``meta`` describes (CheckpointError)."""
    from chimera.train.sources import source_from_fingerprint

    try:
        return source_from_fingerprint(meta.get("model"), meta.get("model_config"))
    except ImportError as exc:  # an HF model without the hf extra
        raise CheckpointError(f"checkpoint {where} is {meta.get('model')}: {exc}") from None
    except UserError as exc:
        raise CheckpointError(f"checkpoint {where}: {str(exc).splitlines()[0]}") from None


def build_model_from_meta(meta: dict, where: Path) -> tuple[nn.Module, int, int, object]:
    """(model with untrained weights, context, vocabulary, source) for the run ``meta``
    describes. The one place that knows model sources: each rebuilds from ``meta``'s config."""
    source = source_from_meta(meta, where)
    if source.kind == "bert":
        raise CheckpointError(f"checkpoint {where} is {meta.get('model')}, a BERT masked-LM: it "
                              "predicts masked tokens from both sides and cannot continue a "
                              "prompt left to right; chimera generate needs a causal model "
                              "(GPT-2, Llama)")
    return source.whole(seed=0), source.seq_len, source.vocab_size, source


def load_named(model: nn.Module, source, state: dict[str, torch.Tensor], where: Path) -> None:
    """Copy a checkpoint's parameters (by key, ``source.key``) into ``model``, every one."""
    own = {source.key(n): p for n, p in model.named_parameters()}
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {where} does not fit its model {source.name}: missing "
                              f"{missing[:4]}, unexpected {unexpected[:4]}")
    with torch.no_grad():
        for key, p in own.items():
            if p.shape != state[key].shape:
                raise CheckpointError(f"checkpoint {where} does not fit its model {source.name}: "
                                      f"{key} has shape {tuple(state[key].shape)}, the model's "
                                      f"is {tuple(p.shape)}")
            p.copy_(state[key])


def load(path: str | os.PathLike, device: torch.device | str = "cpu") -> Loaded:
    """Verify the checkpoint (sizes and SHA-256 of its files, its index), rebuild its model
    and load the weights, in the dtype they were trained in. Raises CheckpointError."""
    where = resolve(path)
    meta = checkpoint.verify(where)
    model, context, vocab, source = build_model_from_meta(meta, where)
    try:
        state = checkpoint.load_model_state(where)
    except checkpoint.CheckpointIOError as exc:
        raise CheckpointError(str(exc)) from None
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) != 1:
        raise CheckpointError(f"checkpoint {where}: parameters in several dtypes {sorted(map(str, dtypes))}")
    model = model.to(dtypes.pop())
    load_named(model, source, state, where)
    return Loaded(model.to(device).eval(), context, vocab, meta, where)


# -- sampling ------------------------------------------------------------------------------
def pick(logits: torch.Tensor, temperature: float, top_k: int | None,
         gen: torch.Generator) -> int:
    """The next token from the logits (V,): argmax at temperature 0 (the first of equal
    maxima), else a draw from softmax(logits / temperature) over the ``top_k`` largest."""
    if temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.double() / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen))


@torch.no_grad()
def sample(loaded: Loaded, prompt: list[int], max_new_tokens: int, temperature: float = 0.0,
           top_k: int | None = None, seed: int = 0, allowed: int | None = None) -> list[int]:
    """``max_new_tokens`` token ids continuing ``prompt`` (each predicted from the last
    ``context`` tokens); only ids below ``allowed`` (default: the vocabulary) are drawn."""
    check_sampling(temperature, top_k)
    gen = torch.Generator().manual_seed(seed)
    device = next(loaded.model.parameters()).device
    allowed = loaded.vocab_size if allowed is None else allowed
    ids = list(prompt)
    for _ in range(max_new_tokens):
        window = torch.tensor([ids[-loaded.context:]], dtype=torch.long, device=device)  # (1, T)
        logits = loaded.model(window)[0, -1, :allowed].double().cpu()                      # (V,)
        ids.append(pick(logits, temperature, top_k, gen))
    return ids[len(prompt):]


def check_sampling(temperature: float, top_k: int | None) -> None:
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise UserError(f"--temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise UserError(f"--top-k must be a positive integer, got {top_k!r}")


# -- prompt in, text out -------------------------------------------------------------------
@dataclass
class Generation:
    text: str                  # the prompt (whole) and the continuation, decoded together
    completion: str            # the continuation alone
    prompt_ids: list[int]
    new_ids: list[int]
    cropped: int               # prompt tokens the model did not see (beyond its context)
    checkpoint: str
    step: int
    codec: str
    notes: list[str] = field(default_factory=list)


def generate(path: str | os.PathLike, prompt: str, max_new_tokens: int = 200,
             temperature: float = 0.8, top_k: int | None = None, seed: int = 0,
             device: str = "cpu", tokenizer: str | None = None) -> Generation:
    """Load the checkpoint at ``path`` and continue ``prompt``. Raises ValueError
    (CheckpointError included) with one line for every input it refuses."""
    check_sampling(temperature, top_k)
    if not prompt:
        raise UserError("--prompt is empty: give the text to continue")
    loaded = load(path, device)
    codec = codec_for(loaded.meta, loaded.path, tokenizer)
    allowed = _check_codec(codec, loaded)
    ids = codec.encode(prompt)
    if not ids:
        raise UserError(f"--prompt {prompt!r} encodes to no tokens with {codec.name}")
    if max(ids) >= loaded.vocab_size:
        raise UserError(f"the prompt holds token id {max(ids)}, outside the model's vocabulary "
                         f"of {loaded.vocab_size}")
    cropped = max(0, len(ids) - loaded.context)
    notes = [f"the prompt is {len(ids)} tokens, the model's context {loaded.context}: it sees "
             f"the last {loaded.context} (cropped {cropped} from the left)"] if cropped else []
    new = sample(loaded, ids[cropped:], max_new_tokens, temperature, top_k, seed, allowed)
    return Generation(codec.decode(ids + new), codec.decode(new), ids, new, cropped,
                      str(loaded.path), int(loaded.meta["step"]), codec.name, notes)


def _check_codec(codec, loaded: Loaded) -> int:
    """The ids the sampler may draw: those both the model and the codec know."""
    if isinstance(codec, ByteCodec) and loaded.vocab_size != BYTE_VOCAB:
        raise UserError(f"checkpoint {loaded.path}: the model has a vocabulary of "
                         f"{loaded.vocab_size} tokens, not {BYTE_VOCAB} bytes, and the run recorded "
                         "no tokenizer: pass --tokenizer FILE")
    if codec.vocab_size > loaded.vocab_size:
        raise UserError(f"the tokenizer {codec.name} has {codec.vocab_size} tokens, more than "
                         f"the model's vocabulary of {loaded.vocab_size}: not the run's tokenizer")
    return codec.vocab_size
