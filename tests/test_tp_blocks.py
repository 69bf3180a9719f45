"""Tensor-parallel blocks (chimera.tp) equal the unsharded block in one process.

Two gloo processes (T=2), float64: each rank builds the same block (every parameter drawn
from one seed, biases included), keeps a deep copy as the reference, shards the other with
the built-in plan and runs both on the same replicated input and output gradient. The
output, the input gradient and every parameter gradient (gathered) agree within 1e-12, and
the output crosses the block boundary as a plain tensor, after one allreduce per sub-block
(attention, MLP) forward and one backward. Split backward (input gradient
first, weights later: chimera.runtime.split_backward) gives the same on a sharded block.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from chimera import tp
from ranks import run_ranks

TOL = 1e-12
B, S = 3, 8


# -- the blocks (built in each rank; transformers imported there) ---------------------------
def _randomized(module: nn.Module, seed: int) -> nn.Module:
    """Every parameter perturbed from one seed, so zero-initialized biases are tested too."""
    gen = torch.Generator().manual_seed(seed)
    module = module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return module


def _llama(attn: str):
    import hf_models as hm
    from chimera.hf.layers import LlamaBlock
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    config = hm.config("llama", attn)
    block = LlamaBlock(config, layer=LlamaDecoderLayer(config, 0), rotary_emb=LlamaRotaryEmbedding(config))
    return block, tp.prefixed(tp.llama_decoder_plan(), "layer.")


def _hf_gpt2(attn: str):
    import hf_models as hm
    from chimera.hf.layers import GPT2Block
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block as HFBlock
    config = hm.config("gpt2", attn)
    return GPT2Block(config, block=HFBlock(config, layer_idx=0)), tp.prefixed(tp.hf_gpt2_block_plan(), "block.")


def _gpt2(attn: str):
    from chimera.models.gpt2 import GPT2Block, ModelConfig, make_layer
    cfg = ModelConfig("gpt2", n_layer=2, d_model=16, n_head=4, seq_len=S)
    return make_layer(GPT2Block, cfg, seed=0, index=1), tp.gpt2_block_plan()


BLOCKS = {"llama": _llama, "hf-gpt2": _hf_gpt2, "gpt2": _gpt2}


def _inputs(seed: int, width: int = 16):
    """(hidden, padding mask, output gradient), the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, width, generator=gen, dtype=torch.float64)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, -3:] = 0  # a right-padded row
    return x, mask, torch.randn(B, S, width, generator=gen, dtype=torch.float64)


