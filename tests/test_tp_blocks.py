"""Tensor-parallel blocks (chimera.tp) equal the unsharded block in one process.

Virtual ranks (threads, chimera.runtime.virtual), float64: the block is built once (every
parameter perturbed from one seed, biases included), each rank deep-copies it twice, keeps
one copy whole as the reference and shards the other over a TP group of the ranks, and runs
both on the same replicated input and output gradient. The output, the input gradient and
every parameter gradient (gathered with full_tensor) agree within 1e-12; the output is a
plain tensor after one allreduce per sub-block (attention, MLP) forward and one backward,
all through the transport (counted by a Wrapping transport, seen by the NCCL emulation and
by a recorded world's strict replay). Split backward (input gradient first, weights later:
chimera.runtime.split_backward) gives the same, W without a collective, and so does
recomputation (activation checkpointing). One test runs a Llama block on two gloo processes.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import RowwiseParallel

from chimera import tp
from chimera.runtime.transport import ReduceOp, Wrapping, current
from ranks import run_ranks

TOL = 1e-12
B, S = 3, 8


# -- the blocks ------------------------------------------------------------------------------
def randomized(module: nn.Module, seed: int) -> nn.Module:
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


def _bert(attn: str):
    from chimera.models.bert import BertBlock
    from chimera.models.gpt2 import ModelConfig, make_layer
    cfg = ModelConfig("bert", n_layer=2, d_model=16, n_head=4, seq_len=S)
    return make_layer(BertBlock, cfg, seed=0, index=1), tp.gpt2_block_plan()  # post-LN, bidirectional


BLOCKS = {"llama": _llama, "hf-gpt2": _hf_gpt2, "gpt2": _gpt2, "bert": _bert}


def built(name: str, attn: str) -> tuple[nn.Module, dict]:
    """(block, plan), built once in this thread (HF draws its init from torch's global RNG)."""
    from chimera import rng
    with rng.seeded(0):
        block, plan = BLOCKS[name](attn)
    return randomized(block, seed=7), plan


def inputs(seed: int, width: int = 16):
    """(hidden, padding mask, output gradient), the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, width, generator=gen, dtype=torch.float64)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, -3:] = 0  # a right-padded row
    return x, mask, torch.randn(B, S, width, generator=gen, dtype=torch.float64)


def call(block: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = block(x, mask, None) if hasattr(block, "prefixes") else block(x)
    return out[0] if isinstance(out, tuple) else out


# -- the TP group ----------------------------------------------------------------------------
class Counting(Wrapping):
    """The transport, with every collective it is asked for listed (kind, elements)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.calls: list[tuple[str, int]] = []

    def all_reduce(self, tensor, op=ReduceOp.SUM, group=None, async_op=False):
        self.calls.append(("all_reduce", tensor.numel()))
        return super().all_reduce(tensor, op=op, group=group, async_op=async_op)

    def all_gather_single(self, output, input, group=None, async_op=False):
        self.calls.append(("all_gather", input.numel()))
        return super().all_gather_single(output, input, group=group, async_op=async_op)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        self.calls.append(("all_gather_list", tensor.numel()))
        return super().all_gather(tensor_list, tensor, group=group, async_op=async_op)

    def taken(self) -> list[tuple[str, int]]:
        """The calls since the last ``taken``."""
        calls, self.calls = self.calls, []
        return calls


def tp_group(rank: int, size: int, transport=None) -> tp.TPGroup:
    """A TP group over ranks 0..size-1 of the virtual world, counting its collectives."""
    inner = transport or current()
    return tp.TPGroup(Counting(inner), inner.new_group(list(range(size))), rank, size)


def pair(block: nn.Module, plan: dict, group: tp.TPGroup) -> tuple[nn.Module, nn.Module]:
    """(reference, sharded): two copies of ``block``, the second parallelized."""
    return copy.deepcopy(block), tp.parallelize(copy.deepcopy(block), plan, group)


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def grad_report(ref: nn.Module, sharded: nn.Module, group: tp.TPGroup) -> dict:
    """name -> max |difference| of the gathered gradient (every rank gathers, in one order)."""
    mine = dict(sharded.named_parameters())
    assert mine.keys() == dict(ref.named_parameters()).keys()  # state-dict names unchanged
    out = {}
    for name, p in ref.named_parameters():
        q = mine[name]
        assert type(q) is nn.Parameter and type(q.grad) is torch.Tensor, name
        assert q.grad.shape == q.shape, f"{name}: gradient {tuple(q.grad.shape)}, parameter {tuple(q.shape)}"
        out[name] = diff(p.grad, tp.full_grad(q, group))
    return out


def replicated_grads(sharded: nn.Module) -> dict:
    return {n: p.grad.clone() for n, p in sharded.named_parameters() if tp.shard_of(p) is None}


# -- one block, forward and backward ------------------------------------------------------------
def block_worker(rank: int, world: int, block: nn.Module, plan: dict, transport=None) -> dict:
    group = tp_group(rank, world, transport)
    ref, sharded = pair(block, plan, group)
    x, mask, g = inputs(seed=3)
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr = call(ref, xr, mask)
    group.transport.taken()
    ys = call(sharded, xs, mask)
    forward = group.transport.taken()
    yr.backward(g)
    ys.backward(g)
    backward = group.transport.taken()
    return {"out": diff(yr, ys), "dx": diff(xr.grad, xs.grad), "plain": type(ys) is torch.Tensor,
            "comm": (forward, backward), "grads": grad_report(ref, sharded, group),
            "replicated": replicated_grads(sharded),
            "sharded": sorted(n for n, p in sharded.named_parameters() if tp.shard_of(p)),
            "local_heads": {f"{n}.{a}": getattr(m, a) for n, m in sharded.named_modules()
                            for a in ("n_head", "num_heads", "split_size") if hasattr(m, a)}}


def assert_exact(results: list[dict], width: int = 16) -> None:
    for rank, r in enumerate(results):
        assert r["plain"], f"rank {rank}: the block's output is not a plain tensor"
        assert r["out"] <= TOL and r["dx"] <= TOL, (rank, r["out"], r["dx"])
        one = ("all_reduce", B * S * width)
        assert r["comm"] == ([one, one], [one, one]), \
            f"rank {rank}: collectives (forward, backward) {r['comm']}, not one allreduce per sub-block each way"
        bad = {n: d for n, d in r["grads"].items() if not d <= TOL}
        assert not bad, f"rank {rank}: gradients differ: {bad}"
        for n, g in r["replicated"].items():  # every rank has the same whole gradient
            assert torch.equal(g, results[0]["replicated"][n]), (rank, n)


_HF_GPT2 = ("attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "mlp.c_fc.weight",
            "mlp.c_fc.bias", "mlp.c_proj.weight")
SHARDED = {  # the parameters each plan shards (the rest, norms and row biases, replicated)
    "llama": {f"layer.{m}.weight" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                             "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                             "mlp.down_proj")},
    "hf-gpt2": {f"block.{n}" for n in _HF_GPT2},
    "gpt2": {"attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "mlp.fc.weight", "mlp.fc.bias",
             "mlp.proj.weight"}}
SHARDED["bert"] = SHARDED["gpt2"]


@pytest.mark.parametrize("name, attn, t, heads", [
    ("llama", "eager", 2, {}),
    ("llama", "sdpa", 2, {}),
    ("hf-gpt2", "sdpa", 2, {"block.attn.num_heads": 2, "block.attn.split_size": 8}),
    ("hf-gpt2", "eager", 4, {"block.attn.num_heads": 1, "block.attn.split_size": 4}),
    ("gpt2", "", 2, {"attn.n_head": 2}),
    ("gpt2", "", 4, {"attn.n_head": 1}),
    ("bert", "", 2, {"attn.n_head": 2})])
def test_a_tp_block_equals_one_process(name, attn, t, heads):
    block, plan = built(name, attn)
    results = run_ranks(functools.partial(block_worker, block=block, plan=plan), t)
    assert_exact(results)
    assert set(results[0]["sharded"]) == SHARDED[name], results[0]["sharded"]
    local = results[0]["local_heads"]  # 4 heads of width 4 over T
    assert {k: local.get(k) for k in heads} == heads, local


class GatedMLP(nn.Module):
    """gate and up fused in one projection (HF's ``packed_colwise``), a residual around it."""

    def __init__(self, width: int = 16, hidden: int = 24):
        super().__init__()
        self.gate_up, self.down = nn.Linear(width, 2 * hidden), nn.Linear(hidden, width)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class GatheredMLP(nn.Module):
    """fc's output gathered whole, proj given the whole input (HF's ``colwise_rep``,
    ``rowwise_rep``): a collective more each way than column-in, row-out."""

    def __init__(self, width: int = 16, hidden: int = 24):
        super().__init__()
        self.fc, self.proj = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(x)))


