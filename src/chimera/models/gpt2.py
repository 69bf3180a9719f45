"""GPT-2 as a flat list of layers, plus the config and the pieces BERT shares.

Conventions (said once):
- A model is ``[Embedding, Block x n_layer, Head]``; layer ``i`` of that list is the unit
  a pipeline stage is cut from. Every layer maps one tensor to one tensor; with packed
  documents kept apart (``chimera.models.packing``) the embedding takes ``(ids, segments)``
  and every layer but the head hands ``(hidden, segments)`` on, so the segments travel with
  the micro-batch to every stage (an int64 leaf of the boundary, no gradient).
- Shapes: B batch, T sequence length, C ``d_model``, H heads, V vocabulary.
- Tokens are bytes (V = 256) unless ``vocab_size`` is overridden.
- The embedding and the output projection are **not tied**: tied weights would live on
  the first and the last stage at once, and every step would need an extra allreduce
  between them. Untied, each parameter belongs to exactly one layer.
- Weights are drawn from a generator seeded by ``(seed, layer index)``, so a layer's
  weights do not depend on which other layers are built, nor on how the model is cut.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from chimera import rng
from chimera.data import derive_seed
from chimera.errors import UserError
from chimera.models import packing
from chimera.modelcfg import (  # noqa: F401  (the torch-free config, re-exported here)
    KINDS, PRESETS, ModelConfig, flops_per_token, get_config, layer_param_counts, param_count)

INIT_STD = 0.02
# Projections that write into the residual stream; GPT-2 scales their init by
# 1/sqrt(2 * n_layer) so the residual variance does not grow with depth.
RESIDUAL_PROJECTIONS = ("attn.proj", "mlp.proj")


# ---------------------------------------------------------------------------------------
# Modules shared with BERT

class SelfAttention(nn.Module):
    """Multi-head self-attention; causal for GPT-2, bidirectional for BERT."""

    def __init__(self, cfg: ModelConfig, causal: bool):
        super().__init__()
        self.n_head, self.causal, self.dropout = cfg.n_head, causal, cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask`` (B, 1, T, T) bool: what each query sees (packed documents kept apart:
        ``chimera.models.packing.document_mask``); None: causal for GPT-2, all for BERT. A
        tensor-parallel rank runs ``chimera.tp``'s copy of this on its heads."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)                  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in (q, k, v))                          # (B, H, T, C/H)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=self.causal and mask is None,
            dropout_p=self.dropout if self.training else 0.0)   # (B, H, T, C/H)
        y = y.transpose(1, 2).contiguous().view(B, T, C)        # (B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, approximate: str):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.gelu = nn.GELU(approximate=approximate)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.gelu(self.fc(x))))      # (B, T, C)


class TokenPositionEmbedding(nn.Module):
    """Token plus learned position embedding: (B, T) ids -> (B, T, C)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.seq_len = cfg.seq_len
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def embed(self, idx: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        """``segments`` (B, T): positions restart at each packed document's first token."""
        if idx.dim() != 2 or idx.dtype != torch.long:
            raise UserError(f"embedding expects (B, T) int64 token ids, got "
                             f"{tuple(idx.shape)} {idx.dtype}")
        T = idx.shape[1]
        if T > self.seq_len:
            raise UserError(f"sequence length {T} exceeds the model's seq_len {self.seq_len}")
        pos = torch.arange(T, device=idx.device) if segments is None else \
            packing.document_positions(segments)                # (T,) or (B, T)
        return self.tok(idx) + self.pos(pos)                    # (B, T, C)

    def forward(self, idx: torch.Tensor, segments: torch.Tensor | None = None):
        """(B, T) ids -> (B, T, C); with ``segments``: ``(hidden, segments)``."""
        h = self.drop(self.embed(idx, segments))                # (B, T, C)
        return h if segments is None else (h, segments)


# ---------------------------------------------------------------------------------------
# GPT-2 layers

class GPT2Block(nn.Module):
    """Pre-LN transformer block with causal attention: (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = SelfAttention(cfg, causal=True)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg, approximate="tanh")

    def forward(self, x: torch.Tensor, segments: torch.Tensor | None = None):
        """(B, T, C) -> (B, T, C); with ``segments``: ``(hidden, segments)``."""
        mask = None if segments is None else packing.document_mask(segments)  # (B, 1, T, T)
        x = x + self.attn(self.ln1(x), mask)                    # (B, T, C)
        x = x + self.mlp(self.ln2(x))                           # (B, T, C)
        return x if segments is None else (x, segments)


class GPT2Head(nn.Module):
    """Final LayerNorm and untied output projection: (B, T, C) -> (B, T, V)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))                       # (B, T, V)


GPT2_LAYERS = (TokenPositionEmbedding, GPT2Block, GPT2Head)


# ---------------------------------------------------------------------------------------
# Initialization

def init_weights(layer: nn.Module, cfg: ModelConfig, gen: torch.Generator) -> None:
    """GPT-2 init of every parameter of ``layer``, drawn in definition order from ``gen``."""
    residual_std = INIT_STD / math.sqrt(2 * cfg.n_layer)
    with torch.no_grad():
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(RESIDUAL_PROJECTIONS) else INIT_STD
                nn.init.normal_(module.weight, 0.0, std, generator=gen)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, INIT_STD, generator=gen)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)


def make_layer(cls: type, cfg: ModelConfig, seed: int, index: int) -> nn.Module:
    """Build layer ``index`` of the flat list with weights drawn from ``(seed, index)``.

    The default init runs under ``fork_rng`` so torch's global RNG is left untouched (the
    meta device would avoid that work, but its first use imports torch's compiler stack,
    seconds per process); every parameter is then written by ``init_weights``.
    """
    with rng.forked():
        layer = cls(cfg)
    layer = layer.float()                                       # whatever the default dtype
    gen = torch.Generator().manual_seed(derive_seed(seed, "layer", index))
    init_weights(layer, cfg, gen)
    return layer
