"""Plans: which submodule of a layer is sharded how, written as torch and HF write them.

A plan maps a submodule name pattern (``fnmatch``, relative to one layer: ``"attn.qkv"``,
``"self_attn.q_proj"``, ``"*.c_fc"``) to an entry of ours (``styles``), one of HF's
``base_model_tp_plan`` strings, or a torch ``ParallelStyle``: ``ColwiseParallel()`` and
``RowwiseParallel()`` with their default layouts, and ``PrepareModuleInput`` that keeps a
sub-block's input replicated (read as a shared input). Every built-in plan pairs a
column-parallel projection with a row-parallel one, so a transformer block takes its input
replicated and returns its output replicated, as a plain tensor: one allreduce per sub-block
(attention, MLP) each way, and a pipeline stage boundary is the same tensor it is without TP.

The built-in plans name the submodules of chimera's GPT-2 block, HF's GPT-2 block and HF's
Llama decoder layer by strings only: those model packages sit above tp in the layers.
"""

from __future__ import annotations

import sys
from typing import Mapping, Union

import torch
import torch.nn.functional as F

from chimera.errors import UserError
from chimera.tp.styles import (Colwise, Dropout, EmbeddingRowwise, LocalHeads, Replicated, Rowwise,
                               SharedInput, VocabHead)

Entry = Union[Colwise, Rowwise, EmbeddingRowwise, VocabHead, Replicated, LocalHeads, SharedInput, Dropout]
# A value may also be a tuple of entries, applied in order (an attention module may need a
# shared input and its local head count both).
Plan = Mapping[str, Union[Entry, "ParallelStyle", str, tuple]]  # noqa: F821 (torch's, lazily)
# torch's styles: a plan holds one only once its module is imported, which is not done here (it
# costs seconds of start-up, chimera generate's among them, and only reads a user's plan)
TORCH_STYLES = "torch.distributed.tensor.parallel"
ENTRIES = (Colwise, Rowwise, EmbeddingRowwise, VocabHead, Replicated, LocalHeads, SharedInput, Dropout)

# HF's strings (transformers.distributed.tensor_parallel) that keep a block's boundary plain,
# as entries of ours. Others (sequence_parallel, moe_*, ...) are refused.
HF_STYLES = {
    "colwise": lambda: Colwise(),
    "rowwise": lambda: Rowwise(),
    "colwise_rep": lambda: Colwise(gather_output=True),
    "colwise_gather_output": lambda: Colwise(gather_output=True),
    "rowwise_rep": lambda: Rowwise(split_input=True),
    "rowwise_split_input": lambda: Rowwise(split_input=True),
    "packed_colwise": lambda: Colwise(parts=2),
    "embedding_rowwise": lambda: EmbeddingRowwise(),
    "replicate": lambda: Replicated(),
}


def styles(value) -> tuple[Entry, ...]:
    """A plan's value as the entries it applies, in order."""
    return tuple(style(v) for v in value) if isinstance(value, tuple) else (style(value),)


def style(value) -> Entry:
    """One plan value as an entry of ours (an HF string or a torch style read, ours as it is)."""
    if isinstance(value, ENTRIES):
        return value
    if isinstance(value, str) and value in HF_STYLES:
        return HF_STYLES[value]()
    torch_styles = sys.modules.get(TORCH_STYLES)
    if torch_styles is not None and isinstance(value, torch_styles.ParallelStyle):
        return _from_torch(value)
    raise UserError(f"tensor parallel: unsupported plan entry {value!r}; use a torch ParallelStyle "
                    f"or one of {', '.join(sorted(HF_STYLES))}")


def _from_torch(value) -> Entry:
    """torch's style (a ``ParallelStyle``) as ours, where ours does the same: the default
    column-/row-wise layouts, a replicated sub-block input. DTensor layouts ours do not keep
    are refused."""
    from torch.distributed.tensor.parallel import (  # start-up time: only a plan of torch's styles
        ColwiseParallel, PrepareModuleInput, RowwiseParallel)

    kind = type(value)
    if kind in (ColwiseParallel, RowwiseParallel):
        default = kind()
        if all(getattr(value, a) == getattr(default, a)
               for a in ("input_layouts", "output_layouts", "use_local_output")):
            return Colwise() if kind is ColwiseParallel else Rowwise()
        raise UserError(f"tensor parallel: {kind.__name__} with other than its default layouts is not "
                        f"supported (a block's input and output stay replicated and plain)")
    if kind is PrepareModuleInput and _replicated(value):
        kwargs = list(value.input_kwarg_layouts)
        return SharedInput(kwargs[0] if kwargs else None)
    raise UserError(f"tensor parallel: unsupported torch style {kind.__name__}; use ColwiseParallel(), "
                    f"RowwiseParallel(), a replicated PrepareModuleInput or one of {', '.join(sorted(HF_STYLES))}")