@pytest.mark.parametrize("module, plan, comm", [
    (GatedMLP, {"gate_up": "packed_colwise", "down": "rowwise"}, (["all_reduce"], ["all_reduce"])),
    (GatedMLP, {"gate_up": tp.Colwise(parts=2), "down": RowwiseParallel()}, (["all_reduce"], ["all_reduce"])),
    (GatheredMLP, {"fc": "colwise_rep", "proj": "rowwise_rep"},
     (["all_gather", "all_reduce"], ["all_gather", "all_reduce"]))])
def test_the_other_hf_entries_equal_one_process(module, plan, comm):
    from chimera import rng
    with rng.seeded(0):
        block = randomized(module(), seed=3)
    for r in run_ranks(functools.partial(block_worker, block=block, plan=plan), 2):
        assert r["out"] <= TOL and r["dx"] <= TOL and max(r["grads"].values()) <= TOL, r
        assert tuple([kind for kind, _ in calls] for calls in r["comm"]) == comm, r["comm"]


def test_one_allreduce_per_llama_sub_block_needs_the_shared_input():
    """Without its shared inputs, HF's own Llama plan allreduces each of q, k, v and gate, up
    input gradients: 5 allreduces backward instead of 2 (the same gradients)."""
    block, _ = built("llama", "eager")
    results = run_ranks(functools.partial(block_worker, block=block,
                                          plan=tp.prefixed(tp.from_hf(tp.HF_LLAMA_TP_PLAN, "layers.*."), "layer.")), 2)
    forward, backward = results[0]["comm"]
    assert (len(forward), len(backward)) == (2, 5)
    assert results[0]["dx"] <= TOL and max(results[0]["grads"].values()) <= TOL


