"""Pipeline layers made of a Hugging Face model's own submodules, and their losses.

Each layer holds HF modules (a ``GPT2Block``, a ``LlamaDecoderLayer``, ...) and calls them
as the HF model's ``forward`` does, with the same arguments: the attention mask is built
per layer by HF's own ``create_causal_mask`` / ``create_bidirectional_mask`` from the 2-D
``attention_mask`` and the ``position_ids`` the boundary carries, so padding, causality and
packed sequences (position ids restarting, no mask) mean what they mean in HF.

Boundary between layers: ``(hidden (B, T, C), attention_mask (B, T) | None, position_ids
(B, T) | None)``; a None stays None (HF's defaults are recomputed where needed). The first
layer takes ``input_ids`` alone, a tuple ``(input_ids, attention_mask)``, or a dict with the
keys a tokenizer returns (``input_ids``, ``attention_mask``, ``position_ids``,
``token_type_ids``); the last returns the logits (B, T, vocab).

Each layer's ``prefixes`` maps its children to their paths in the HF model
(``{"block": "transformer.h.3"}``): the names of the pipeline's state dict translate to HF's.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.masking_utils import (create_bidirectional_mask, create_causal_mask,
                                        create_sliding_window_causal_mask)

from chimera import tp
from chimera.errors import UserError

IGNORE = -100  # HF's label for "no loss here" (padding, unmasked MLM positions)


class HFLayer(nn.Module):
    """Children are HF modules; ``prefixes`` (set by the builder) says where each came from.
    ``documents`` (set by the builder, ``HFModel.documents``): position ids that restart mark
    packed documents, each attending only to itself, whatever ``config.use_cache`` says."""

    documents = False

    def __init__(self, config, **children: nn.Module):
        super().__init__()
        self.config = config
        for name, module in children.items():
            self.add_module(name, module)
        self.prefixes: dict[str, str] = {}


def _positions(h: torch.Tensor, position_ids):
    """HF's default when none are given: 0..T-1, shape (1, T)."""
    if position_ids is not None:
        return position_ids
    return torch.arange(h.shape[1], device=h.device).unsqueeze(0)


def _causal_mask(layer: HFLayer, h: torch.Tensor, mask, positions, make=create_causal_mask):
    """HF's causal mask for this batch (``make``: HF's mask function, the sliding-window one
    for a layer that attends to the last ``config.sliding_window`` tokens only). HF's decoder
    ``forward`` makes a KV cache when ``config.use_cache`` (the GPT-2 and Llama default, in
    training too), and with a cache its mask ignores position ids (no packed-sequence
    detection); without one, position ids that restart mark packed sequences (block-diagonal
    attention). The same here, without a cache; ``layer.documents`` always detects them."""
    config = layer.config
    packed = positions if layer.documents or not getattr(config, "use_cache", False) else None
    return make(config=config, inputs_embeds=h, attention_mask=mask, cache=None, position_ids=packed)


class Embed(HFLayer):
    """Layer 0: parse the inputs, embed; ``keys`` are the input names this model takes."""

    keys = ("input_ids", "attention_mask", "position_ids")
    absolute_positions = True  # a position table: longer sequences than it holds are refused

    def forward(self, inputs, attention_mask=None, position_ids=None, token_type_ids=None):
        ids, mask, pos, types = self._parse(inputs, attention_mask, position_ids, token_type_ids)
        return self.embed(ids, pos, types), mask, pos

    def _parse(self, inputs, mask, pos, types):
        if isinstance(inputs, dict):
            unknown = sorted(set(inputs) - set(self.keys))
            if unknown:
                raise UserError(f"inputs: unexpected key(s) {unknown}; {type(self).__name__} takes "
                                 f"{list(self.keys)}")
            ids, mask, pos, types = (inputs.get(k) for k in
                                     ("input_ids", "attention_mask", "position_ids", "token_type_ids"))
        else:
            ids = inputs
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
            raise UserError(f"input_ids must be a (batch, length) integer tensor, got {_desc(ids)}")
        for name, t in (("attention_mask", mask), ("position_ids", pos), ("token_type_ids", types)):
            if t is not None and (not isinstance(t, torch.Tensor) or t.shape != ids.shape):
                raise UserError(f"{name} must be a (batch, length) tensor like input_ids "
                                 f"{tuple(ids.shape)}, got {_desc(t)} (4-D masks are not supported)")
        if types is not None and "token_type_ids" not in self.keys:
            raise UserError(f"{type(self).__name__} takes no token_type_ids")
        limit = getattr(self.config, "max_position_embeddings", None)
        if self.absolute_positions and limit is not None and ids.shape[1] > limit:
            raise UserError(f"sequence length {ids.shape[1]} > max_position_embeddings {limit}")
        return ids, mask, pos, types


