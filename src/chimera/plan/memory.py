"""Memory per rank: weights, gradients, AdamW state and activations, in bytes (no torch).

Activations per layer follow Korthikanti et al., "Reducing Activation Recomputation in
Large Transformer Models" (2022), Sec. 4.1: a transformer layer keeps ``sbh(34 + 5as/h)``
bytes for a micro-batch of b sequences of length s (16-bit activations, 1-byte dropout
masks, no tensor parallelism). We count the same tensors for e-byte activations: 16 e-byte
``sbh`` tensors (LayerNorm, QKV, Q/K/V, projection and MLP inputs, the 4h GELU input and
output), the ``a s^2 b`` softmax output, and with dropout two 1-byte ``sbh`` masks plus an
``a s^2 b`` mask and dropped-out copy. With e = 2 and dropout that is exactly 34 and 5.
Flash attention keeps no ``s^2`` tensor (its row statistics are negligible and ignored).
A Llama-style block (``LlamaConfig``) keeps K and V at the key/value heads' width and four
SwiGLU tensors of the MLP's width (gate and up outputs, the activation, their product).

With tensor parallelism over T ranks (Megatron's, without sequence parallelism; Korthikanti
Sec. 4.2.1: ``sbh(10 + 24/t + 5as/(ht))``) the tensors inside a sub-block are sharded and
divided by T: Q, K, V, the attention output, the MLP's hidden tensors and the ``s^2`` scores
and their masks; the four e-byte tensors at the sub-blocks' edges (both LayerNorm inputs, the
qkv input and the MLP input) and the 1-byte dropout masks of the sub-blocks' outputs stay
whole on every rank. With e = 2 and dropout: 10 whole and 24/t.

With recomputation a stage keeps only its input per micro-batch (``sbh`` e-byte, or the
token ids for the first stage) and rebuilds one micro-batch's activations during its
backward: that one full stage's worth is added once (Korthikanti's "full recomputation").
Temporary buffers of a single kernel and gradient buffers of activations are not counted.

Training state per parameter: fp32 keeps weights, gradients and AdamW's two moments (4 + 4
+ 8 bytes); mixed precision keeps 16-bit weights and gradients plus fp32 master weights and
moments (2 + 2 + 12). Every stage replica a rank holds has its own state (Chimera: 2, Q
pipes: Q); PipeDream stashes extra *weight* versions (not gradients or moments).
"""

from __future__ import annotations

from dataclasses import dataclass

from chimera.ir import Op, Schedule, GRADIENT_ENDS
from chimera.modelcfg import ModelConfig

ACT_BYTES = {"fp32": 4, "mixed": 2}
# (weights, gradients, optimizer state) bytes per parameter
STATE_BYTES = {"fp32": (4, 4, 8), "mixed": (2, 2, 12)}


def block_activation_bytes(cfg: ModelConfig, tokens: float, precision: str, flash: bool,
                           tensor: int = 1) -> float:
    """Bytes one transformer block keeps for backward, for ``tokens`` = b * s tokens, on one
    of ``tensor`` TP ranks (module docstring: which tensors TP divides)."""
    e, h, a, s = ACT_BYTES[precision], cfg.d_model, cfg.n_head, cfg.seq_len
    dropout = cfg.dropout > 0
    kv = h // a * cfg.kv_heads  # the width of K and of V
    whole = 4 * h  # the two norms' inputs, the inputs of qkv and of the MLP's first product
    mlp = (4 if cfg.gated else 2) * cfg.ffn_width  # SwiGLU: gate, up, act, product; GELU: in, out
    split = 2 * h + 2 * kv + mlp  # Q, the attention output (out-projection input), K, V, MLP
    per_token = e * (whole + split / tensor) + (2 * h if dropout else 0)  # 1-byte masks: whole
    scores = 0.0 if flash else a * s * (e + (e + 1 if dropout else 0)) / tensor  # a*s*s*b / (s*b)
    return tokens * (per_token + scores)


