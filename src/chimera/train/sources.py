"""Model sources: what the trainer needs from a model, whoever builds it.

A source says what the batches look like (``kind``: next-token or masked; ``seq_len``;
``vocab_size``, the ids they hold), builds layer ``i`` of the flat list ``[embedding,
blocks..., head]`` (the same weights for a seed, whichever other layers a rank builds),
scores the last layer's output (``loss_fn``: a mean, or a sum over target tokens with
``sums``), names every parameter as checkpoints key it, and lists weights tied across
layers. Layers are named by their model-wide index inside a stage (``Stage``): ``"3.attn.
qkv.weight"`` is parameter ``attn.qkv.weight`` of layer 3. Two kinds:

- :class:`PresetSource`: chimera's GPT-2 and BERT presets (``chimera.models``), untied,
  keyed ``blocks.2.attn.qkv.weight``;
- ``chimera.hf.source.HFSource``: a Hugging Face model (``hf:PATH``, ``hf-llama-tiny``,
  ``hf-gpt2-small``), with HF's ties, keyed by HF's names (``transformer.h.2.attn...``).

:func:`open_source` picks one from ``--model``; :func:`source_from_fingerprint` rebuilds
the one a checkpoint's ``meta.json`` describes (``chimera generate``, ``chimera export``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from chimera.byo import retie
from chimera.data import IGNORE_INDEX, model_vocab
from chimera.runtime.boundary import Stage
from chimera.runtime.shared import Tie

HF_PREFIX = "hf:"
# name -> (architecture, config fields over HF's defaults, training sequence length); the
# vocabulary is the data's (as chimera's presets), special token ids are the tokenizer's
HF_PRESETS = {
    "hf-llama-tiny": ("LlamaForCausalLM",  # RoPE, GQA (4 query heads, 2 key/value), untied
                      dict(hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=256), 64),
    "hf-gpt2-small": ("GPT2LMHeadModel", {}, 1024),  # GPT2Config(): 12 x 768, tied, 124M at 50257
}


class ModelSource:
    """What ``Trainer`` builds and scores; subclasses set the fields and the methods."""

    name: str          # what --model said
    kind: str          # "gpt2": targets are the next tokens; "bert": masked tokens
    seq_len: int       # tokens per sequence
    vocab_size: int    # the ids batches hold (BERT: with the mask id, the last)
    num_layers: int
    sums: bool = False  # loss_fn sums over target tokens (divided by their count), else a mean
    ties: tuple[tuple[str, ...], ...] = ()  # names of one weight in several layers, first: its name

    def layer_costs(self) -> list[float]:
        raise NotImplementedError

    def build_layer(self, index: int, seed: int) -> nn.Module:
        raise NotImplementedError

    def loss_fn(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def global_name(self, name: str) -> str:
        """``"3.attn.qkv.weight"`` -> the name the model itself gives it."""
        raise NotImplementedError

    def fingerprint(self) -> dict:
        """The whole config, JSON: ``meta.json``'s ``model_config``."""
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------
    def key(self, name: str) -> str:
        """The checkpoint key of a parameter: every copy of a tie under its first name, so a
        checkpoint holds it once and any layout reads it back."""
        return self.global_name(self._tie_first.get(name, name))

    @property
    def _tie_first(self) -> dict[str, str]:
        return {n: names[0] for names in self.ties for n in names[1:]}

    def token_count(self, targets: torch.Tensor) -> int:
        """Target tokens a summed loss covers (``sums``)."""
        return int((targets != IGNORE_INDEX).sum())

    def tie_stages(self, ranges: Sequence[range]) -> list[Tie]:
        """The ties with the stage of each name (``ranges``: the layers of each stage)."""
        stage_of = {i: k for k, r in enumerate(ranges) for i in r}
        return [Tie(names, tuple(stage_of[int(n.split(".", 1)[0])] for n in names))
                for names in self.ties]

    def stage(self, indices: range, seed: int, ties: Sequence[Tie] = ()) -> Stage:
        """The layers ``indices``, named by model-wide index; a tie inside is one Parameter."""
        stage = Stage({i: self.build_layer(i, seed) for i in indices})
        retie(stage, list(ties))
        return stage

    def whole(self, seed: int) -> Stage:
        """Every layer in one process (the reference, generate): ties are one Parameter."""
        everything = range(self.num_layers)
        return self.stage(everything, seed, self.tie_stages([everything]))


class PresetSource(ModelSource):
    """A chimera preset (``gpt2-tiny``, ``bert-48``...), its vocabulary the data's."""

    def __init__(self, name: str, config):
        from chimera.models import loss_fn

        self.name, self.config = name, config
        self.kind, self.seq_len, self.vocab_size = config.kind, config.seq_len, config.vocab_size
        self.num_layers = config.n_layers_total
        self.sums = config.kind == "bert"  # masked tokens differ per micro-batch: sum / count
        self._loss = loss_fn(config, "sum" if self.sums else "mean")

    def layer_costs(self) -> list[float]:
        from chimera.models import layer_costs

        return layer_costs(self.config)

    def build_layer(self, index: int, seed: int) -> nn.Module:
        from chimera.models import build_layers

        return build_layers(self.config, seed, [index])[0]

    def loss_fn(self, output, targets):
        return self._loss(output, targets)

    def global_name(self, name: str) -> str:
        from chimera.models import layer_names

        index, rest = name.split(".", 1)
        return f"{layer_names(self.config)[int(index)]}.{rest}"

    def fingerprint(self) -> dict:
        from chimera.train.checkpoint import model_fingerprint

        return model_fingerprint(self.config)


def is_hf(model: str) -> bool:
    return model.startswith(HF_PREFIX) or model in HF_PRESETS


def open_source(model: str, data_info, seq_len: int | None = None,
                dtype: torch.dtype = torch.float32) -> ModelSource:
    """The source ``--model`` names, sized to the data (``DataInfo``); ValueError (one line)
    for an unknown name or a model that cannot take the data."""
    if is_hf(model):
        from chimera.hf.source import HFSource  # ImportError without the hf extra

        return HFSource.open(model, data_info, seq_len, dtype)
    from chimera.models import PRESETS, get_config

    if model not in PRESETS:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(sorted(PRESETS))}, "
                         f"{', '.join(HF_PRESETS)}, or {HF_PREFIX}PATH (a Hugging Face config.json "
                         "or save_pretrained folder)")
    size = {"vocab_size": model_vocab(data_info, PRESETS[model].kind)}
    if seq_len is not None:
        size["seq_len"] = seq_len
    return PresetSource(model, get_config(model, **size))


def source_from_fingerprint(model: str, fingerprint: dict,
                            dtype: torch.dtype = torch.float32) -> ModelSource:
    """The source a checkpoint was written by (``meta.json``: ``model``, ``model_config``);
    ValueError when it does not describe a model this version builds."""
    if isinstance(fingerprint, dict) and fingerprint.get("source") == "hf":
        from chimera.hf.source import HFSource

        return HFSource.from_fingerprint(model, fingerprint, dtype)
    from chimera.models import ModelConfig

    try:
        return PresetSource(model, ModelConfig(**fingerprint))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"its model_config ({fingerprint!r}) does not describe a model this "
                         f"version builds: {exc}") from None