def _replicated(value) -> bool:
    """One input of a ``PrepareModuleInput``, replicated before and after (positional or one
    keyword)."""
    from torch.distributed.tensor import Replicate  # start-up time: as _from_torch

    layouts = [*(value.input_layouts or ()), *(value.desired_input_layouts or ()),
               *value.input_kwarg_layouts.values(), *value.desired_input_kwarg_layouts.values()]
    inputs = len(value.input_layouts or ()) + len(value.input_kwarg_layouts)
    return inputs == 1 and all(isinstance(p, Replicate) for p in layouts)


def shared_input(kwarg: str | None = None) -> SharedInput:
    """On a sub-block (attention, MLP) whose input feeds several column-parallel projections
    (q, k, v; gate, up): one allreduce of that input's gradient for them all (``SharedInput``).
    ``kwarg``: the input's keyword where the caller passes it by name."""
    return SharedInput(kwarg)


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
def _local_heads_attention(self, x, mask=None):
    """chimera's ``SelfAttention.forward`` on this rank's heads: q, k, v are the three equal
    blocks of the sharded qkv output, C/T wide each, with n_head/T heads; ``mask``: (B, 1, S,
    S) bool, packed documents kept apart (``chimera.models.packing``), else causal."""
    B, S, _ = x.shape
    q, k, v = self.qkv(x).chunk(3, dim=2)                    # 3 x (B, S, C/T)
    q, k, v = (t.view(B, S, self.n_head, -1).transpose(1, 2)
               for t in (q, k, v))                           # (B, H/T, S, C/H)
    if self.training and self.dropout > 0:
        y = _attention_with_dropout(q, k, v, self.causal, self.dropout, self.tp_random, mask)
    else:
        y = F.scaled_dot_product_attention(                  # (B, H/T, S, C/H)
            q, k, v, attn_mask=mask, is_causal=self.causal and mask is None)
    y = y.transpose(1, 2).reshape(B, S, -1)                  # (B, S, C/T)
    return self.resid_drop(self.proj(y))                     # (B, S, C): allreduced


def _attention_with_dropout(q, k, v, causal: bool, p: float, random, mask=None) -> "torch.Tensor":
    """SDPA's arithmetic written out, its probabilities' dropout drawn from this rank's
    sharded stream (``chimera.tp.random``: these are this rank's heads only); ``mask``: what
    a query sees (True), else causal."""
    S = q.shape[-2]
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5   # (B, H/T, S, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif causal:
        future = torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    probs = random.dropout(scores.softmax(-1), p, "sharded")
    return probs @ v                                         # (B, H/T, S, C/H)


def gpt2_block_plan() -> dict:
    """chimera's ``GPT2Block`` (``models.gpt2``): fused qkv split by Q/K/V head blocks; its
    dropouts drawn from the TP streams (the residual ones after row-parallel projections
    replicated, the attention probabilities of this rank's heads sharded)."""
    return {"attn.qkv": Colwise(parts=3), "attn.proj": Rowwise(),
            "mlp.fc": Colwise(), "mlp.proj": Rowwise(),
            "attn.resid_drop": Dropout("replicated"), "mlp.drop": Dropout("replicated"),
            "attn": LocalHeads(heads="n_head", divide=("n_head",), forward=_local_heads_attention,
                               dropout="dropout")}


# -- HF GPT-2 ------------------------------------------------------------------------------
def hf_gpt2_block_plan() -> dict:
    """HF's ``GPT2Block``: Conv1D projections, fused ``c_attn`` split by Q/K/V head blocks;
    its attention splits c_attn's output at ``split_size`` and counts ``num_heads``. Its
    residual dropouts (after the row-parallel projections) draw from the replicated stream;
    the attention probabilities' (``attn_pdrop``, HF's attention functions draw it from
    torch's global RNG) is not routed: refused above 0."""
    return {"attn.c_attn": Colwise(parts=3), "attn.c_proj": Rowwise(),
            "mlp.c_fc": Colwise(), "mlp.c_proj": Rowwise(),
            "attn.resid_dropout": Dropout("replicated"), "mlp.dropout": Dropout("replicated"),
            "attn": LocalHeads(heads="num_heads", divide=("num_heads", "split_size"))}


# -- embeddings and heads (the names of chimera's and of chimera.hf's layers) --------------
def embedding_plan(name: str) -> dict:
    """The token embedding ``name`` (``"tok"``: chimera GPT-2; ``"wte"``: HF GPT-2;
    ``"embed_tokens"``: HF Llama) sharded by vocabulary."""
    return {name: EmbeddingRowwise()}


def head_plan(name: str = "lm_head", logits: str = "auto") -> dict:
    """The LM head ``name`` column-parallel over the vocabulary; its logits gathered, or
    kept sharded where the loss takes them (``logits``: see ``VocabHead``)."""
    return {name: VocabHead(logits)}
