"""Tensor parallelism in the planner: the T a model allows, and what a rank computes, holds
and sends at T (no torch).

Layout as the runtime's: P = W·D·T, global rank = (w·D + d)·T + t, the T ranks of a pipeline
rank side by side in one node (T divides the GPUs per node). ``chimera.tp`` shards each layer
Megatron-style, without sequence parallelism:

- a block: the column-parallel Q/K/V (or fused qkv) and MLP-in projections (weights and
  biases), the row-parallel attention-out and MLP-out projections (weights; their biases and
  the norms stay whole); attention runs on n_head/T heads. Forward: 2 allreduces of the
  (B, S, C) output, one per sub-block; backward: 2 of the input gradient. All its FLOPs / T.
- the embedding: the token table by vocabulary rows (padded to a multiple of T); GPT-2's
  position table stays whole. Forward: 1 allreduce of (B, S, C); backward: none. The lookup
  writes the whole (B, S, C) on every rank: its compute is not divided.
- the head: the output projection by vocabulary (padded), its norm whole, its logits kept
  sharded (the vocab-parallel cross-entropy). Forward: 2 allreduces of the loss's (B, S)
  row statistics (the max; the sum of exp with the target's logit), in float32 or wider;
  backward: 1 allreduce of the (B, S, C) input gradient. FLOPs / T (the loss's own
  arithmetic is not priced, as at T = 1).

Pricing: a divided layer takes ``Hardware.layer_time(flops / T, tokens / T)``: a rank's matrix
product with 1/T of the columns does the work of one with 1/T of the rows, and the efficiency
curve is read there (an assumption: smaller products reach less of the peak). Collectives are
ring alpha-beta (allreduce: 2(T-1) steps of n/T bytes) on the intra-node link (the inter-node
one where a preset has none) in the activation precision; the layer waits for them, so they are
added to its F and B, and under split backward to I (W issues none). A recomputed forward redoes
its collectives (the runtime's checkpoint may stop one short: priced in full).

Not searched: T > 1 for BERT (the runtime shards it, its MLM head's transform whole: not
priced here), with dropout (the runtime runs it,
but its attention unfused, the probabilities' masks drawn from the TP streams: not priced
here), or with a measured profile (its layers were timed at T = 1).
"""

from __future__ import annotations

from chimera.modelcfg import ModelConfig, layer_param_counts
from chimera.plan.memory import ACT_BYTES
from chimera.sim.cost import Link


def tp_problem(cfg: ModelConfig, t: int) -> str | None:
    """Why the runtime cannot shard ``cfg`` over ``t`` ranks, or None if it can."""
    if t == 1:
        return None
    if cfg.kind == "bert":
        return "BERT under TP is not priced (its MLM head's dense transform and norms stay whole)"
    if cfg.dropout > 0:  # the runtime runs it (chimera.tp.random); its attention is not priced
        return (f"dropout {cfg.dropout} (under TP the attention's dropout runs unfused, its "
                "masks from the TP streams, which the planner does not price)")
    for what, n in (("heads", cfg.n_head), ("key/value heads", cfg.kv_heads),
                    ("MLP width", cfg.ffn_width)):
        if n % t:
            return f"T={t} does not divide the {n} {what}"
    return None


def placement_problem(cfg: ModelConfig, t: int, gpus: int, per_node: int) -> str | None:
    """Why T = ``t`` is not searched on ``gpus`` GPUs, ``per_node`` a node, or None."""
    if per_node % t:
        return f"T={t} does not divide the {per_node} GPUs per node (TP stays inside a node)"
    if gpus % t:
        return f"T={t} does not divide P={gpus}"
    return tp_problem(cfg, t)


def tensor_sizes(cfg: ModelConfig, gpus: int, per_node: int) -> tuple[int, ...]:
    """Every T the search tries: the divisors of the GPUs per node that the model and P allow."""
    return tuple(t for t in range(1, per_node + 1) if placement_problem(cfg, t, gpus, per_node) is None)


def padded_vocab(cfg: ModelConfig, t: int) -> int:
    """The vocabulary rounded up to a multiple of T (the runtime pads its sharded tables)."""
    return -(-cfg.vocab_size // t) * t


def compute_divisor(cfg: ModelConfig, t: int) -> list[int]:
    """Per layer of the flat list, what its compute is divided by at T (module docstring)."""
    return [1] + [t] * cfg.n_layer + [t]


def rank_param_counts(cfg: ModelConfig, t: int) -> list[int]:
    """Parameters one TP rank holds per layer: its slice of the sharded ones, and the
    replicated ones whole (norms, row-parallel biases, GPT-2's position table)."""
    if t == 1:
        return layer_param_counts(cfg)
    c, f, rows = cfg.d_model, cfg.ffn_width, padded_vocab(cfg, t) // t
    if cfg.kind == "llama":
        kv = c // cfg.n_head * cfg.kv_heads
        block = (2 * c * c + 2 * c * kv + 3 * c * f) // t + 2 * c
        return [rows * c] + [block] * cfg.n_layer + [c + rows * c]
    # GPT-2: qkv (3C^2 + 3C) and fc (FC + F) column-parallel, proj (C^2) and fc2 (FC)
    # row-parallel; the two row-parallel biases and the two LayerNorms (6C) replicated
    block = (3 * c * c + 3 * c + c * c + 2 * f * c + f) // t + 6 * c
    return [rows * c + cfg.seq_len * c] + [block] * cfg.n_layer + [2 * c + rows * c]


def collective_times(cfg: ModelConfig, tokens: float, precision: str, t: int,
                     link: Link) -> tuple[list[float], list[float]]:
    """(forward, backward) seconds of each layer's TP collectives for ``tokens`` tokens."""
    n = cfg.n_layers_total
    if t == 1:
        return [0.0] * n, [0.0] * n
    e = ACT_BYTES[precision]
    hidden = link.allreduce(tokens * cfg.d_model * e, t)
    stats = max(e, 4)  # the loss upcasts half-precision logits to float32
    loss = link.allreduce(tokens * stats, t) + link.allreduce(2 * tokens * stats, t)
    return ([hidden] + [2 * hidden] * cfg.n_layer + [loss],
            [0.0] + [2 * hidden] * cfg.n_layer + [hidden])