def layer_activation_bytes(cfg: ModelConfig, tokens: float, precision: str, flash: bool,
                           tensor: int = 1) -> list[float]:
    """Bytes each layer of the flat list keeps for backward (no recomputation); at T > 1 a
    block's per ``block_activation_bytes``, the embedding's whole, the head's inputs whole and
    its logits 1/T of the (padded) vocabulary (the vocab-parallel cross-entropy keeps them
    sharded)."""
    e, h, v = ACT_BYTES[precision], cfg.d_model, -(-cfg.vocab_size // tensor)
    mask = 1 if cfg.dropout > 0 else 0
    embed = tokens * (8 + h * (e * (2 if cfg.kind == "bert" else 1) + mask))  # ids, sum, (LN in)
    # head: inputs of its LayerNorm and matmul(s) (BERT: dense, GELU, LN, decoder), and the
    # fp32 logits the cross entropy differentiates
    head = tokens * (h * e * (4 if cfg.kind == "bert" else 2) + 4 * v)
    block = block_activation_bytes(cfg, tokens, precision, flash, tensor)
    return [embed] + [block] * cfg.n_layer + [head]


def layer_input_bytes(cfg: ModelConfig, tokens: float, precision: str) -> list[float]:
    """Bytes of each layer's input: token ids for the embedding, else one hidden state."""
    hidden = tokens * cfg.d_model * ACT_BYTES[precision]
    return [tokens * 8] + [hidden] * (cfg.n_layers_total - 1)


def state_bytes(params: float, precision: str, weight_versions: int = 1, shards: int = 1) -> float:
    """Weights (times ``weight_versions``), gradients and AdamW state of ``params`` parameters;
    with a sharded optimizer (``--shard-optimizer``) the AdamW state is split over ``shards``
    replicas (a reduce-scatter output of 1/shards of the gradients is small and not counted)."""
    w, g, o = STATE_BYTES[precision]
    return params * (w * weight_versions + g + o / shards)


@dataclass(frozen=True)
class HeldActivations:
    """Per rank, the distinct (stage -> micro-batches held) states at which memory peaks.

    Depends only on the program order, so one schedule shape is walked once and then priced
    for any bytes-per-stage quickly: peak bytes = max over states of sum(count * bytes).
    """

    states: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]  # [rank][state] = ((stage, n), ...)
    stages: tuple[tuple[int, ...], ...]  # [rank] = stages the rank computes

    @classmethod
    def of(cls, schedule: Schedule) -> "HeldActivations":
        frees = GRADIENT_ENDS
        states, stages = [], []
        for prog in schedule.programs:
            held: dict[int, int] = {}
            peaks: set[tuple[tuple[int, int], ...]] = set()
            prev_f = False
            for a in prog:
                if a.op is Op.F:
                    held[a.stage] = held.get(a.stage, 0) + 1
                    prev_f = True
                elif a.op in frees:
                    if prev_f:  # a local maximum just ended
                        peaks.add(tuple(sorted(held.items())))
                    held[a.stage] -= 1
                    prev_f = False
            if prev_f:
                peaks.add(tuple(sorted(held.items())))
            states.append(tuple(_pareto(peaks)))
            stages.append(tuple(sorted({a.stage for a in prog if a.op.is_compute})))
        return cls(tuple(states), tuple(stages))

    def peak(self, rank: int, per_stage: list[float]) -> float:
        """Peak activation bytes of ``rank`` given bytes per *schedule* micro-batch per stage
        (half a micro-batch with backward halving)."""
        return max((sum(n * per_stage[s] for s, n in state) for state in self.states[rank]),
                   default=0.0)


def _pareto(states: set) -> list:
    """Drop states dominated by another (held no more of every stage): they never peak."""
    dicts = [dict(s) for s in states]
    keep = []
    for i, d in enumerate(dicts):
        dominated = any(j != i and all(o.get(k, 0) >= n for k, n in d.items()) and o != d
                        for j, o in enumerate(dicts))
        if not dominated:
            keep.append(tuple(sorted(d.items())))
    return sorted(keep)
