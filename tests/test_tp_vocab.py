"""A whole tiny Llama under TP=2 (chimera.tp): a vocab-parallel embedding and a
column-parallel head with a vocabulary T does not divide (37, padded to 38), two sharded
decoder layers, equal to one process; the norm shares summed over the TP group give the
unsharded gradient norm; gathered parameters strip the padding.

Two gloo processes, float64. The embedding has a padding row, once in each rank's shard:
DTensor hands padding_idx to the local lookup unchanged, so a global index would freeze
another token's row on the other rank (token 20 is local row 1 there, like token 1 here).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from chimera import tp
from ranks import run_ranks
from test_tp_blocks import TOL, _diff, _randomized, same_layout

B, S = 2, 8


def _model(padding_idx: int) -> nn.Sequential:
    import hf_models as hm
    from chimera.hf.layers import LlamaBlock, LlamaEmbed, LlamaHead
    from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaRMSNorm,
                                                          LlamaRotaryEmbedding)
    config = hm.config("llama", "eager")
    C = config.hidden_size
    blocks = [LlamaBlock(config, layer=LlamaDecoderLayer(config, k), rotary_emb=LlamaRotaryEmbedding(config))
              for k in range(2)]
    return nn.Sequential(LlamaEmbed(config, embed_tokens=nn.Embedding(hm.V, C, padding_idx=padding_idx)),
                         *blocks, LlamaHead(config, norm=LlamaRMSNorm(C), lm_head=nn.Linear(C, hm.V, bias=False)))


def _shard(model: nn.Sequential, mesh) -> nn.Sequential:
    tp.parallelize(model[0], tp.embedding_plan("embed_tokens"), mesh)
    for block in model[1:-1]:
        tp.parallelize(block, tp.prefixed(tp.llama_decoder_plan(), "layer."), mesh)
    tp.parallelize(model[-1], tp.head_plan("lm_head"), mesh)
    return model


def _loss(model: nn.Sequential, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = model[0](ids)
    for layer in model[1:]:  # the boundary tuple (hidden, mask, positions) as the pipeline passes it
        out = layer(*out)
    logits = out
    return F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten(), reduction="sum"), logits


def _ids(padding_idx: int) -> torch.Tensor:
    import hf_models as hm
    ids = torch.randint(0, hm.V, (B, S), generator=torch.Generator().manual_seed(11))
    ids[0, :4] = torch.tensor([1, 20, padding_idx, hm.V - 1])  # both local row 1s, pad, last row
    return ids


def _one(padding_idx: int, mesh) -> dict:
    torch.manual_seed(0)
    ref = _randomized(_model(padding_idx), seed=5)
    with torch.no_grad():
        ref[0].embed_tokens.weight[padding_idx] = 0  # as nn.Embedding makes it
    sharded = _shard(copy.deepcopy(ref), mesh)
    ids = _ids(padding_idx)
    (lr, yr), (ls, ys) = _loss(ref, ids), _loss(sharded, ids)
    lr.backward()
    ls.backward()
    grads = {n: _diff(p.grad, tp.full_grad(q)) for (n, p), q in
             zip(ref.named_parameters(), sharded.parameters())}
    assert all(same_layout(q) for q in sharded.parameters())
    whole = tp.full_state_dict(sharded)  # what an export writes
    assert whole.keys() == ref.state_dict().keys()
    weights = {n: _diff(t, whole[n]) for n, t in ref.state_dict().items()}
    share = tp.squared_norm_share(sharded.parameters(), mesh)
    naive = sum(tp.local_tensor(q.grad).pow(2).sum() for q in sharded.parameters())
    for t in (share, naive):
        dist.all_reduce(t)
    full = torch.cat([p.grad.flatten() for p in ref.parameters()]).norm()
    return {"loss": abs(lr.item() - ls.item()), "logits": _diff(yr, ys), "grads": grads,
            "weights": weights, "norm": abs(share.sqrt().item() - full.item()) / full.item(),
            "naive": abs(naive.sqrt().item() - full.item()) / full.item(),
            "pad_grad": tp.full_grad(sharded[0].embed_tokens.weight)[padding_idx].abs().max().item(),
            "local_rows": tuple(tp.local_tensor(sharded[0].embed_tokens.weight).shape)}


def _worker(rank: int, world: int) -> dict:
    mesh = tp.tp_mesh(dist.group.WORLD)
    return {pad: _one(pad, mesh) for pad in (1, 20)}  # a padding row in each rank's shard


@pytest.mark.slow
def test_a_tp2_llama_with_an_odd_vocabulary_equals_one_process():
    for rank, by_pad in enumerate(run_ranks(_worker, 2, processes=True, timeout_s=120)):
        for pad, r in by_pad.items():
            where = f"rank {rank}, padding_idx {pad}"
            assert r["local_rows"] == (19, 16), where  # 37 padded to 38, 19 rows each
            assert r["loss"] <= TOL and r["logits"] <= TOL, (where, r["loss"], r["logits"])
            bad = {f"{what} {n}": d for what in ("grads", "weights") for n, d in r[what].items()
                   if not d <= TOL}
            assert not bad, (where, bad)
            assert r["pad_grad"] == 0.0, where
            assert r["norm"] <= 1e-12, (where, r["norm"])
            assert r["naive"] > 1e-6, where  # every rank's squares: norms counted twice
