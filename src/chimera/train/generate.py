"""Sample text from a trained checkpoint in one process (``chimera generate``).

A checkpoint is keyed by parameter name (``chimera.train.checkpoint``), so whatever D, W or
schedule trained it, one process rebuilds the single-device model from ``meta.json`` and
loads it. Three pieces can be swapped independently:

- the model source, :func:`build_model_from_meta`: the run's ``chimera.train.sources``
  source, rebuilt from the config ``meta.json`` records (a chimera preset, or a Hugging Face
  model: its config; ``chimera.hf`` layers, the ones the run trained);
- the codec that turns text into token ids and back, :func:`codec_for`: bytes by default, a
  HF ``tokenizers`` file when the run recorded one (a checkpoint keeps a copy,
  ``tokenizer.json``, so a moved folder still decodes) or when ``--tokenizer`` names one;
- the sampler, :func:`pick`: greedy at temperature 0, otherwise softmax(logits / T) over
  the top k and the top p of the probability, drawn from a generator seeded by ``seed``
  (float64 on the CPU, so a seed gives the same text on any device).

:func:`sample` continues a batch of prompts (left-padded) with a key/value cache
(``chimera.train.decode``): each new token is one forward of one position per layer. The
model sees at most its context (``seq_len``) tokens: a longer prompt keeps its last
``seq_len`` tokens; once a row fills the context, each new token is predicted from the last
``seq_len`` before it (positions are absolute, so the window is run whole: one forward of
the window per token, as without a cache). A row ends at ``max_new_tokens`` or at its stop
token (the tokenizer's end-of-text token unless another is named), which is not kept.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from chimera.errors import UserError
from chimera.train import checkpoint
from chimera.train.checkpoint import CheckpointError
from chimera.train.checkpoint.serve import choose
from chimera.train.export_lora import prepare as merge_adapters

BYTE_VOCAB = 256
MAX_NEW_TOKENS = 100_000        # a bound a run prints within minutes, not a typo's 10^12
MAX_PROMPTS = 1024              # rows of one batch


# -- text <-> token ids --------------------------------------------------------------------
class ByteCodec:
    """UTF-8 bytes as tokens (what ``chimera train`` trains on without a tokenizer)."""

    name = "bytes"
    vocab_size = BYTE_VOCAB
    eos = None  # bytes have no end-of-text token

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
        from chimera.data.text import eos_id_of  # with tokenizers, imported above

        self.name = str(path)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos = eos_id_of(self.tokenizer)

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
    path, missing = checkpoint.tokenizer_path(meta, where)
    if missing is not None:
        raise CheckpointError(f"checkpoint {where}: {missing}; pass --tokenizer FILE")
    return ByteCodec() if path is None else TokenizerCodec(str(path))


# -- the model -----------------------------------------------------------------------------
@dataclass
class Loaded:
    """A checkpoint's model in one process, ready to predict the next token."""

    model: nn.Module  # (B, T) token ids -> (B, T, V) logits
    context: int      # the longest sequence it takes
    vocab_size: int
    meta: dict
    path: Path
    source: object = None  # the run's model source (chimera.train.sources)
    notes: list[str] = field(default_factory=list)  # what the user is told about the choice

    def decoder(self):
        """A key/value-cached decoder of this model (``chimera.train.decode``)."""
        from chimera.train import decode

        if not hasattr(self.source, "export"):  # chimera's GPT-2
            return decode.PresetDecoder(self.model)
        state = self.source.model.hf_state_dict(self.model.state_dict())  # HF's names, shared
        first = next(self.model.parameters())
        return decode.HFDecoder(decode.hf_model(self.source, state, first.dtype).to(first.device))


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


