"""Decoding with a key/value cache, a batch of prompts at a time (``chimera generate``).

A ``Decoder`` holds a batch of left-padded rows and the keys and values of every position it
has seen: ``prefill(ids, mask)`` runs the prompts (B, T) once, ``step(next)`` one new
position per row, so each new token costs one forward of one position per layer. Positions
count a row's real tokens (padding takes none), and padding is masked out of every key.

Two models: chimera's GPT-2 (its own layers, ``PresetDecoder``) and Hugging Face's GPT-2 and
Llama (HF's model class and cache, ``HFDecoder``). Both give the logits of the model run on
the whole sequence (the tests compare them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chimera.errors import UserError


def positions(mask: torch.Tensor, past: torch.Tensor | None = None) -> torch.Tensor:
    """(B, t) positions of the new columns: each row's count of real tokens before them."""
    before = torch.zeros(mask.shape[0], 1, dtype=torch.long, device=mask.device) if past is None else past
    return (before + mask.long().cumsum(1) - 1).clamp(min=0)


def attention_mask(keys: torch.Tensor, new: int) -> torch.Tensor:
    """(B, 1, new, L) bool: a query sees real keys up to its own column, and always itself
    (a padding query must see something: softmax over nothing is NaN)."""
    length = keys.shape[1]
    col = torch.arange(length, device=keys.device)
    row = torch.arange(length - new, length, device=keys.device)[:, None]  # (new, 1)
    causal = col[None, :] <= row                                        # (new, L)
    return ((causal[None] & keys[:, None, :].bool()) | (col[None, :] == row)[None])[:, None]


class PresetDecoder:
    """chimera's GPT-2 (``Stage`` of embedding, blocks, head) with a cache per block."""

    def __init__(self, model):
        layers = list(model.children())
        self.embed, self.blocks, self.head = layers[0], layers[1:-1], layers[-1]
        self.cache, self.mask, self.seen = [], None, None

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.cache = [None] * len(self.blocks)
        self.mask, self.seen = mask, mask.long().sum(1, keepdim=True)
        return self._forward(ids, positions(mask))

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` (B,): one new real token per row -> logits (B, V)."""
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], 1)
        pos = self.seen
        self.seen = self.seen + 1
        return self._forward(ids[:, None], pos)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.embed.tok(ids) + self.embed.pos(pos)                     # (B, t, C)
        allowed = attention_mask(self.mask, ids.shape[1])                 # (B, 1, t, L)
        for i, block in enumerate(self.blocks):
            x = self._block(i, block, x, allowed)
        return self.head(x[:, -1:])[:, -1]                                # (B, V)

    def _block(self, i: int, block, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        attn = block.attn
        B, t, C = x.shape
        q, k, v = attn.qkv(block.ln1(x)).split(C, dim=2)                 # 3 x (B, t, C)
        q, k, v = (z.view(B, t, attn.n_head, C // attn.n_head).transpose(1, 2) for z in (q, k, v))
        if self.cache[i] is not None:                                     # (B, H, L, C/H)
            k, v = torch.cat([self.cache[i][0], k], 2), torch.cat([self.cache[i][1], v], 2)
        self.cache[i] = (k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)    # (B, H, t, C/H)
        x = x + attn.proj(y.transpose(1, 2).reshape(B, t, C))
        return x + block.mlp(block.ln2(x))                                # (B, t, C)


class HFDecoder:
    """A Hugging Face causal LM (``GPT2LMHeadModel``, ``LlamaForCausalLM``) and its cache."""

    def __init__(self, model):
        self.model, self.cache, self.mask = model, None, None

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        from transformers import DynamicCache  # start-up time: with the HF model

        self.cache, self.mask = DynamicCache(), mask.long()
        return self._forward(ids, positions(mask))

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        pos = self.mask.sum(1, keepdim=True)
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], 1)
        return self._forward(ids[:, None], pos)

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=pos,
                         cache=self.cache, use_cache=True)  # the cache grows in place
        return out.logits[:, -1]                                          # (B, V)


def hf_model(source, state: dict[str, torch.Tensor], dtype: torch.dtype):
    """The HF model class of an HF source, with a checkpoint's weights (HF's names, a tie
    once under its source), sharing their memory (``assign``: not a second copy)."""
    import transformers  # start-up time: only for HF checkpoints

    model = getattr(transformers, source.arch)(source.config).to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = set(model.all_tied_weights_keys)
    if unexpected or set(missing) - tied:
        raise UserError(f"the checkpoint does not fit {source.arch}: missing "
                         f"{sorted(set(missing) - tied)[:4]}, unexpected {sorted(unexpected)[:4]}")
    model.tie_weights()
    return model.eval()
