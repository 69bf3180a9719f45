"""Tensor-parallel plans of chimera's presets: which submodules of each layer are sharded.

GPT-2: the token embedding by vocabulary (the position table stays whole), each block
Megatron-style (fused qkv and the MLP's first projection column-parallel, the projections
back row-parallel: one allreduce per sub-block each way), the head column-parallel over the
vocabulary (its logits kept sharded for the vocab-parallel loss), the dropouts drawn from the
TP random streams (``chimera.tp.random``). BERT: the same block plan (its blocks hold the same
submodules), the MLM head's decoder by vocabulary.
"""

from __future__ import annotations

from torch import nn

from chimera.errors import UserError
from chimera.models.bert import BertBlock, BertEmbedding, BertHead
from chimera.models.gpt2 import GPT2Block, GPT2Head, TokenPositionEmbedding
from chimera.tp import Dropout, embedding_plan, gpt2_block_plan, head_plan


def gpt2_tp_plan(index: int, layer: nn.Module) -> dict | None:
    """The plan of layer ``index`` of a GPT-2 preset (``ModelOptions(tp_plan=gpt2_tp_plan)``)."""
    if isinstance(layer, TokenPositionEmbedding):  # its dropout on the replicated sum
        return {**embedding_plan("tok"), "drop": Dropout("replicated")}
    if isinstance(layer, GPT2Block):
        return gpt2_block_plan()
    if isinstance(layer, GPT2Head):
        return head_plan("lm_head")
    raise UserError(f"tensor parallel: layer {index} ({type(layer).__name__}) is not a GPT-2 "
                    "layer this plan knows")


def bert_tp_plan(index: int, layer: nn.Module) -> dict | None:
    """The plan of layer ``index`` of a BERT preset (``models.bert``): the embedding as GPT-2's
    (its LayerNorm on the replicated sum, whole); each post-LN block as GPT-2's (the same
    submodules, attention bidirectional); the MLM head's decoder column-parallel over the
    vocabulary (its bias cut with its rows), its dense transform and LayerNorm whole."""
    if isinstance(layer, BertEmbedding):
        return {**embedding_plan("tok"), "drop": Dropout("replicated")}
    if isinstance(layer, BertBlock):
        return gpt2_block_plan()
    if isinstance(layer, BertHead):
        return head_plan("decoder")
    raise UserError(f"tensor parallel: layer {index} ({type(layer).__name__}) is not a BERT "
                    "layer this plan knows")


PLANS = {"gpt2": gpt2_tp_plan, "bert": bert_tp_plan}


def preset_tp_plan(kind: str, name: str):
    """The plan of a preset of ``kind``."""
    if kind in PLANS:
        return PLANS[kind]
    raise UserError(f"--tensor-parallel: {name} ({kind}) has no tensor-parallel plan yet; "
                    "GPT-2 and BERT presets and Hugging Face GPT-2, Llama, Qwen2, Mistral, Qwen3, "
                    "Gemma and Phi-3 models have one")