def load(path: str | os.PathLike, device: torch.device | str = "cpu",
         allow_in_doubt: bool = False) -> Loaded:
    """Verify the checkpoint (sizes and SHA-256 of its files, its index), rebuild its model
    and load the weights, in the dtype they were trained in (LoRA adapters merged into their
    weights). Raises CheckpointError; one in
    doubt or not judged yet only with ``allow_in_doubt`` (``checkpoint.serve.choose``)."""
    where, notes = choose(path, allow_in_doubt)
    meta = checkpoint.verify(where)
    model, context, vocab, source = build_model_from_meta(meta, where)
    try:
        state = checkpoint.load_model_state(where)
    except checkpoint.CheckpointIOError as exc:
        raise CheckpointError(str(exc)) from None
    state = merge_adapters(source, state, (meta.get("run") or {}).get("lora"), merge=True)
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) != 1:
        raise CheckpointError(f"checkpoint {where}: parameters in several dtypes {sorted(map(str, dtypes))}")
    model = model.to(dtypes.pop())
    load_named(model, source, state, where)
    return Loaded(model.to(device).eval(), context, vocab, meta, where, source, notes)


# -- sampling ------------------------------------------------------------------------------
def pick(logits: torch.Tensor, temperature: float, top_k: int | None,
         gen: torch.Generator, top_p: float | None = None) -> int:
    """The next token from the logits (V,): argmax at temperature 0 (the first of equal
    maxima), else a draw from softmax(logits / temperature) over the ``top_k`` largest and
    the fewest most likely tokens whose probability reaches ``top_p``."""
    if temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.double() / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1:
        ranked, order = probs.sort(descending=True)
        keep = ranked.cumsum(0) - ranked < top_p  # the first always: the mass before it is 0
        probs = torch.zeros_like(probs).scatter(0, order, ranked * keep)
    return int(torch.multinomial(probs, 1, generator=gen))


