"""Plans and their refusals (chimera.tp), in one process: each refusal is one line, and
comes before any parameter is touched."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel

from chimera import tp
from chimera.errors import UserError


def _gpt2_block(d_model: int = 16, n_head: int = 4):
    from chimera.models.gpt2 import GPT2Block, ModelConfig, make_layer
    return make_layer(GPT2Block, ModelConfig("gpt2", n_layer=1, d_model=d_model, n_head=n_head, seq_len=8), 0, 0)


def _llama_layer(**overrides):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    config = transformers.LlamaConfig(**{"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 4,
                                         "num_key_value_heads": 2, "num_hidden_layers": 1, **overrides})
    return LlamaDecoderLayer(config, 0)


def _hf_gpt2_block():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    return GPT2Block(transformers.GPT2Config(n_embd=16, n_head=4, n_layer=1), layer_idx=0)


def _refused(layer, plan, t: int) -> str:
    with pytest.raises(UserError) as info:
        tp.resolve(layer, plan, t)
    message = str(info.value)
    assert "\n" not in message and message.startswith("tensor parallel: "), message
    return message


def test_hf_llama_plan_is_hfs_own():
    transformers = pytest.importorskip("transformers")
    assert tp.HF_LLAMA_TP_PLAN == transformers.LlamaConfig.base_model_tp_plan
    plan = tp.llama_decoder_plan()
    assert {k: v for k, v in plan.items() if isinstance(v, str)} == tp.from_hf(tp.HF_LLAMA_TP_PLAN, "layers.*.")


@pytest.mark.parametrize("build, plan", [(_gpt2_block, tp.gpt2_block_plan), (_llama_layer, tp.llama_decoder_plan),
                                         (_hf_gpt2_block, tp.hf_gpt2_block_plan)])
def test_the_built_in_plans_resolve_for_two_ranks(build, plan):
    resolved = tp.resolve(build(), plan(), 2)
    assert all(isinstance(s, tuple) and s for s in resolved.values())
    assert len(resolved) == len(plan())


def test_hf_strings_map_to_styles_and_others_are_refused():
    assert isinstance(tp.style("colwise"), tp.Colwise) and isinstance(tp.style("rowwise"), tp.Rowwise)
    assert tp.style("packed_colwise").parts == 2
    assert isinstance(tp.style("embedding_rowwise"), tp.VocabEmbedding)
    with pytest.raises(UserError, match="unsupported plan entry 'sequence_parallel'; .*colwise, "
                                        "colwise_gather_output, colwise_rep"):
        tp.style("sequence_parallel")
    _refused(_gpt2_block(), {"mlp.fc": "moe_tp_experts"}, 2)


def test_a_pattern_that_matches_nothing_is_refused():
    message = _refused(_gpt2_block(), {**tp.gpt2_block_plan(), "attn.q_proj": "colwise"}, 2)
    assert "'attn.q_proj' matches no submodule of GPT2Block" in message


def test_a_module_claimed_by_two_patterns_is_refused():
    message = _refused(_gpt2_block(), {"mlp.fc": "colwise", "*.fc": "colwise"}, 2)
    assert "mlp.fc is matched by both 'mlp.fc' and '*.fc'" in message


@pytest.mark.parametrize("build, plan, t, says", [
    (lambda: _gpt2_block(d_model=12, n_head=3), tp.gpt2_block_plan, 2,
     "attn (SelfAttention): T=2 does not divide the 3 heads (n_head)"),
    (_llama_layer, tp.llama_decoder_plan, 4,
     "self_attn (LlamaAttention): T=4 does not divide the 2 key/value heads (config.num_key_value_heads)"),
    (lambda: _llama_layer(intermediate_size=33), tp.llama_decoder_plan, 2,
     "mlp.gate_proj (Linear): T=2 does not divide the output width 33"),
    (lambda: _gpt2_block(d_model=18, n_head=6), tp.gpt2_block_plan, 4,
     "attn.qkv (Linear): T=4 does not divide the output width 54 in 3 parts"),
    (_hf_gpt2_block, lambda: {"mlp.c_fc": ColwiseParallel()}, 2, "torch's styles do not take HF's Conv1D"),
    (lambda: nn.ModuleDict({"tok": nn.Embedding(37, 8)}), lambda: {"tok": tp.VocabHead()}, 2,
     "tok (Embedding): VocabHead takes an nn.Linear"),
    (_llama_layer, tp.gpt2_block_plan, 2, "matches no submodule"),
    (_llama_layer, lambda: {"self_attn": tp.LocalHeads(heads="n_head", divide=("split_size",))}, 2,
     "self_attn (LlamaAttention): LocalHeads: the module has no n_head, split_size"),
    (lambda: nn.ModuleDict({"tok": nn.Embedding(37, 8, scale_grad_by_freq=True)}),
     lambda: tp.embedding_plan("tok"), 2, "does not take max_norm, scale_grad_by_freq or sparse"),
])
def test_what_t_cannot_split_is_refused(build, plan, t, says):
    assert says in _refused(build(), plan(), t)


def test_a_refused_plan_leaves_the_layer_untouched():
    """parallelize checks the whole plan before it shards anything: the good entries of a
    plan that fails at its last one changed nothing (no mesh collective is ever reached)."""
    layer = _gpt2_block(d_model=12, n_head=3)
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    mesh = types.SimpleNamespace(ndim=1, size=lambda: 2)  # refused before a collective could run
    with pytest.raises(UserError, match="does not divide the 3 heads"):
        tp.parallelize(layer, tp.gpt2_block_plan(), mesh)
    after = dict(layer.named_parameters())
    assert all(type(after[n]) is nn.Parameter and torch.equal(after[n], p) for n, p in before.items())
    assert layer.attn.n_head == 3


def test_t_must_be_a_positive_integer_and_the_mesh_1d():
    _refused(_gpt2_block(), tp.gpt2_block_plan(), 0)
    with pytest.raises(UserError, match="must be 1-D"):
        tp.parallelize(_gpt2_block(), tp.gpt2_block_plan(), types.SimpleNamespace(ndim=2, size=lambda: 4))


def test_the_vocabulary_pads_to_a_multiple_of_t():
    assert [tp.padded_size(v, 2) for v in (37, 38)] == [38, 38]
    assert tp.padded_size(50257, 8) == 50264
