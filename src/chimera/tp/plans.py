"""Plans: which submodule of a layer is sharded how, written as torch and HF write them.

A plan maps a submodule name pattern (``fnmatch``, relative to one layer: ``"attn.qkv"``,
``"self_attn.q_proj"``, ``"*.c_fc"``) to a torch ``ParallelStyle`` or one of HF's
``base_model_tp_plan`` strings. Every built-in plan pairs a column-parallel projection with
a row-parallel one, so a transformer block takes its input replicated and returns its output
replicated, as a plain tensor: one allreduce per sub-block (attention, MLP), and a pipeline
stage boundary is the same tensor it is without TP.

The built-in plans name the submodules of chimera's GPT-2 block, HF's GPT-2 block and HF's
Llama decoder layer by strings only: those model packages sit above tp in the layers.
"""

from __future__ import annotations

from typing import Mapping, Union

import torch.nn.functional as F
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput

from chimera.errors import UserError
from chimera.tp.styles import Colwise, LocalHeads, Replicated, Rowwise
from chimera.tp.vocab import VocabEmbedding, VocabHead

Entry = Union[ParallelStyle, str]
# A value may also be a tuple of styles, applied in order (torch takes one per module; an
# attention module may need a shared input and its local head count both).
Plan = Mapping[str, Union[Entry, tuple]]

# HF's strings (transformers.distributed.tensor_parallel) that keep a block's boundary plain,
# as styles of ours (which also take HF's Conv1D). Others (sequence_parallel, moe_*, ...)
# are refused.
HF_STYLES = {
    "colwise": lambda: Colwise(),
    "rowwise": lambda: Rowwise(),
    "colwise_rep": lambda: Colwise(output_layouts=Replicate()),
    "colwise_gather_output": lambda: Colwise(output_layouts=Replicate()),
    "rowwise_rep": lambda: Rowwise(input_layouts=Replicate()),
    "rowwise_split_input": lambda: Rowwise(input_layouts=Replicate()),
    "packed_colwise": lambda: Colwise(parts=2),
    "embedding_rowwise": lambda: VocabEmbedding(),
    "replicate": lambda: Replicated(),
}


def styles(value) -> tuple[ParallelStyle, ...]:
    """A plan's value as the styles it applies, in order."""
    return tuple(style(v) for v in value) if isinstance(value, tuple) else (style(value),)


def style(value) -> ParallelStyle:
    """One plan value as a ParallelStyle (an HF string mapped, a style as it is)."""
    if isinstance(value, ParallelStyle):
        return value
    if isinstance(value, str) and value in HF_STYLES:
        return HF_STYLES[value]()
    raise UserError(f"tensor parallel: unsupported plan entry {value!r}; use a torch ParallelStyle "
                    f"or one of {', '.join(sorted(HF_STYLES))}")


def shared_input(kwarg: str | None = None) -> PrepareModuleInput:
    """On a sub-block (attention, MLP) whose input feeds several column-parallel projections
    (q, k, v; gate, up): the replicated input becomes one DTensor at the sub-block's entry,
    so the projections' input gradients add up locally and are allreduced once (per
    projection otherwise: 5 allreduces in a Llama layer's backward instead of 2).
    ``kwarg``: the input's keyword where the caller passes it by name."""
    if kwarg is None:
        return PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
    return PrepareModuleInput(input_kwarg_layouts={kwarg: Replicate()},
                              desired_input_kwarg_layouts={kwarg: Replicate()})


def from_hf(hf_plan: Mapping[str, str], prefix: str) -> dict[str, str]:
    """The entries of an HF ``base_model_tp_plan`` under ``prefix`` (``"layers.*."``),
    relative to one layer: ``{"layers.*.mlp.up_proj": "colwise"}`` -> ``{"mlp.up_proj": ...}``."""
    return {key[len(prefix):]: value for key, value in hf_plan.items() if key.startswith(prefix)}


def prefixed(plan: Plan, prefix: str) -> dict:
    """``plan`` for the layer that holds its module at ``prefix`` (``"layer."``: chimera.hf's
    LlamaBlock holds the decoder layer as ``layer``, its GPT2Block the HF block as ``block``)."""
    return {prefix + key: value for key, value in plan.items()}


# -- HF Llama ------------------------------------------------------------------------------
# LlamaConfig.base_model_tp_plan in transformers 5.x, as written there (the tests compare).
HF_LLAMA_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


def llama_decoder_plan() -> dict:
    """A ``LlamaDecoderLayer``: HF's own plan, plus one shared input per sub-block. Its
    attention stores no head count of its own (it reshapes to (..., -1, head_dim), and the
    GQA ratio is the same on every rank); the entry on ``self_attn`` checks that T divides
    the query and the key/value heads."""
    heads = LocalHeads(heads="config.num_attention_heads", kv_heads="config.num_key_value_heads")
    return {**from_hf(HF_LLAMA_TP_PLAN, "layers.*."),
            "self_attn": (heads, shared_input("hidden_states")), "mlp": shared_input()}


# -- chimera's GPT-2 -----------------------------------------------------------------------
def _local_heads_attention(self, x):
    """chimera's ``SelfAttention.forward`` on this rank's heads: its own forward splits the
    fused qkv at the input's width C, which stays full under TP; here q, k, v are the three
    equal blocks of the sharded output, C/T wide each, with n_head/T heads."""
    B, S, _ = x.shape
    q, k, v = self.qkv(x).chunk(3, dim=2)                    # 3 x (B, S, C/T)
    q, k, v = (t.view(B, S, self.n_head, -1).transpose(1, 2)
               for t in (q, k, v))                           # (B, H/T, S, C/H)
    y = F.scaled_dot_product_attention(
        q, k, v, is_causal=self.causal,
        dropout_p=self.dropout if self.training else 0.0)    # (B, H/T, S, C/H)
    y = y.transpose(1, 2).reshape(B, S, -1)                  # (B, S, C/T)
    return self.resid_drop(self.proj(y))                     # (B, S, C): allreduced


def gpt2_block_plan() -> dict:
    """chimera's ``GPT2Block`` (``models.gpt2``): fused qkv split by Q/K/V head blocks."""
    return {"attn.qkv": Colwise(parts=3), "attn.proj": Rowwise(),
            "mlp.fc": Colwise(), "mlp.proj": Rowwise(),
            "attn": LocalHeads(heads="n_head", divide=("n_head",), forward=_local_heads_attention)}


# -- HF GPT-2 ------------------------------------------------------------------------------
def hf_gpt2_block_plan() -> dict:
    """HF's ``GPT2Block``: Conv1D projections, fused ``c_attn`` split by Q/K/V head blocks;
    its attention splits c_attn's output at ``split_size`` and counts ``num_heads``."""
    return {"attn.c_attn": Colwise(parts=3), "attn.c_proj": Rowwise(),
            "mlp.c_fc": Colwise(), "mlp.c_proj": Rowwise(),
            "attn": LocalHeads(heads="num_heads", divide=("num_heads", "split_size"))}


# -- embeddings and heads (the names of chimera's and of chimera.hf's layers) --------------
def embedding_plan(name: str) -> dict:
    """The token embedding ``name`` (``"tok"``: chimera GPT-2; ``"wte"``: HF GPT-2;
    ``"embed_tokens"``: HF Llama) sharded by vocabulary."""
    return {name: VocabEmbedding()}


def head_plan(name: str = "lm_head") -> dict:
    """The LM head ``name`` column-parallel over the vocabulary, its logits gathered."""
    return {name: VocabHead()}