def left_pad(rows: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last ``width`` ids of each row, right-aligned: (ids (B, L), mask (B, L))."""
    rows = [r[-width:] for r in rows]
    length = max(map(len, rows))
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for b, r in enumerate(rows):
        ids[b, length - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[b, length - len(r):] = True
    return ids, mask


@dataclass
class Settings:
    """How to sample (``check`` refuses bad values in one line)."""

    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop: int | None = None  # a row ends when it draws this id (not kept)

    def check(self) -> "Settings":
        check_sampling(self.temperature, self.top_k, self.top_p)
        n = self.max_new_tokens
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_NEW_TOKENS:
            raise UserError(f"--max-new-tokens must be an integer from 1 to {MAX_NEW_TOKENS:,}, got {n!r}")
        return self


@torch.no_grad()
def sample(loaded: Loaded, prompts: list[list[int]], settings: Settings,
           allowed: int | None = None) -> list[list[int]]:
    """The new ids of each prompt (a row ends at ``max_new_tokens`` or its stop id), with a
    key/value cache while the rows fit the context; only ids below ``allowed`` are drawn."""
    settings.check()
    gen = torch.Generator().manual_seed(settings.seed)
    allowed = loaded.vocab_size if allowed is None else allowed
    device = next(loaded.model.parameters()).device
    decoder = loaded.decoder()
    ids, mask = left_pad(prompts, loaded.context)
    logits = decoder.prefill(ids.to(device), mask.to(device))
    new, done = [[] for _ in prompts], [False] * len(prompts)
    for count in range(1, settings.max_new_tokens + 1):
        step = [pick(row[:allowed].double().cpu(), settings.temperature, settings.top_k, gen,
                     settings.top_p) for row in logits]
        for b, token in enumerate(step):
            done[b] = done[b] or token == settings.stop
            if not done[b]:
                new[b].append(token)
        if all(done) or count == settings.max_new_tokens:
            break
        ids = torch.cat([ids, torch.tensor(step)[:, None]], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        if ids.shape[1] <= loaded.context:
            logits = decoder.step(torch.tensor(step, device=device))
        else:  # the window slides: absolute positions move, so it is run whole
            ids, mask = ids[:, -loaded.context:], mask[:, -loaded.context:]
            logits = decoder.prefill(ids.to(device), mask.to(device))
    return new


def check_sampling(temperature: float, top_k: int | None, top_p: float | None = None) -> None:
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise UserError(f"--temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise UserError(f"--top-k must be a positive integer, got {top_k!r}")
    if top_p is not None and (not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise UserError(f"--top-p must be a number in (0, 1] (1: no cut), got {top_p!r}")


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
    stopped: bool = False      # ended at the stop token, not at max_new_tokens
    timing: dict = field(default_factory=dict)  # load_s (start-up), decode_s


def generate(path: str | os.PathLike, prompt: str, max_new_tokens: int = 200,
             temperature: float = 0.8, top_k: int | None = None, seed: int = 0,
             device: str = "cpu", tokenizer: str | None = None, top_p: float | None = None,
             stop: str | None = None, allow_in_doubt: bool = False) -> Generation:
    """Load the checkpoint at ``path`` and continue ``prompt``. Raises ValueError
    (CheckpointError included) with one line for every input it refuses."""
    settings = Settings(max_new_tokens, temperature, top_k, top_p, seed)
    return generate_batch(path, [prompt], settings, device, tokenizer, stop, allow_in_doubt)[0]


def generate_batch(path: str | os.PathLike, prompts: list[str], settings: Settings,
                   device: str = "cpu", tokenizer: str | None = None,
                   stop: str | None = None, allow_in_doubt: bool = False) -> list[Generation]:
    """Continue every prompt, as one batch (``sample``). ``stop``: the text of the token that
    ends a row (default: the tokenizer's end-of-text token, if it has one). A checkpoint in
    doubt or not judged yet is refused unless ``allow_in_doubt`` (``load``)."""
    settings.check()
    _check_prompts(prompts)
    start = time.perf_counter()
    loaded = load(path, device, allow_in_doubt)
    codec = codec_for(loaded.meta, loaded.path, tokenizer)
    allowed = _check_codec(codec, loaded)
    settings.stop = _stop_id(codec, stop, allowed)
    encoded = [_encode_prompt(codec, p, loaded) for p in prompts]
    loaded_at = time.perf_counter()
    news = sample(loaded, encoded, settings, allowed)
    timing = {"load_s": loaded_at - start, "decode_s": time.perf_counter() - loaded_at}
    return [_generation(codec, loaded, ids, new, settings, timing) for ids, new in zip(encoded, news)]


def _check_prompts(prompts: list[str]) -> None:
    if not prompts or len(prompts) > MAX_PROMPTS:
        raise UserError(f"give 1 to {MAX_PROMPTS} prompts, got {len(prompts)}")
    for prompt in prompts:
        if not prompt:
            raise UserError("--prompt is empty: give the text to continue")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # argv's undecodable bytes arrive as lone surrogates
            raise UserError(f"--prompt is not valid UTF-8 (an undecodable byte at character "
                             f"{exc.start}): give UTF-8 text") from None


def _encode_prompt(codec, prompt: str, loaded: Loaded) -> list[int]:
    ids = codec.encode(prompt)
    if not ids:
        raise UserError(f"--prompt {prompt!r} encodes to no tokens with {codec.name}")
    if max(ids) >= loaded.vocab_size:
        raise UserError(f"the prompt holds token id {max(ids)}, outside the model's vocabulary "
                         f"of {loaded.vocab_size}")
    return ids


def _stop_id(codec, stop: str | None, allowed: int) -> int | None:
    """The id of ``stop`` (which must be one token), else the codec's end-of-text id."""
    if stop is None:
        return codec.eos
    ids = codec.encode(stop) if stop else []
    if len(ids) != 1 or ids[0] >= allowed:
        raise UserError(f"--stop-token {stop!r} is {len(ids)} tokens with {codec.name}, not one: "
                         "give the text of a single token (e.g. a newline)")
    return ids[0]


def _generation(codec, loaded: Loaded, ids: list[int], new: list[int], settings: Settings,
                timing: dict) -> Generation:
    cropped = max(0, len(ids) - loaded.context)
    notes = list(loaded.notes)
    if cropped:
        notes.append(f"the prompt is {len(ids)} tokens, the model's context {loaded.context}: it "
                     f"sees the last {loaded.context} (cropped {cropped} from the left)")
    return Generation(codec.decode(ids + new), codec.decode(new), ids, new, cropped,
                      str(loaded.path), int(loaded.meta["step"]), codec.name, notes,
                      len(new) < settings.max_new_tokens, timing)


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
