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

import torch
from torch import nn

from chimera.data import model_vocab
from chimera.errors import UserError
from chimera.modelcfg import flops_per_token
from chimera.models import (PRESETS, ModelConfig, build_layers, get_config, layer_costs, layer_names,
                            loss_fn)
from chimera.train.checkpoint import model_fingerprint
from chimera.models.source import HF_PREFIX, HF_PRESETS, ModelSource
from chimera.models.tp import preset_tp_plan
from chimera.tp import takes_sharded_logits

__all__ = ["HF_PREFIX", "HF_PRESETS", "ModelSource", "PresetSource", "is_hf", "open_source",
           "source_from_fingerprint"]


class PresetSource(ModelSource):
    """A chimera preset (``gpt2-tiny``, ``bert-48``...), its vocabulary the data's."""

    def __init__(self, name: str, config):

        self.name, self.config = name, config
        self.kind, self.seq_len, self.vocab_size = config.kind, config.seq_len, config.vocab_size
        self.num_layers = config.n_layers_total
        self.sums = config.kind == "bert"  # masked tokens differ per micro-batch: sum / count
        self._loss = loss_fn(config, "sum" if self.sums else "mean")

    def layer_costs(self) -> list[float]:

        return layer_costs(self.config)

    def layer_flops(self) -> list[float]:
        return flops_per_token(self.config)

    def build_layer(self, index: int, seed: int) -> nn.Module:

        return build_layers(self.config, seed, [index])[0]

    @takes_sharded_logits  # chimera.models.loss_fn: whole or vocab-sharded logits
    def loss_fn(self, output, targets):
        return self._loss(output, targets)

    def global_name(self, name: str) -> str:

        index, rest = name.split(".", 1)
        return f"{layer_names(self.config)[int(index)]}.{rest}"

    def fingerprint(self) -> dict:

        return model_fingerprint(self.config)

    def tp_plan(self):
        return preset_tp_plan(self.kind, self.name)

    def packed(self, ids, segments):
        return ids, segments  # chimera's GPT-2 layers hand the segments on (models.gpt2)


def is_hf(model: str) -> bool:
    return model.startswith(HF_PREFIX) or model in HF_PRESETS


def open_source(model: str, data_info, seq_len: int | None = None,
                dtype: torch.dtype = torch.float32) -> ModelSource:
    """The source ``--model`` names, sized to the data (``DataInfo``); ValueError (one line)
    for an unknown name or a model that cannot take the data."""
    if is_hf(model):
        from chimera.hf.source import HFSource  # ImportError without the hf extra

        return HFSource.open(model, data_info, seq_len, dtype)

    if model not in PRESETS:
        raise UserError(f"unknown model {model!r}; known: {', '.join(sorted(PRESETS))}, "
                         f"{', '.join(HF_PRESETS)}, or {HF_PREFIX}PATH (a Hugging Face config.json "
                         "or save_pretrained folder)")
    size = {"vocab_size": model_vocab(data_info, PRESETS[model].kind)}
    if seq_len is not None:
        size["seq_len"] = seq_len
    return PresetSource(model, get_config(model, **size))


def source_from_fingerprint(model: str, fingerprint: dict,
                            dtype: torch.dtype = torch.float32) -> ModelSource:
    """The source a checkpoint was written by (``meta.json``: ``model``, ``model_config``);
    UserError when it does not describe a model this version builds."""
    if isinstance(fingerprint, dict) and fingerprint.get("source") == "hf":
        from chimera.hf.source import HFSource  # optional extra (hf): transformers

        return HFSource.from_fingerprint(model, fingerprint, dtype)

    try:
        return PresetSource(model, ModelConfig(**fingerprint))
    except (TypeError, ValueError) as exc:
        raise UserError(f"its model_config ({fingerprint!r}) does not describe a model this "
                         f"version builds: {exc}") from None
