"""BERT (masked language model) as a flat list of layers.

Differs from GPT-2 (see ``gpt2.py`` for the conventions) in three places: the embedding
ends with a LayerNorm, blocks are post-LN with bidirectional attention, and the head is
the MLM transform (dense + GELU + LayerNorm) followed by an untied decoder. There are no
segment (token type) embeddings and no padding mask: every sequence is full length.
"""

from __future__ import annotations

import torch
from torch import nn

from chimera.models.gpt2 import MLP, ModelConfig, SelfAttention, TokenPositionEmbedding


class BertEmbedding(TokenPositionEmbedding):
    """Token plus position embedding, then LayerNorm: (B, T) ids -> (B, T, C)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.ln = nn.LayerNorm(cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.drop(self.ln(self.embed(idx)))               # (B, T, C)


class BertBlock(nn.Module):
    """Post-LN transformer block, bidirectional attention: (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn = SelfAttention(cfg, causal=False)
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg, approximate="none")
        self.ln2 = nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x))                           # (B, T, C)
        return self.ln2(x + self.mlp(x))                         # (B, T, C)


class BertHead(nn.Module):
    """MLM head: dense + GELU + LayerNorm, then decoder: (B, T, C) -> (B, T, V)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.gelu = nn.GELU()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.decoder = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.ln(self.gelu(self.dense(x))))   # (B, T, V)


BERT_LAYERS = (BertEmbedding, BertBlock, BertHead)
