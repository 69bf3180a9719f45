"""A whole tiny Llama under TP=2 (chimera.tp): a vocab-parallel embedding and a gathered head
with a vocabulary T does not divide (37, padded to 38), two sharded decoder layers, equal to
one process; the norm shares summed over the TP group give the unsharded gradient norm; the
whole state dict gathered strips the padding; full_tensor undoes local_slice for every kind
of Shard (plain on either dim, fused q/k/v, padded); chimera's GPT-2 with its head tied to
its embedding, retied after sharding, equals one process too.

Virtual ranks, float64. The embedding has a padding row, once in each rank's slice: a global
index would freeze another token's row on the other rank (token 20 is local row 1 there,
like token 1 here).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chimera import tp
from ranks import run_ranks
from test_tp_blocks import TOL, diff, randomized, tp_group

B, S = 2, 8


def llama_model(padding_idx: int) -> nn.Sequential:
    import hf_models as hm
    from chimera import rng
    from chimera.hf.layers import LlamaBlock, LlamaEmbed, LlamaHead
    from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaRMSNorm,
                                                          LlamaRotaryEmbedding)
    config = hm.config("llama", "eager")
    C = config.hidden_size
    with rng.seeded(0):
        blocks = [LlamaBlock(config, layer=LlamaDecoderLayer(config, k), rotary_emb=LlamaRotaryEmbedding(config))
                  for k in range(2)]
        model = nn.Sequential(LlamaEmbed(config, embed_tokens=nn.Embedding(hm.V, C, padding_idx=padding_idx)),
                              *blocks, LlamaHead(config, norm=LlamaRMSNorm(C), lm_head=nn.Linear(C, hm.V, bias=True)))
    model = randomized(model, seed=5)
    with torch.no_grad():
        model[0].embed_tokens.weight[padding_idx] = 0  # as nn.Embedding makes it
    return model


def shard_llama(model: nn.Sequential, group: tp.TPGroup, logits: str = "auto") -> nn.Sequential:
    """``model`` sharded over ``group``; its head's logits gathered ("auto" without a loss
    that takes them sharded) or ``logits="sharded"`` (``tp.ShardedLogits``)."""
    tp.parallelize(model[0], tp.embedding_plan("embed_tokens"), group)
    for block in model[1:-1]:
        tp.parallelize(block, tp.prefixed(tp.llama_decoder_plan(), "layer."), group)
    tp.parallelize(model[-1], tp.head_plan("lm_head", logits), group)
    return model


def _loss(model: nn.Sequential, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = model[0](ids)
    for layer in model[1:]:  # the boundary tuple (hidden, mask, positions) as the pipeline passes it
        out = layer(*out)
    logits = out
    return F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten(), reduction="sum"), logits


def llama_ids(padding_idx: int) -> torch.Tensor:
    import hf_models as hm
    ids = torch.randint(0, hm.V, (B, S), generator=torch.Generator().manual_seed(11))
    ids[0, :4] = torch.tensor([1, 20, padding_idx, hm.V - 1])  # both local row 1s, pad, last row
    return ids


def _one(model: nn.Sequential, padding_idx: int, group: tp.TPGroup) -> dict:
    ref, sharded = copy.deepcopy(model), shard_llama(copy.deepcopy(model), group)
    ids = llama_ids(padding_idx)
    (lr, yr), (ls, ys) = _loss(ref, ids), _loss(sharded, ids)
    lr.backward()
    ls.backward()
    mine = dict(sharded.named_parameters())
    grads = {n: diff(p.grad, tp.full_grad(mine[n], group)) for n, p in ref.named_parameters()}
    whole = tp.full_state_dict(sharded, group)  # what an export writes
    assert whole.keys() == ref.state_dict().keys()
    weights = {n: diff(t, whole[n]) for n, t in ref.state_dict().items()}
    share = tp.squared_norm_share(sharded.parameters(), group)
    naive = sum(q.grad.pow(2).sum() for q in sharded.parameters())
    for t in (share, naive):
        group.all_reduce(t)
    full = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm()
    embed, head = sharded[0].embed_tokens, sharded[-1].lm_head
    return {"loss": abs(lr.item() - ls.item()), "logits": diff(yr, ys), "grads": grads,
            "weights": weights, "norm": abs(share.sqrt().item() - full.item()) / full.item(),
            "naive": abs(naive.sqrt().item() - full.item()) / full.item(),
            "pad_grad": tp.full_grad(embed.weight, group)[padding_idx].abs().max().item(),
            "padding_rows": (embed.weight.grad[18:].abs().sum().item() if group.rank else 0.0)
            + (head.weight.grad[18:].abs().sum().item() + head.bias.grad[18:].abs().sum().item()
               if group.rank else 0.0),
            "local_rows": (tuple(embed.weight.shape), tuple(head.weight.shape)),
            "types": (type(embed).__name__, type(head).__name__)}


def _worker(rank: int, world: int, models: dict) -> dict:
    group = tp_group(rank, world)
    return {pad: _one(model, pad, group) for pad, model in models.items()}


def test_a_tp2_llama_with_an_odd_vocabulary_equals_one_process():
    models = {pad: llama_model(pad) for pad in (1, 20)}  # a padding row in each rank's slice
    for rank, by_pad in enumerate(run_ranks(functools.partial(_worker, models=models), 2)):
        for pad, r in by_pad.items():
            where = f"rank {rank}, padding_idx {pad}"
            assert r["types"] == ("VocabEmbedding", "GatheredHead"), where
            assert r["local_rows"] == ((19, 16), (19, 16)), where  # 37 padded to 38, 19 rows each
            assert r["loss"] <= TOL and r["logits"] <= TOL, (where, r["loss"], r["logits"])
            bad = {f"{what} {n}": d for what in ("grads", "weights") for n, d in r[what].items()
                   if not d <= TOL}
            assert not bad, (where, bad)
            assert r["pad_grad"] == 0.0 and r["padding_rows"] == 0.0, where
            assert r["norm"] <= 1e-12, (where, r["norm"])
            assert r["naive"] > 1e-6, where  # every rank's squares: replicated ones counted twice


# -- full_tensor(local_slice(x)) == x --------------------------------------------------------
SHARDS = {  # name -> (whole shape, Shard)
    "rows": ((12, 5), tp.Shard(0, 1, (12, 5), 12)),
    "columns": ((5, 12), tp.Shard(1, 1, (5, 12), 12)),
    "fused rows (Linear qkv)": ((36, 4), tp.Shard(0, 3, (36, 4), 36)),
    "fused columns (Conv1D c_attn)": ((4, 36), tp.Shard(1, 3, (4, 36), 36)),
    "fused bias": ((36,), tp.Shard(0, 3, (36,), 36)),
    "padded vocabulary": ((37, 4), tp.Shard(0, 1, (37, 4), None)),
}


def _roundtrip_worker(rank: int, world: int) -> dict:
    group = tp_group(rank, world)
    out = {}
    for name, (shape, shard) in SHARDS.items():
        if shard.padded is None:
            shard = tp.Shard(shard.dim, 1, shape, tp.padded_size(shape[0], world))
        whole = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
        local = tp.local_slice(whole, shard, group)
        out[name] = (torch.equal(tp.full_tensor(local, shard, group), whole), tuple(local.shape), local)
    return out


@pytest.mark.parametrize("t", [2, 3, 4])
def test_full_tensor_undoes_local_slice_for_every_kind_of_shard(t):
    results = run_ranks(_roundtrip_worker, t)
    for rank, by_kind in enumerate(results):
        for name, (equal, shape, _) in by_kind.items():
            assert equal, (t, rank, name)
            whole, shard = SHARDS[name]
            expected = list(whole)
            expected[shard.dim] = -(-whole[shard.dim] // t)
            assert shape == tuple(expected), (t, rank, name, shape)
    # the fused weight's slice t is head block t of each of q, k and v
    q_k_v = torch.arange(36 * 4, dtype=torch.float64).reshape(36, 4).chunk(3)
    for rank, by_kind in enumerate(results):
        local = by_kind["fused rows (Linear qkv)"][2]
        assert torch.equal(local, torch.cat([part.chunk(t)[rank] for part in q_k_v])), (t, rank)


def test_a_replicated_tensor_is_its_own_slice_and_whole():
    group = tp.TPGroup(None, None, 0, 2)  # no collective may run: the transport is None
    x = torch.randn(3, 4)
    assert tp.local_slice(x, None, group) is x and tp.full_tensor(x, None, group) is x
    params = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))]
    params[1]._tp_shard = tp.Shard(0, 1, (4,), 4)
    assert tp.replicated_mask(params) == [True, False]
    assert tp.shard_of(params[1]) == tp.Shard(0, 1, (4,), 4)


def test_the_squared_norm_counts_shards_on_every_rank_and_replicated_parameters_once():
    """The rule on its own: shares of sharded and replicated parameters, summed over T ranks."""
    sharded, replicated = torch.tensor([3.0, 4.0]), torch.tensor([12.0])

    def params(rank: int) -> list[nn.Parameter]:
        shard = nn.Parameter(torch.zeros(1))
        shard.grad, shard._tp_shard = sharded[rank:rank + 1].clone(), tp.Shard(0, 1, (2,), 2)
        whole = nn.Parameter(torch.zeros(1))
        whole.grad = replicated.clone()
        return [shard, whole, nn.Parameter(torch.zeros(1))]  # the last has no gradient

    shares = [tp.squared_norm_share(params(r), tp.TPGroup(None, None, r, 2)) for r in range(2)]
    assert [s.item() for s in shares] == [9.0 + 144.0, 16.0]
    assert sum(shares).sqrt().item() == 13.0  # sqrt(9 + 16 + 144)
    assert all(s.dtype == torch.float64 for s in shares)


# -- chimera's GPT-2, its embedding and head tied -----------------------------------------------
def _gpt2(vocab: int) -> nn.Sequential:
    from chimera.models.gpt2 import GPT2_LAYERS, ModelConfig, make_layer
    cfg = ModelConfig("gpt2", n_layer=2, d_model=16, n_head=4, seq_len=S, vocab_size=vocab)
    embed, block, head = GPT2_LAYERS
    model = nn.Sequential(*(make_layer(cls, cfg, seed=0, index=i)
                            for i, cls in enumerate((embed, block, block, head))))
    model = randomized(model, seed=9)
    model[-1].lm_head.weight = model[0].tok.weight  # one Parameter, as a stage holds a tie
    return model


def _gpt2_worker(rank: int, world: int, model: nn.Sequential) -> dict:
    group = tp_group(rank, world)
    ref, sharded = copy.deepcopy(model), copy.deepcopy(model)
    tp.parallelize(sharded[0], tp.embedding_plan("tok"), group)
    for block in sharded[1:-1]:
        tp.parallelize(block, tp.gpt2_block_plan(), group)
    tp.parallelize(sharded[-1], tp.head_plan("lm_head"), group)
    sharded[-1].lm_head.weight = sharded[0].tok.weight  # retied after sharding, as the stages do
    ids = torch.randint(0, model[0].tok.num_embeddings, (B, S), generator=torch.Generator().manual_seed(2))
    losses = []
    for m in (ref, sharded):
        logits = m(ids)
        losses.append(F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()))
        losses[-1].backward()
    mine = dict(sharded.named_parameters())
    return {"loss": abs(losses[0].item() - losses[1].item()),
            "grads": {n: diff(p.grad, tp.full_grad(mine[n], group)) for n, p in ref.named_parameters()},
            "tied": sharded[-1].lm_head.weight is sharded[0].tok.weight}


@pytest.mark.parametrize("t", [2, 4])
def test_chimera_gpt2_with_a_tied_head_and_an_odd_vocabulary_equals_one_process(t):
    """The vocab-parallel embedding and the gathered head slice a (V, C) weight alike
    (padded, dim 0), so a tie made again after sharding sums both uses' gradients locally."""
    for r in run_ranks(functools.partial(_gpt2_worker, model=_gpt2(vocab=37)), t):
        assert r["tied"] and r["loss"] <= TOL, r["loss"]
        bad = {n: d for n, d in r["grads"].items() if not d <= TOL}
        assert not bad, bad
