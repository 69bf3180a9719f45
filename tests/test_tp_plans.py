"""Plans and their refusals (chimera.tp), in one process: each refusal is one line, and
comes before any parameter is touched."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel)

from chimera import tp
from chimera.errors import UserError


def _gpt2_block(d_model: int = 16, n_head: int = 4, dropout: float = 0.0):
    from chimera.models.gpt2 import GPT2Block, ModelConfig, make_layer
    cfg = ModelConfig("gpt2", n_layer=1, d_model=d_model, n_head=n_head, seq_len=8, dropout=dropout)
    return make_layer(GPT2Block, cfg, 0, 0)


def _llama_layer(**overrides):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    config = transformers.LlamaConfig(**{"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 4,
                                         "num_key_value_heads": 2, "num_hidden_layers": 1, **overrides})
    return LlamaDecoderLayer(config, 0)


def _hf_gpt2_block(**overrides):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    config = transformers.GPT2Config(**{"n_embd": 16, "n_head": 4, "n_layer": 1, "resid_pdrop": 0.0,
                                        "embd_pdrop": 0.0, "attn_pdrop": 0.0, **overrides})
    return GPT2Block(config, layer_idx=0)


def _refused(layer, plan, t: int) -> str:
    with pytest.raises(UserError) as info:
        tp.resolve(layer, plan, t)
    message = str(info.value)
    assert "\n" not in message and message.startswith("tensor parallel: "), message
    return message


def _tied() -> nn.Module:
    layer = nn.ModuleDict({"tok": nn.Embedding(8, 4), "head": nn.Linear(4, 8, bias=False)})
    layer["head"].weight = layer["tok"].weight
    return layer


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


def test_hf_strings_map_to_entries_and_others_are_refused():
    assert tp.style("colwise") == tp.Colwise() and tp.style("rowwise") == tp.Rowwise()
    assert tp.style("packed_colwise") == tp.Colwise(parts=2)
    assert tp.style("colwise_rep") == tp.style("colwise_gather_output") == tp.Colwise(gather_output=True)
    assert tp.style("rowwise_rep") == tp.style("rowwise_split_input") == tp.Rowwise(split_input=True)
    assert tp.style("embedding_rowwise") == tp.EmbeddingRowwise() and tp.style("replicate") == tp.Replicated()
    with pytest.raises(UserError, match="unsupported plan entry 'sequence_parallel'; .*colwise, "
                                        "colwise_gather_output, colwise_rep"):
        tp.style("sequence_parallel")
    _refused(_gpt2_block(), {"mlp.fc": "moe_tp_experts"}, 2)


def test_torch_styles_with_default_layouts_map_to_ours():
    assert tp.style(ColwiseParallel()) == tp.Colwise() and tp.style(RowwiseParallel()) == tp.Rowwise()
    assert tp.style(PrepareModuleInput(input_kwarg_layouts={"hidden_states": Replicate()},
                                       desired_input_kwarg_layouts={"hidden_states": Replicate()})) \
        == tp.SharedInput("hidden_states")
    assert tp.style(PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))) \
        == tp.shared_input()
    # torch's styles take HF's Conv1D here (ours do)
    assert tp.resolve(_hf_gpt2_block(), {"mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}, 2)


@pytest.mark.parametrize("value, says", [
    (ColwiseParallel(output_layouts=Replicate()), "ColwiseParallel with other than its default layouts"),
    (RowwiseParallel(input_layouts=Replicate()), "RowwiseParallel with other than its default layouts"),
    (ColwiseParallel(use_local_output=False), "ColwiseParallel with other than its default layouts"),
    (SequenceParallel(), "unsupported torch style SequenceParallel"),
    (PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
     "unsupported torch style PrepareModuleInput"),
])
def test_torch_styles_ours_cannot_honour_are_refused(value, says):
    assert says in _refused(_gpt2_block(), {"mlp.fc": value}, 2)


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
    (lambda: _gpt2_block(d_model=18, n_head=6), lambda: {"mlp.proj": "rowwise"}, 5,
     "mlp.proj (Linear): T=5 does not divide the input width 72"),
    (lambda: nn.ModuleDict({"tok": nn.Embedding(37, 8)}), lambda: {"tok": tp.VocabHead()}, 2,
     "tok (Embedding): VocabHead takes an nn.Linear"),
    (lambda: nn.ModuleDict({"tok": nn.Embedding(37, 8)}), lambda: {"tok": "colwise"}, 2,
     "a column-wise embedding (its output sharded) is not supported"),
    (lambda: nn.ModuleDict({"n": nn.LayerNorm(8)}), lambda: {"n": "rowwise"}, 2,
     "n (LayerNorm): column/row-wise entries take an nn.Linear or HF Conv1D"),
    (lambda: nn.ModuleDict({"head": nn.Linear(4, 8)}), lambda: {"head": "embedding_rowwise"}, 2,
     "embedding_rowwise takes an nn.Embedding"),
    (_gpt2_block, lambda: {"attn.qkv": tp.Colwise(parts=3, gather_output=True)}, 2,
     "a fused projection's output cannot be gathered"),
    (_gpt2_block, lambda: {"mlp.fc": ("colwise", "rowwise")}, 2, "mlp.fc (Linear): sharded twice"),
    (_llama_layer, tp.gpt2_block_plan, 2, "matches no submodule"),
    (_llama_layer, lambda: {"self_attn": tp.LocalHeads(heads="n_head", divide=("split_size",))}, 2,
     "self_attn (LlamaAttention): LocalHeads: the module has no n_head, split_size"),
    (lambda: nn.ModuleDict({"tok": nn.Embedding(37, 8, scale_grad_by_freq=True)}),
     lambda: tp.embedding_plan("tok"), 2, "does not take max_norm, scale_grad_by_freq or sparse"),
    (lambda: nn.ModuleDict({"tok": nn.Embedding(37, 8, max_norm=1.0)}), lambda: {"tok": RowwiseParallel()}, 2,
     "does not take max_norm"),
    (_tied, lambda: {"tok": "embedding_rowwise"}, 2,
     "tok.weight and head.weight are one Parameter (tied within one layer)"),
])
def test_what_t_cannot_split_is_refused(build, plan, t, says):
    assert says in _refused(build(), plan(), t)


@pytest.mark.parametrize("build, plan, says", [
    (lambda: _hf_gpt2_block(attn_pdrop=0.1), tp.hf_gpt2_block_plan, "(attn.attn_dropout.p=0.1)"),
    (lambda: _llama_layer(attention_dropout=0.2), tp.llama_decoder_plan, "(self_attn.attention_dropout=0.2)"),
])
def test_a_dropout_its_plan_does_not_route_is_refused_under_tp(build, plan, says):
    """HF's attention dropouts are not drawn from the TP streams (chimera.tp.random): refused;
    chimera's GPT-2 plan draws all of its own, HF GPT-2's its residual ones
    (tests/test_tp_dropout.py)."""
    message = _refused(build(), plan(), 2)
    assert says in message and "which its plan does not draw from the TP random streams" in message
    tp.resolve(build(), plan(), 1)  # one rank: the one process's arithmetic
    tp.resolve(_gpt2_block(dropout=0.1), tp.gpt2_block_plan(), 2)  # routed: taken
    tp.resolve(_hf_gpt2_block(resid_pdrop=0.1), tp.hf_gpt2_block_plan(), 2)


def _never(*args, **kwargs):
    raise AssertionError("a collective ran")


def test_a_refused_plan_leaves_the_layer_untouched():
    """parallelize checks the whole plan before it shards anything: the good entries of a
    plan that fails at its last one changed nothing (no collective is ever reached)."""
    layer = _gpt2_block(d_model=12, n_head=3)
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    group = tp.TPGroup(_never, None, 0, 2)
    with pytest.raises(UserError, match="does not divide the 3 heads"):
        tp.parallelize(layer, tp.gpt2_block_plan(), group)
    after = dict(layer.named_parameters())
    assert all(torch.equal(after[n], p) and tp.shard_of(after[n]) is None for n, p in before.items())
    assert layer.attn.n_head == 3 and type(layer.attn.qkv) is nn.Linear


def test_sharding_needs_no_communication_and_a_layer_is_sharded_once():
    layer = _gpt2_block()
    tp.parallelize(layer, tp.gpt2_block_plan(), tp.TPGroup(_never, None, 1, 2))
    assert isinstance(layer.attn.qkv, tp.ColumnParallel) and isinstance(layer.mlp.proj, tp.RowParallel)
    assert layer.attn.qkv.weight.shape == (24, 16) and layer.mlp.proj.weight.shape == (16, 32)
    assert _refused(layer, tp.gpt2_block_plan(), 2).endswith("already sharded (parallelize a layer once)")


def test_one_rank_keeps_the_layer_as_it_is():
    layer = _gpt2_block()
    modules = dict(layer.named_modules())
    assert tp.parallelize(layer, tp.gpt2_block_plan(), tp.TPGroup(_never, None, 0, 1)) is layer
    assert dict(layer.named_modules()) == modules
    with pytest.raises(UserError, match="matches no submodule"):  # the plan is still checked
        tp.parallelize(layer, {"nothing": "colwise"}, tp.TPGroup(_never, None, 0, 1))


def test_a_copy_of_a_sharded_layer_keeps_its_shards():
    """deepcopy makes new Parameters (torch drops their attributes); the sharded modules
    mark the copies again, and share the TP group."""
    import copy
    layer = tp.parallelize(_gpt2_block(), tp.gpt2_block_plan(), tp.TPGroup(_never, None, 0, 2))
    twin = copy.deepcopy(layer)
    assert [tp.shard_of(p) for p in twin.parameters()] == [tp.shard_of(p) for p in layer.parameters()]
    assert tp.shard_of(twin.attn.qkv.weight) == tp.Shard(0, 3, (48, 16), 48)
    assert twin.attn.qkv.tp is layer.attn.qkv.tp
    assert sum(tp.replicated_mask(twin.parameters())) == 6  # ln1, ln2 (weight, bias), two proj biases
    assert tp.replicated_mask([twin.attn.proj.weight, twin.attn.proj.bias]) == [False, True]


def test_t_must_be_a_positive_integer():
    _refused(_gpt2_block(), tp.gpt2_block_plan(), 0)
    _refused(_gpt2_block(), tp.gpt2_block_plan(), True)


def test_the_vocabulary_pads_to_a_multiple_of_t():
    assert [tp.padded_size(v, 2) for v in (37, 38)] == [38, 38]
    assert tp.padded_size(50257, 8) == 50264