def _emulated_worker(rank: int, world: int, block, plan) -> dict:
    from chimera.runtime.nccl_emulation import NcclEmulation
    emulation = NcclEmulation(current(), "strict")
    try:
        out = block_worker(rank, world, block, plan, transport=emulation)
        return {**out, "kinds": dict(emulation.kinds)}
    finally:
        emulation.close()


def test_tp_collectives_run_under_the_nccl_emulation_and_replay_strictly():
    """Under the strict emulation (one stream per rank) the block is exact and the emulation
    gated its four allreduces (and full_grad's all-gathers); a recorded world holds them and
    replays under NCCL's rules."""
    from chimera.check.rendezvous import replay_recorded
    from chimera.runtime.virtual import VirtualWorld, run_virtual
    block, plan = built("llama", "eager")
    results = run_ranks(functools.partial(_emulated_worker, block=block, plan=plan), 2)
    assert_exact(results)
    gathers = len(SHARDED["llama"])  # full_grad's, one per sharded parameter
    assert all(r["kinds"] == {"allreduce": 4, "all-gather": gathers} for r in results), [r["kinds"] for r in results]
    world = VirtualWorld(2, record=True)
    run_virtual(2, lambda rank: block_worker(rank, 2, block, plan), vw=world)
    reduces = [[f for kind, f in calls if kind == "collective" and f["name"] == "all_reduce"]
               for calls in world.recorded()]
    assert [len(r) for r in reduces] == [4, 4]  # 2 forward, 2 backward; full_grad's are all-gathers
    assert replay_recorded(world.recorded()) > 0