def _desc(t) -> str:
    return f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__


# -- GPT-2 (GPT2LMHeadModel) ----------------------------------------------------------------
class GPT2Embed(Embed):
    keys = ("input_ids", "attention_mask", "position_ids", "token_type_ids")

    def embed(self, ids, pos, types):
        h = self.wte(ids) + self.wpe(_positions(ids, pos))  # (B, T, C)
        if types is not None:
            h = h + self.wte(types)  # GPT2Model embeds token types with wte
        return self.drop(h)


class GPT2Block(HFLayer):
    def forward(self, h, mask, pos):
        p = _positions(h, pos)
        causal = _causal_mask(self, h, mask, p)
        return self.block(h, None, causal, None, use_cache=False, position_ids=p), mask, pos


class GPT2Head(HFLayer):
    def forward(self, h, mask, pos):
        return self.lm_head(self.ln_f(h))  # (B, T, vocab)


def gpt2_plan(config) -> list[tuple[type, dict[str, str]]]:
    embed = {"wte": "transformer.wte", "wpe": "transformer.wpe", "drop": "transformer.drop"}
    return [(GPT2Embed, embed),
            *[(GPT2Block, {"block": f"transformer.h.{k}"}) for k in range(config.n_layer)],
            (GPT2Head, {"ln_f": "transformer.ln_f", "lm_head": "lm_head"})]


# -- Llama (LlamaForCausalLM) and the families made of its parts ----------------------------
# Qwen2 (q/k/v biases), Mistral (sliding-window attention), Qwen3 (q/k norms), Gemma (an
# embedding scaled by sqrt(hidden), RMSNorm by 1 + w, GELU, tied), Phi-3 (fused qkv and
# gate/up projections, partial rotary, residual dropout): the same embedding,
# decoder-layer call, final norm and head under the same names; only the modules inside
# them and the mask of sliding-window layers differ.
class LlamaEmbed(Embed):
    absolute_positions = False  # RoPE: no table to overrun

    def embed(self, ids, pos, types):
        return self.embed_tokens(ids)


class LlamaBlock(HFLayer):
    """A decoder layer with its own copy of the rotary embedding (buffers only, recomputed
    from the config, not in the state dict): cos/sin are computed where they are used."""

    make_mask = staticmethod(create_causal_mask)

    def forward(self, h, mask, pos):
        p = _positions(h, pos)
        causal = _causal_mask(self, h, mask, p, self.make_mask)
        rope = self.rotary_emb(h, position_ids=p)
        h = self.layer(h, attention_mask=causal, position_ids=p, cache=None, use_cache=False,
                       position_embeddings=rope)
        return h, mask, pos


class LlamaHead(HFLayer):
    def forward(self, h, mask, pos):
        return self.lm_head(self.norm(h))


class SlidingBlock(LlamaBlock):
    """A decoder layer that attends to the last ``config.sliding_window`` positions only
    (HF's sliding-window causal mask; padding and packing as in ``LlamaBlock``)."""

    make_mask = staticmethod(create_sliding_window_causal_mask)


