"""GPT-2 as a flat list of layers, plus the config and the pieces BERT shares.

Conventions (said once):
- A model is ``[Embedding, Block x n_layer, Head]``; layer ``i`` of that list is the unit
  a pipeline stage is cut from. Every layer maps one tensor to one tensor.
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
import types
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from chimera.data import derive_seed

KINDS = ("gpt2", "bert")
INIT_STD = 0.02
# Projections that write into the residual stream; GPT-2 scales their init by
# 1/sqrt(2 * n_layer) so the residual variance does not grow with depth.
RESIDUAL_PROJECTIONS = ("attn.proj", "mlp.proj")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a GPT-2 (causal, pre-LN) or BERT (bidirectional, post-LN) model."""

    kind: str
    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    vocab_size: int = 256
    dropout: float = 0.0
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("n_layer", "d_model", "n_head", "seq_len", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if not isinstance(self.vocab_size, int) or self.vocab_size < 2:
            raise ValueError(f"vocab_size must be an integer >= 2, got {self.vocab_size!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def n_layers_total(self) -> int:
        """Length of the flat layer list: embedding + blocks + head."""
        return self.n_layer + 2


PRESETS = types.MappingProxyType({
    "gpt2-tiny": ModelConfig("gpt2", n_layer=4, d_model=32, n_head=2, seq_len=32),
    "gpt2-bench": ModelConfig("gpt2", n_layer=8, d_model=256, n_head=4, seq_len=128),
    "gpt2-small": ModelConfig("gpt2", n_layer=12, d_model=768, n_head=12, seq_len=1024),
    "gpt2-medium": ModelConfig("gpt2", n_layer=24, d_model=1024, n_head=16, seq_len=1024),
    # The paper's GPT-2 (Table 3): 64 layers, hidden 1280, sequence 632.
    "gpt2-paper": ModelConfig("gpt2", n_layer=64, d_model=1280, n_head=20, seq_len=632),
    "bert-tiny": ModelConfig("bert", n_layer=4, d_model=32, n_head=2, seq_len=32),
    # The paper's Bert-48: 48 layers, hidden 1024, sequence 128.
    "bert-48": ModelConfig("bert", n_layer=48, d_model=1024, n_head=16, seq_len=128),
})


def get_config(name: str, **overrides) -> ModelConfig:
    """The preset ``name``, with any field overridden (e.g. ``vocab_size=50257``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(PRESETS))}")
    return replace(PRESETS[name], **overrides)


# ---------------------------------------------------------------------------------------
# Analytic sizes (no model is built, so the planner can size gpt2-paper on a laptop)

def _block_params(cfg: ModelConfig) -> int:
    c, r = cfg.d_model, cfg.mlp_ratio
    attn = (c * 3 * c + 3 * c) + (c * c + c)                  # qkv, proj
    mlp = (c * r * c + r * c) + (r * c * c + c)                # fc, proj
    return attn + mlp + 4 * c                                  # two LayerNorms


def layer_param_counts(cfg: ModelConfig) -> list[int]:
    """Number of parameters of each layer of the flat list."""
    c, v = cfg.d_model, cfg.vocab_size
    embed = v * c + cfg.seq_len * c
    if cfg.kind == "gpt2":
        head = 2 * c + c * v                                   # ln_f, lm_head (no bias)
    else:
        embed += 2 * c                                         # embedding LayerNorm
        head = (c * c + c) + 2 * c + (c * v + v)               # dense, ln, decoder
    return [embed] + [_block_params(cfg)] * cfg.n_layer + [head]


def param_count(cfg: ModelConfig) -> int:
    """Total number of parameters."""
    return sum(layer_param_counts(cfg))


def flops_per_token(cfg: ModelConfig) -> list[float]:
    """Forward FLOPs per token of each layer of the flat list.

    Matmuls cost 2 FLOPs per weight; a block adds the attention term 4*T*C (Q K^T and
    A V over the full T x T matrix, as dense kernels compute it). The embedding is a
    lookup, not a matmul: counted as 4*C elementwise work (Kaplan et al.).
    """
    counts = layer_param_counts(cfg)
    attention = 4.0 * cfg.seq_len * cfg.d_model
    blocks = [2.0 * n + attention for n in counts[1:-1]]
    return [4.0 * cfg.d_model] + blocks + [2.0 * counts[-1]]


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)                  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in (q, k, v))                          # (B, H, T, C/H)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=self.causal,
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

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() != 2 or idx.dtype != torch.long:
            raise ValueError(f"embedding expects (B, T) int64 token ids, got "
                             f"{tuple(idx.shape)} {idx.dtype}")
        T = idx.shape[1]
        if T > self.seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len {self.seq_len}")
        pos = torch.arange(T, device=idx.device)                # (T,)
        return self.tok(idx) + self.pos(pos)                    # (B, T, C)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.drop(self.embed(idx))


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))                          # (B, T, C)
        return x + self.mlp(self.ln2(x))                        # (B, T, C)


class GPT2Head(nn.Module):
    """Final LayerNorm and untied output projection: (B, T, C) -> (B, T, V)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    Built on the meta device first so the default init neither costs time nor touches
    torch's global RNG; every parameter is then written by ``init_weights``.
    """
    with torch.device("meta"):
        layer = cls(cfg)
    layer = layer.to_empty(device="cpu").float()               # whatever the default dtype
    gen = torch.Generator().manual_seed(derive_seed(seed, "layer", index))
    init_weights(layer, cfg, gen)
    return layer