# -- split backward ----------------------------------------------------------------------------
def each_block(rank: int, world: int, blocks: dict, backward) -> dict:
    """Per block: ``backward(sharded, x, mask, g, group)`` (a dict) on the sharded block, with
    the input gradient and every gathered gradient against one process's full backward."""
    group = tp_group(rank, world)
    out = {}
    for name, (block, plan) in blocks.items():
        ref, sharded = pair(block, plan, group)
        x, mask, g = inputs(seed=5)
        xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
        call(ref, xr, mask).backward(g)
        group.transport.taken()
        r = backward(sharded, xs, mask, g, group)
        out[name] = {**r, "dx": diff(xr.grad, r.pop("dx")), "grads": grad_report(ref, sharded, group)}
    return out


def _split(sharded, xs, mask, g, group) -> dict:
    """I (input gradient only), then W; the collectives each issued."""
    from chimera.runtime.split_backward import backward_input, backward_weight
    ys = call(sharded, xs, mask)
    group.transport.taken()
    dx, pending = backward_input(ys, xs, g, list(sharded.parameters()))
    comm_i = group.transport.taken()
    no_grads_yet = all(p.grad is None for p in sharded.parameters())
    split = bool(pending.boundaries) and pending.output is None  # not a plain W fallback
    backward_weight(pending)
    return {"dx": dx, "split": split, "no_grads_after_i": no_grads_yet,
            "comm": (len(comm_i), len(group.transport.taken()))}


def test_split_backward_on_sharded_blocks():
    """I then W on each sharded block: the input gradient before any weight gradient, then
    the weight gradients, all equal to one process's full backward. I holds the block's
    allreduces (one per sub-block: its input gradient's); W issues no collective."""
    blocks = {name: built(name, attn) for name, attn in (("llama", "sdpa"), ("hf-gpt2", "eager"), ("gpt2", ""))}
    for rank, by_block in enumerate(run_ranks(functools.partial(each_block, blocks=blocks, backward=_split), 2)):
        for name, r in by_block.items():
            assert r["dx"] <= TOL, (rank, name, r["dx"])
            assert r["no_grads_after_i"] and r["split"], (rank, name)
            bad = {n: d for n, d in r["grads"].items() if not d <= TOL}
            assert not bad, (rank, name, bad)
            assert r["comm"] == (2, 0), (rank, name, r["comm"])


# -- recomputation -----------------------------------------------------------------------------
def _recompute(sharded, xs, mask, g, group) -> dict:
    from torch.utils.checkpoint import checkpoint
    ys = checkpoint(call, sharded, xs, mask, use_reentrant=False)  # as the executor recomputes
    forward = group.transport.taken()
    ys.backward(g)
    return {"dx": xs.grad, "comm": (len(forward), len(group.transport.taken()))}


def test_recomputed_sharded_blocks_equal_one_process():
    """Activation checkpointing (non-reentrant, the executor's) reruns the forward in the
    backward, collectives included, and stops once the saved tensors are back: the block's
    last allreduce (the MLP's output) is not redone. 2 forward, 2 + 1 backward, every rank
    alike; the gradients are exact."""
    blocks = {name: built(name, attn) for name, attn in (("llama", "eager"), ("hf-gpt2", "sdpa"), ("gpt2", ""))}
    for rank, by_block in enumerate(run_ranks(functools.partial(each_block, blocks=blocks, backward=_recompute), 2)):
        for name, r in by_block.items():
            assert r["dx"] <= TOL and max(r["grads"].values()) <= TOL, (rank, name, r)
            assert r["comm"] == (2, 3), (rank, name, r["comm"])


# -- real processes ----------------------------------------------------------------------------
def _gloo_worker(rank: int, world: int) -> dict:
    from chimera.runtime.transport import TorchDist
    block, plan = built("llama", "eager")
    return block_worker(rank, world, block, plan, transport=TorchDist())


@pytest.mark.slow
def test_a_tp2_llama_block_on_gloo_processes_equals_one_process():
    """The same on two spawned gloo processes: TorchDist's collectives, not the in-process ones."""
    assert_exact(run_ranks(_gloo_worker, 2, processes=True, timeout_s=120))
