"""The model-source interface (:class:`ModelSource`: what the trainer needs from a model) and
the Hugging Face names. It sits below both :mod:`chimera.train.sources` and
``chimera.hf.source`` (an optional extra that implements it), so neither imports the other's
layer upwards."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from chimera.byo import retie
from chimera.data import IGNORE_INDEX
from chimera.errors import UserError
from chimera.models import packing
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
    # hf-llama-tiny's shape in the Llama-like families, each with what sets it apart
    "hf-qwen2-tiny": ("Qwen2ForCausalLM",  # q/k/v biases, head tied to the embedding
                      dict(hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=256, tie_word_embeddings=True), 64),
    "hf-mistral-tiny": ("MistralForCausalLM",  # sliding-window attention: the last 32 tokens
                        dict(hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256, sliding_window=32), 64),
    "hf-qwen3-tiny": ("Qwen3ForCausalLM",  # q/k norms, head_dim 32 (4 x 32 > hidden 64), tied
                      dict(hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           max_position_embeddings=256, tie_word_embeddings=True), 64),
    "hf-gemma-tiny": ("GemmaForCausalLM",  # embedding scaled by sqrt(64), RMSNorm by 1 + w, tied
                      dict(hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=256), 64),
    "hf-phi3-tiny": ("Phi3ForCausalLM",  # fused qkv_proj and gate_up_proj, untied
                     dict(hidden_size=64, intermediate_size=176, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256), 64),
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
    eos_id: int | None = None  # --doc-mask: the id that ends each packed document (None: off)

    def layer_costs(self) -> list[float]:
        raise NotImplementedError

    def layer_flops(self) -> list[float]:
        """Forward FLOPs per token of each layer (model FLOPs utilization counts 3x their sum)."""
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

    def tp_plan(self):
        """The tensor-parallel plan of this model's layers (``ModelOptions.tp_plan``: a
        function of the layer index and the layer), or a UserError naming why there is none."""
        raise UserError(f"--tensor-parallel: {self.name} has no tensor-parallel plan")

    def packed(self, ids: torch.Tensor, segments: torch.Tensor):
        """The first layer's input for (B, T) ids whose documents (``segments``, B x T) are
        kept apart: each attends only to itself, its positions counted from 0."""
        raise NotImplementedError

    # -- shared -------------------------------------------------------------------------
    def keep_documents_apart(self, eos_id: int | None) -> None:
        """``--doc-mask``: from now on ``inputs`` cuts every row into its documents, each
        ending with ``eos_id``. A causal decoder only; UserError otherwise, or without an id."""
        if self.kind != "gpt2":
            raise UserError(f"--doc-mask: {self.name} is not a causal decoder (it attends both "
                            "ways); packed documents are kept apart in GPT-2 and the Hugging Face "
                            "decoders")
        if eos_id is None:
            raise UserError("--doc-mask needs the end-of-text id that ends each document: "
                            "tokenized data (a tokenizer's, meta.json's) or --eos-id ID for raw "
                            "token files; text read as bytes has none")
        self.eos_id = eos_id

    def inputs(self, ids: torch.Tensor):
        """What the first layer takes for a (B, T) batch of ids: the ids, or with
        ``keep_documents_apart`` what keeps their documents apart (``packed``), computed
        from the ids alone, so every rank and layout sees the same."""
        if self.eos_id is None:
            return ids
        return self.packed(ids, packing.document_segments(ids, self.eos_id))

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
