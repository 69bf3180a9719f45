"""Dropout under tensor parallelism (chimera.tp.random): Megatron's RNG discipline.

A replicated tensor's dropout (after a row-parallel projection, after the vocab-parallel
embedding) draws the same mask on every TP rank: the block's output is the same tensor on
both; the attention probabilities of each rank's own heads draw from a stream per t. The
draws come from the rank's own generators, never torch's global one, so a rerun draws the
same masks (virtual ranks are threads sharing that global RNG in no fixed order), and the
recomputed forward replays them (``TPRandom.recompute_context``): recomputation on or off
gives the same gradients, in a block and in a pipeline (D=2 x T=2, chimera's GPT-2 with
dropout 0.1). Exact equality with one process is not claimed: one process draws all H heads'
mask from one stream, T ranks from T (the module's docstring says why it stays so). With
dropout 0 the plans equal one process (tests/test_tp_blocks.py, tests/test_tp_pipeline.py).

Virtual ranks, float64.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from chimera import tp
from chimera.errors import UserError
from ranks import run_ranks
from test_tp_blocks import B, S, call, diff, inputs, randomized, tp_group

P = 0.25


def _block(dropout: float = P) -> nn.Module:
    from chimera import rng
    from chimera.models.gpt2 import GPT2Block, ModelConfig, make_layer
    cfg = ModelConfig("gpt2", n_layer=2, d_model=16, n_head=4, seq_len=S, dropout=dropout)
    with rng.seeded(0):
        return randomized(make_layer(GPT2Block, cfg, seed=0, index=1), seed=7)


def _hf_block() -> nn.Module:
    """HF's GPT-2 block with residual dropout (its attention's stays 0: not routed)."""
    import hf_models as hm
    from chimera import rng
    from chimera.hf.layers import GPT2Block
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block as HFBlock
    config = hm.config("gpt2", "eager")
    config.resid_pdrop = P
    with rng.seeded(0):
        return randomized(GPT2Block(config, block=HFBlock(config, layer_idx=0)), seed=7)


BLOCKS = {"gpt2": (_block, tp.gpt2_block_plan),
          "hf-gpt2": (_hf_block, lambda: tp.prefixed(tp.hf_gpt2_block_plan(), "block."))}


def _run(block: nn.Module, plan: dict, group: tp.TPGroup, recompute: bool,
         context: bool = True) -> dict:
    """One training forward and backward of a fresh copy of the sharded ``block``, its
    streams seeded anew (a rerun): output, input gradient, every gathered gradient."""
    random = tp.TPRandom(seed=3, pipe_rank=0, t=group.rank)
    group = tp.TPGroup(group.transport, group.group, group.rank, group.size, random=random)
    sharded = tp.parallelize(copy.deepcopy(block), plan, group).train()
    x, mask, g = inputs(seed=3)
    x.requires_grad_()
    if recompute:
        kw = {"context_fn": random.recompute_context} if context else {}
        y = checkpoint(call, sharded, x, mask, use_reentrant=False, **kw)
    else:
        y = call(sharded, x, mask)
    y.backward(g)
    grads = {n: tp.full_grad(p, group) for n, p in sharded.named_parameters()}
    return {"y": y.detach(), "dx": x.grad, "grads": grads,
            "types": sorted({type(m).__name__ for m in sharded.modules()
                             if "Dropout" in type(m).__name__ and m.p > 0})}


def _worker(rank: int, world: int, block: nn.Module, plan: dict) -> dict:
    group = tp_group(rank, world)
    runs = {"first": _run(block, plan, group, False), "rerun": _run(block, plan, group, False),
            "recomputed": _run(block, plan, group, True),
            "recomputed, streams not replayed": _run(block, plan, group, True, False)}
    random = tp.TPRandom(seed=3, pipe_rank=0, t=rank)
    draws = {s: torch.rand(4, generator=random.generator(s)) for s in tp.random.STREAMS}
    x, mask, _ = inputs(seed=3)
    ref = copy.deepcopy(block).eval()  # no dropout: what the masks change
    return {**runs, "draws": draws, "eval": call(ref, x, mask).detach()}


def _same(a: dict, b: dict) -> float:
    """The largest difference of output, input gradient and any parameter gradient."""
    grads = [diff(a["grads"][n], b["grads"][n]) for n in a["grads"]]
    return max([diff(a["y"], b["y"]), diff(a["dx"], b["dx"]), *grads])


@pytest.mark.parametrize("name", BLOCKS)
def test_tp_dropout_is_deterministic_replicated_where_the_tensor_is_and_replayed_by_recompute(name):
    build, plan = BLOCKS[name]
    results = run_ranks(functools.partial(_worker, block=build(), plan=plan()), 2)
    for rank, r in enumerate(results):
        assert r["first"]["types"] == ["TPDropout"], r["first"]["types"]  # every rate above 0
        assert diff(r["first"]["y"], r["eval"]) > 1e-3, rank  # the masks did something
        assert _same(r["first"], r["rerun"]) == 0.0, rank  # the same masks on a rerun
        assert _same(r["first"], r["recomputed"]) == 0.0, rank  # recompute replays them
        # without the context, the recomputed forward draws new masks: other gradients
        assert _same(r["first"], r["recomputed, streams not replayed"]) > 1e-6, rank
    # the block's output is replicated: both ranks drew the same residual masks
    assert _same(results[0]["first"], results[1]["first"]) == 0.0
    d0, d1 = results[0]["draws"], results[1]["draws"]
    assert torch.equal(d0["replicated"], d1["replicated"])
    assert not torch.equal(d0["sharded"], d1["sharded"])  # each rank's heads: its own stream


def test_a_dropout_the_plan_does_not_route_is_refused_and_one_without_streams_too():
    """HF GPT-2's attention dropout is not in its plan (HF's attention draws it from torch's
    global RNG): refused in one line; a routed dropout with a TPGroup that has no streams:
    refused when sharded."""
    import hf_models as hm
    from chimera.hf.layers import GPT2Block
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block as HFBlock
    config = hm.config("gpt2", "eager")
    config.attn_pdrop = 0.1
    block = GPT2Block(config, block=HFBlock(config, layer_idx=0))
    with pytest.raises(UserError, match=r"attn_dropout.p=0.1\), which its plan does not draw from "
                                        r"the TP random streams"):
        tp.resolve(block, tp.prefixed(tp.hf_gpt2_block_plan(), "block."), 2)
    group = tp.TPGroup(None, None, 0, 2)  # no streams
    with pytest.raises(UserError, match="random streams, and this TPGroup has none"):
        tp.parallelize(_block(), tp.gpt2_block_plan(), group)
    with pytest.raises(UserError, match="Dropout takes an nn.Dropout"):
        tp.resolve(nn.Sequential(nn.Linear(4, 4)), {"0": tp.Dropout()}, 2)


# -- a pipeline ---------------------------------------------------------------------------------
def _pipeline_run(recompute: bool, dropout: float = 0.1) -> list:
    """D=2 x T=2 chimera (4 virtual ranks), chimera's GPT-2 with ``dropout``, 2 SGD steps:
    (losses, the whole state after them) of rank 0."""
    import chimera.api as chimera
    from chimera.models import build_layers, loss_fn
    from chimera.models.gpt2 import ModelConfig
    from chimera.models.tp import gpt2_tp_plan
    from chimera.runtime.context import ExecOptions
    from chimera.runtime.virtual import run_virtual

    cfg = ModelConfig("gpt2", n_layer=2, d_model=16, n_head=4, seq_len=S, vocab_size=37, dropout=dropout)

    def rank(_):
        pipe = chimera.Pipeline(lambda: [m.double() for m in build_layers(cfg, 0)], loss_fn(cfg), "chimera",
                                stages=2, micro_batches=2, micro_batch_size=B, tensor_parallel=2,
                                model=chimera.ModelOptions(tp_plan=gpt2_tp_plan),
                                options=ExecOptions(recompute=recompute))
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        losses = []
        for step in range(2):
            ids = torch.randint(0, 37, (2 * B, S + 1), generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            losses.append(pipe.step(ids[:, :-1], ids[:, 1:]))
            opt.step()
        return losses, pipe.state_dict(all_ranks=True)

    return run_virtual(4, rank)


@pytest.mark.slow  # three pipelined runs of 4 virtual ranks
def test_a_tp_pipeline_with_dropout_reruns_alike_and_recompute_changes_nothing():
    first, again, recomputed = _pipeline_run(False), _pipeline_run(False), _pipeline_run(True)
    for runs in (again, recomputed):
        for (losses, state), (ref_losses, ref_state) in zip(runs, first):
            assert losses == ref_losses
            assert all(torch.equal(state[k], ref_state[k]) for k in ref_state)
    no_dropout = _pipeline_run(False, dropout=0.0)
    assert no_dropout[0][0] != first[0][0]  # the masks did something