def llama_plan(config, sliding=lambda k: False) -> list[tuple[type, dict[str, str]]]:
    """``sliding(k)``: decoder layer k has sliding-window attention."""
    return [(LlamaEmbed, {"embed_tokens": "model.embed_tokens"}),
            *[(SlidingBlock if sliding(k) else LlamaBlock,
               {"layer": f"model.layers.{k}", "rotary_emb": "model.rotary_emb"})
              for k in range(config.num_hidden_layers)],
            (LlamaHead, {"norm": "model.norm", "lm_head": "lm_head"})]


def window_plan(config) -> list[tuple[type, dict[str, str]]]:
    """Mistral, Phi-3: every layer slides when ``config.sliding_window`` is set (HF's
    MistralModel, Phi3Model)."""
    return llama_plan(config, lambda k: config.sliding_window is not None)


def qwen_plan(config) -> list[tuple[type, dict[str, str]]]:
    """Qwen2, Qwen3: per layer, ``config.layer_types`` (sliding from ``max_window_layers`` on
    when ``use_sliding_window``)."""
    return llama_plan(config, lambda k: config.layer_types[k] == "sliding_attention")


# -- BERT (BertForMaskedLM) -----------------------------------------------------------------
class BertEmbed(Embed):
    keys = ("input_ids", "attention_mask", "position_ids", "token_type_ids")

    def embed(self, ids, pos, types):
        return self.embeddings(input_ids=ids, token_type_ids=types, position_ids=pos)


class BertBlock(HFLayer):
    def forward(self, h, mask, pos):
        full = create_bidirectional_mask(config=self.config, inputs_embeds=h, attention_mask=mask,
                                         position_ids=pos)
        return self.layer(h, full, None, encoder_attention_mask=None, cache=None,
                          position_ids=pos), mask, pos


class BertHead(HFLayer):
    def forward(self, h, mask, pos):
        return self.cls(h)


def bert_plan(config) -> list[tuple[type, dict[str, str]]]:
    return [(BertEmbed, {"embeddings": "bert.embeddings"}),
            *[(BertBlock, {"layer": f"bert.encoder.layer.{k}"})
              for k in range(config.num_hidden_layers)],
            (BertHead, {"cls": "cls"})]


# -- losses (sums over tokens: Pipeline(loss_reduction="token_mean") divides) ----------------
def _check_labels(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if not isinstance(labels, torch.Tensor) or labels.shape != logits.shape[:2]:
        raise UserError(f"labels must be (batch, length) like input_ids {tuple(logits.shape[:2])}, "
                         f"got {_desc(labels)}")


def _upcast(logits):
    """HF computes the loss in float32 (``logits.float()``); float64 stays float64."""
    return logits.float() if logits.dtype.itemsize < 4 else logits


# the losses take the logits whole or sharded over the vocabulary (tp.ShardedLogits: under
# tensor parallelism the head keeps them sharded, the cross-entropy is vocab-parallel)
@tp.takes_sharded_logits
def causal_lm_loss(logits, labels: torch.Tensor) -> torch.Tensor:
    """HF's causal LM loss as a sum: the logits at t predict ``labels[t + 1]`` (labels are the
    input ids, -100 where no loss is wanted, such as padding)."""
    _check_labels(logits, labels)
    return tp.cross_entropy(_upcast(logits[:, :-1]), labels[:, 1:], ignore_index=IGNORE,
                            reduction="sum")


def causal_label_count(labels: torch.Tensor) -> int:
    """Tokens the causal loss sums over in the whole mini-batch: shifted labels != -100."""
    return int((labels[:, 1:] != IGNORE).sum())


@tp.takes_sharded_logits
def token_loss(logits, targets: torch.Tensor) -> torch.Tensor:
    """One target per position, no shift, summed over targets != -100: HF's masked LM loss
    (BERT), or a causal loss whose targets are already the next tokens."""
    _check_labels(logits, targets)
    return tp.cross_entropy(_upcast(logits), targets, ignore_index=IGNORE, reduction="sum")


def target_count(targets: torch.Tensor) -> int:
    return int((targets != IGNORE).sum())