def _call(block: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = block(x, mask, None) if hasattr(block, "prefixes") else block(x)
    return out[0] if isinstance(out, tuple) else out


def _pair(name: str, attn: str):
    """(reference block, sharded copy) on this rank: the same weights on every rank (HF
    draws its init from torch's global RNG, seeded here)."""
    torch.manual_seed(0)
    block, plan = BLOCKS[name](attn)
    ref = _randomized(block, seed=7)
    sharded = tp.parallelize(copy.deepcopy(ref), plan, tp.tp_mesh(torch.distributed.group.WORLD))
    return ref, sharded


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _grad_report(ref: nn.Module, sharded: nn.Module) -> dict:
    """name -> (max |difference| of the gathered gradient, what .grad is on this rank)."""
    out = {}
    for (name, p), q in zip(ref.named_parameters(), sharded.parameters()):
        assert same_layout(q), f"{name}: its gradient is laid out unlike the parameter"
        kind = type(q.grad).__name__ + str(getattr(q.grad, "placements", ""))
        out[name] = (_diff(p.grad, tp.full_grad(q)), kind)
    return out


def same_layout(p: torch.Tensor) -> bool:
    """The gradient is the parameter's kind, placements and local shape (what flat local
    gradient buffers and a per-shard optimizer need)."""
    g = p.grad
    return type(g) is type(p.data) and getattr(g, "placements", None) == getattr(p, "placements", None) \
        and tp.local_tensor(g).shape == tp.local_tensor(p).shape


def _block_worker(rank: int, world: int, name: str, attn: str) -> dict:
    ref, sharded = _pair(name, attn)
    x, mask, g = _inputs(seed=3)
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr = _call(ref, xr, mask)
    with CommDebugMode() as forward:
        ys = _call(sharded, xs, mask)
    yr.backward(g)
    with CommDebugMode() as backward:
        ys.backward(g)
    return {"out": _diff(yr, ys), "dx": _diff(xr.grad, xs.grad), "plain": type(ys) is torch.Tensor,
            "comm": (forward.get_total_counts(), backward.get_total_counts()),
            "grads": _grad_report(ref, sharded),
            "local_heads": {f"{n}.{a}": getattr(m, a) for n, m in sharded.named_modules()
                            for a in ("n_head", "num_heads", "split_size") if hasattr(m, a)}}


def _assert_exact(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["plain"], f"rank {rank}: the block's output is not a plain tensor"
        assert r["out"] <= TOL and r["dx"] <= TOL, (rank, r["out"], r["dx"])
        assert r["comm"] == (2, 2), f"rank {rank}: collectives (forward, backward) {r['comm']}, " \
                                    "not one allreduce per sub-block each way"
        bad = {n: d for n, (d, _) in r["grads"].items() if not d <= TOL}
        assert not bad, f"rank {rank}: gradients differ: {bad}"


@pytest.mark.slow
@pytest.mark.parametrize("name, attn, heads", [
    ("llama", "eager", {}),
    ("hf-gpt2", "sdpa", {"block.attn.num_heads": 2, "block.attn.split_size": 8}),
    ("gpt2", "", {"attn.n_head": 2})])
def test_a_tp2_block_equals_one_process(name, attn, heads):
    results = run_ranks(functools.partial(_block_worker, name=name, attn=attn), 2, processes=True,
                        timeout_s=120)
    _assert_exact(results)
    kinds = results[0]["grads"]
    assert any("Shard" in k for _, k in kinds.values()), kinds  # sharded weights have DTensor grads
    local = results[0]["local_heads"]  # 4 heads of width 4 over T=2
    assert {k: local.get(k) for k in heads} == heads, local


def _split_worker(rank: int, world: int) -> dict:
    """Each block: I (input gradient only), then W; the collectives each issued."""
    from chimera.runtime.split_backward import backward_input, backward_weight
    out = {}
    for name, attn in (("llama", "sdpa"), ("hf-gpt2", "eager"), ("gpt2", "")):  # the other attentions
        ref, sharded = _pair(name, attn)
        x, mask, g = _inputs(seed=5)
        xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
        _call(ref, xr, mask).backward(g)
        ys = _call(sharded, xs, mask)
        with CommDebugMode() as comm_i:
            dx, pending = backward_input(ys, xs, g, list(sharded.parameters()))
        no_grads_yet = all(p.grad is None for p in sharded.parameters())
        split = bool(pending.boundaries) and pending.output is None  # not a plain W fallback
        with CommDebugMode() as comm_w:
            backward_weight(pending)
        out[name] = {"dx": _diff(xr.grad, dx), "grads": _grad_report(ref, sharded),
                     "split": split,
                     "no_grads_after_i": no_grads_yet,
                     "comm": (comm_i.get_total_counts(), comm_w.get_total_counts())}
    return out


@pytest.mark.slow
def test_split_backward_on_sharded_blocks():
    """I then W on each sharded block: the input gradient before any weight gradient, then
    the weight gradients, all equal to one process's full backward. I holds the block's
    allreduces (one per sub-block: its input gradient's); W issues no collective."""
    for rank, blocks in enumerate(run_ranks(_split_worker, 2, processes=True, timeout_s=120)):
        for name, r in blocks.items():
            assert r["dx"] <= TOL, (rank, name, r["dx"])
            assert r["no_grads_after_i"] and r["split"], (rank, name)
            bad = {n: d for n, (d, _) in r["grads"].items() if not d <= TOL}
            assert not bad, (rank, name, bad)
            assert r["comm"] == (2, 0), (rank, name, r["comm"])
