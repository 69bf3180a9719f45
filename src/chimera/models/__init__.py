"""Single-device GPT-2 and BERT, written as a flat list of layers a pipeline can cut.

``build_layers(cfg, seed)`` returns ``[Embedding, Block x n_layer, Head]``. Parallelism is
applied from outside: a stage is a contiguous range of that list (see ``partition``).
Every parameter has a model-wide name that does not depend on the cut, e.g.
``embed.tok.weight``, ``blocks.3.attn.qkv.weight``, ``head.lm_head.weight``: the keys of
``build_model(cfg, seed).state_dict()``, and what checkpoints are keyed by.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn

from chimera.data import IGNORE_INDEX
from chimera.errors import UserError
from chimera.models.bert import BERT_LAYERS
from chimera.models.gpt2 import (
    GPT2_LAYERS, PRESETS, ModelConfig, flops_per_token, get_config, layer_param_counts,
    make_layer, param_count)
from chimera.tp.loss import cross_entropy, takes_sharded_logits
from chimera.models.partition import (
    build_stage, layer_costs, parse_partition, partition, partition_from_sizes)

__all__ = [
    "IGNORE_INDEX", "PRESETS", "Model", "ModelConfig", "build_layers", "build_model",
    "build_stage", "flops_per_token", "get_config", "layer_costs", "layer_names",
    "layer_param_counts", "layer_param_names", "loss_fn", "param_count",
    "parse_partition", "partition", "partition_from_sizes", "stage_param_names",
]


def _layer_class(cfg: ModelConfig, index: int) -> type:
    if not 0 <= index < cfg.n_layers_total:
        raise UserError(f"layer index {index} out of range: the model has "
                         f"{cfg.n_layers_total} layers (embedding, {cfg.n_layer} blocks, head)")
    embed, block, head = GPT2_LAYERS if cfg.kind == "gpt2" else BERT_LAYERS
    if index == 0:
        return embed
    return head if index == cfg.n_layers_total - 1 else block


def build_layers(cfg: ModelConfig, seed: int,
                 indices: Iterable[int] | None = None) -> list[nn.Module]:
    """The layers at ``indices`` (default: all ``n_layer + 2``), float32 on the CPU.

    Layer ``i`` gets the same weights whichever other layers are built, so a rank can
    build only its stage: ``nn.Sequential(*build_layers(cfg, seed, stage_range))``.
    """
    indices = range(cfg.n_layers_total) if indices is None else indices
    return [make_layer(_layer_class(cfg, i), cfg, seed, i) for i in indices]


def layer_names(cfg: ModelConfig) -> list[str]:
    """Name prefix of each layer's parameters: ``["embed", "blocks.0", ..., "head"]``."""
    return ["embed"] + [f"blocks.{i}" for i in range(cfg.n_layer)] + ["head"]


# The prefix of a layer's parameter names *is* its name; both spellings are public.
layer_param_names = layer_names


def stage_param_names(cfg: ModelConfig, rng: range) -> dict[str, str]:
    """Map the parameter names of ``build_stage(layers, rng)`` to model-wide names.

    E.g. for ``rng = range(3, 5)``: ``"0.attn.qkv.weight" -> "blocks.2.attn.qkv.weight"``.
    Built on the meta device, so it costs no memory even for the largest presets.
    """
    names = layer_names(cfg)
    mapping = {}
    for local, index in enumerate(rng):
        with torch.device("meta"):
            layer = _layer_class(cfg, index)(cfg)
        for name, _ in layer.named_parameters():
            mapping[f"{local}.{name}"] = f"{names[index]}.{name}"
    return mapping


class Model(nn.Module):
    """The whole model on one device; ``state_dict`` keys are the model-wide names."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.embed = layers[0]
        self.blocks = nn.ModuleList(layers[1:-1])
        self.head = layers[-1]

    @property
    def layers(self) -> list[nn.Module]:
        """The flat layer list, in execution order (the same module objects)."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)                                      # (B, T, C)
        for block in self.blocks:
            x = block(x)                                         # (B, T, C)
        return self.head(x)                                      # (B, T, V)


def build_model(cfg: ModelConfig, seed: int) -> Model:
    """Single-device model with exactly the weights of ``build_layers(cfg, seed)``."""
    return Model(build_layers(cfg, seed))


def _cross_entropy(logits, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    """(B, T, V) logits, whole or sharded over the vocabulary (``tp.ShardedLogits``)."""
    return cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction=reduction)


def loss_fn(cfg: ModelConfig, reduction: str = "mean"):
    """``(logits (B, T, V), targets (B, T)) -> scalar`` cross entropy.

    Targets equal to ``IGNORE_INDEX`` (BERT's unmasked positions) do not count. With
    ``reduction="sum"`` a pipeline can divide by the token count of the whole mini-batch,
    which for BERT differs from averaging per-micro-batch means. It takes logits sharded
    over the vocabulary too (``tp.takes_sharded_logits``: under tensor parallelism the head
    keeps them sharded and the loss is vocab-parallel).
    """
    if reduction not in ("mean", "sum"):
        raise UserError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    return takes_sharded_logits(functools.partial(_cross_entropy, reduction=reduction))
