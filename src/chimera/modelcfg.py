"""Model shapes without torch: config, presets, analytic sizes and the balanced stage cut.

Everything a planner needs to size a model (``chimera plan`` sizes gpt2-paper on a laptop)
lives here and imports no torch; ``chimera.models`` re-exports it next to the torch modules.
See ``chimera.models.gpt2`` for the layer conventions (``[Embedding, Block x n_layer, Head]``).
"""

from __future__ import annotations

import math
import types
from collections.abc import Sequence
from dataclasses import dataclass, replace

from chimera.errors import UserError

KINDS = ("gpt2", "bert")  # the kinds chimera.models builds
SIZED_KINDS = KINDS + ("llama",)  # and those only sized here, for the planner (LlamaConfig)


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
        kinds = SIZED_KINDS if isinstance(self, LlamaConfig) else KINDS
        if self.kind not in kinds:
            raise UserError(f"kind must be one of {kinds}, got {self.kind!r}")
        for name in ("n_layer", "d_model", "n_head", "seq_len", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_head:
            raise UserError(
                f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if not isinstance(self.vocab_size, int) or self.vocab_size < 2:
            raise UserError(f"vocab_size must be an integer >= 2, got {self.vocab_size!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def n_layers_total(self) -> int:
        """Length of the flat layer list: embedding + blocks + head."""
        return self.n_layer + 2

    # Sizes the planner reads (properties, not fields: a checkpoint records the fields)
    @property
    def kv_heads(self) -> int:
        """Key/value heads (fewer than ``n_head`` under grouped-query attention)."""
        return self.n_head

    @property
    def ffn_width(self) -> int:
        """Width of the MLP's hidden layer."""
        return self.mlp_ratio * self.d_model

    @property
    def gated(self) -> bool:
        """A gated MLP (SwiGLU: gate, up and down projections) instead of fc, GELU, proj."""
        return False


@dataclass(frozen=True)
class LlamaConfig(ModelConfig):
    """Shape of a Llama-style decoder, for the planner only (no package here builds it):
    RMSNorm, rotary positions (no position embedding), grouped-query attention with
    ``n_kv_head`` key/value heads, a SwiGLU MLP of width ``mlp_width``, no biases, a head
    not tied to the embedding. ``kind`` is ``"llama"``; ``mlp_ratio`` is not read."""

    n_kv_head: int = 0
    mlp_width: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("n_kv_head", "mlp_width"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{name} must be a positive integer, got {value!r}")
        if self.n_head % self.n_kv_head:
            raise UserError(f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head

    @property
    def ffn_width(self) -> int:
        return self.mlp_width

    @property
    def gated(self) -> bool:
        return True


PRESETS = types.MappingProxyType({
    "gpt2-tiny": ModelConfig("gpt2", n_layer=6, d_model=32, n_head=2, seq_len=32),
    "gpt2-bench": ModelConfig("gpt2", n_layer=8, d_model=256, n_head=4, seq_len=128),
    "gpt2-small": ModelConfig("gpt2", n_layer=12, d_model=768, n_head=12, seq_len=1024),
    "gpt2-medium": ModelConfig("gpt2", n_layer=24, d_model=1024, n_head=16, seq_len=1024),
    # The paper's GPT-2 (Table 3): 64 layers, hidden 1280, sequence 632.
    "gpt2-paper": ModelConfig("gpt2", n_layer=64, d_model=1280, n_head=20, seq_len=632),
    "bert-tiny": ModelConfig("bert", n_layer=4, d_model=32, n_head=2, seq_len=32),
    # The paper's Bert-48: 48 layers, hidden 1024, sequence 128.
    "bert-48": ModelConfig("bert", n_layer=48, d_model=1024, n_head=16, seq_len=128),
})


# Sized for the planner (``chimera plan --model``), not built by ``chimera train``.
SIZED_PRESETS = types.MappingProxyType({
    # Llama 2 70B (Touvron et al. 2023, Table 1 and the released config): 80 layers, hidden
    # 8192, 64 heads, 8 key/value heads, SwiGLU width 28672, vocabulary 32000, context 4096.
    "llama-70b": LlamaConfig("llama", n_layer=80, d_model=8192, n_head=64, seq_len=4096,
                             vocab_size=32000, n_kv_head=8, mlp_width=28672),
})


def get_sized_config(name: str, **overrides) -> ModelConfig:
    """A preset the planner can size: one of ``PRESETS`` or of ``SIZED_PRESETS``."""
    if name in SIZED_PRESETS:
        return replace(SIZED_PRESETS[name], **overrides)
    if name not in PRESETS:
        raise UserError(f"unknown model {name!r}; known: {', '.join(sorted(PRESETS))}, "
                        f"{', '.join(sorted(SIZED_PRESETS))} (planner only)")
    return get_config(name, **overrides)


def get_config(name: str, **overrides) -> ModelConfig:
    """The preset ``name``, with any field overridden (e.g. ``vocab_size=50257``)."""
    if name not in PRESETS:
        raise UserError(f"unknown model {name!r}; known: {', '.join(sorted(PRESETS))}")
    return replace(PRESETS[name], **overrides)


# ---------------------------------------------------------------------------------------
# Analytic sizes (no model is built, so the planner can size gpt2-paper on a laptop)

def _block_params(cfg: ModelConfig) -> int:
    c, r = cfg.d_model, cfg.mlp_ratio
    attn = (c * 3 * c + 3 * c) + (c * c + c)                  # qkv, proj
    mlp = (c * r * c + r * c) + (r * c * c + c)                # fc, proj
    return attn + mlp + 4 * c                                  # two LayerNorms


def _llama_block_params(cfg: ModelConfig) -> int:
    c, kv = cfg.d_model, cfg.d_model // cfg.n_head * cfg.kv_heads
    return 2 * c * c + 2 * c * kv + 3 * c * cfg.ffn_width + 2 * c  # q, o; k, v; MLP; norms


def layer_param_counts(cfg: ModelConfig) -> list[int]:
    """Number of parameters of each layer of the flat list."""
    c, v = cfg.d_model, cfg.vocab_size
    if cfg.kind == "llama":  # rotary positions: no position table; an untied head
        return [v * c] + [_llama_block_params(cfg)] * cfg.n_layer + [c + c * v]
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
# Balanced stage cut (``chimera.models.partition`` adds the torch side: building stages)

def layer_costs(cfg: ModelConfig) -> list[float]:
    """Relative forward cost of each layer: a block is 1.0, embedding and head by FLOPs."""
    flops = flops_per_token(cfg)
    block = flops[1]
    return [f / block for f in flops]


def _check_costs(costs: Sequence[float], parts: int) -> None:
    if not isinstance(parts, int) or parts < 1:
        raise UserError(f"number of stages must be a positive integer, got {parts!r}")
    if any(not math.isfinite(c) or c < 0 for c in costs):
        raise UserError(f"layer costs must be finite and non-negative, got {list(costs)}")
    if parts > len(costs):
        raise UserError(f"cannot split {len(costs)} layers into {parts} stages: "
                         f"every stage needs at least one layer")


def _min_max_table(prefix: list[float], parts: int) -> list[list[int]]:
    """DP over (stages p, first i layers); returns, per cell, where the last stage starts."""
    n = len(prefix) - 1
    best = [prefix[i] for i in range(n + 1)]                   # one stage
    starts = [[0] * (n + 1)]
    for p in range(2, parts + 1):
        new_best, new_starts = [math.inf] * (n + 1), [0] * (n + 1)
        for i in range(p, n + 1):
            for j in range(p - 1, i):                          # last stage is [j, i)
                cost = max(best[j], prefix[i] - prefix[j])
                if cost < new_best[i]:                         # strict: first j wins ties
                    new_best[i], new_starts[i] = cost, j
        best = new_best
        starts.append(new_starts)
    return starts


def partition(costs: Sequence[float], parts: int) -> list[range]:
    """Cut ``costs`` into ``parts`` contiguous non-empty ranges minimizing the largest sum.

    Exact dynamic program, O(parts * n^2); deterministic (ties go to the earliest cut of
    the last stage, i.e. later stages take the extra layer).
    """
    _check_costs(costs, parts)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    starts = _min_max_table(prefix, parts)
    ranges, end = [], len(costs)
    for p in range(parts, 0, -1):
        start = starts[p - 1][end]
        ranges.append(range(start, end))
        end = start
    return ranges[::-1]


def partition_for_ranks(costs: Sequence[float], held: Sequence[Sequence[tuple[int, float]]],
                        parts: int) -> list[range]:
    """Cut ``costs`` into ``parts`` stages so that the busiest *rank* does least.

    ``held[r]``: the (stage, share) pairs rank r computes, share being the part of the
    mini-batch that passes through that replica (1 for a stage of a single pipe, 1/2 for each
    of Chimera's two replicas of a stage). A rank's load is the sum of its stages' costs
    times their shares. :func:`partition` balances stages; where a rank holds two of them (a
    V rank holds the first and the last, a Chimera rank stage s and D-1-s) the loads of the
    stages it pairs count together. Starts from :func:`partition` and moves one boundary by one
    layer at a time while the busiest rank's load (then the sum of squares of the loads)
    falls: a local search over split points, deterministic.
    """
    _check_costs(costs, parts)
    bounds = [r.start for r in partition(costs, parts)][1:]
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def score(cuts: list[int]) -> tuple[float, float]:
        edges = [0] + cuts + [len(costs)]
        stage = [prefix[edges[k + 1]] - prefix[edges[k]] for k in range(parts)]
        loads = [sum(stage[s] * share for s, share in pairs) for pairs in held]
        return max(loads), sum(x * x for x in loads)

    best, improved = score(bounds), True
    while improved:
        improved = False
        for k in range(len(bounds)):
            for step in (-1, 1):
                moved = bounds[:k] + [bounds[k] + step] + bounds[k + 1:]
                low = moved[k - 1] if k else 0
                high = moved[k + 1] if k + 1 < len(moved) else len(costs)
                if not low < moved[k] < high:
                    continue
                s = score(moved)
                if s[0] < best[0] - 1e-12 or (s[0] <= best[0] + 1e-12 and s[1] < best[1] - 1e-12):
                    bounds, best, improved = moved, s, True
    edges = [0] + bounds + [len(costs)]
    return [range(edges[k], edges[k + 1]) for k in range(parts)]
