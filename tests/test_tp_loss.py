"""The vocab-parallel cross-entropy (chimera.tp.loss): an LM head that keeps its logits sharded
over the vocabulary, and a loss computed from them with three reductions over the TP group,
equal to one process's ``F.cross_entropy`` on the whole logits.

Virtual ranks, float64. The vocabularies are ones T does not divide (padding columns on the
last ranks, a rank with no real column at all where T is large against V); the targets hit
the first and last token, a token on every rank, ``ignore_index`` (-100, and a real token id
used as one). The loss, the input gradient and the head's weight and bias gradients (gathered)
agree within 1e-12; the padding rows get no gradient; the forward's collectives are one MAX
allreduce of (N,) and one SUM allreduce of (N, 2), never an all-gather of the logits.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from chimera import tp
from chimera.runtime.virtual import run_virtual
from ranks import run_ranks
from test_tp_blocks import TOL, diff, randomized, tp_group
from test_tp_vocab import llama_ids, llama_model, shard_llama

B, S, C = 3, 5, 8


def _head(vocab: int) -> nn.Linear:
    """Built once, in the test's thread (the ranks' threads share torch's global RNG)."""
    from chimera import rng
    with rng.seeded(0):
        head = nn.Linear(C, vocab)
    return randomized(head, seed=4)


def _data(vocab: int, ignore_index: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, C, generator=gen, dtype=torch.float64)
    y = torch.randint(0, vocab, (B, S), generator=gen)
    y[0, :3] = torch.tensor([0, vocab - 1, ignore_index])   # first token, last token, ignored
    y[1, :] = torch.arange(S) * (vocab - 1) // (S - 1)      # spread over every rank's columns
    return x, y


def _worker(rank: int, world: int, head: nn.Linear, ignore_index: int, reduction: str) -> dict:
    group = tp_group(rank, world)
    ref, vocab = copy.deepcopy(head), head.out_features
    sharded = tp.parallelize(nn.Sequential(copy.deepcopy(ref)), {"0": tp.VocabHead("sharded")}, group)[0]
    x, y = _data(vocab, ignore_index)
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    lr = F.cross_entropy(ref(xr).flatten(0, 1), y.flatten(), ignore_index=ignore_index,
                         reduction=reduction).view(-1)
    group.transport.taken()
    logits = sharded(xs)
    ls = tp.cross_entropy(logits, y, ignore_index=ignore_index, reduction=reduction).view(-1)
    forward = group.transport.taken()
    g = torch.linspace(0.5, 1.5, lr.numel(), dtype=torch.float64)  # a weight per row for "none"
    (lr * g).sum().backward()
    (ls * g).sum().backward()
    backward = group.transport.taken()
    real = logits.real
    return {"loss": diff(lr, ls), "dx": diff(xr.grad, xs.grad),
            "weight": diff(ref.weight.grad, tp.full_grad(sharded.weight, group)),
            "bias": diff(ref.bias.grad, tp.full_grad(sharded.bias, group)),
            "padding_grad": sharded.weight.grad[real:].abs().sum().item()
            + sharded.bias.grad[real:].abs().sum().item(),
            "real": real, "local": tuple(logits.local.shape), "shape": tuple(logits.shape),
            "comm": (forward, backward), "type": type(sharded).__name__}


@pytest.mark.parametrize("vocab, t", [(37, 2), (37, 3), (37, 4), (5, 4), (40, 4)])
@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_the_vocab_parallel_cross_entropy_equals_one_process(vocab, t, reduction):
    rows = -(-vocab // t)
    for rank, r in enumerate(run_ranks(functools.partial(_worker, head=_head(vocab), ignore_index=-100,
                                                         reduction=reduction), t)):
        where = (vocab, t, reduction, rank)
        assert r["type"] == "ShardedHead" and r["local"] == (B, S, rows) and r["shape"] == (B, S, vocab), r
        assert r["real"] == max(0, min(rows, vocab - rank * rows)), where
        for key in ("loss", "dx", "weight", "bias"):
            assert r[key] <= TOL, (where, key, r[key])
        assert r["padding_grad"] == 0.0, where
        forward, backward = r["comm"]
        assert forward == [("all_reduce", B * S), ("all_reduce", 2 * B * S)], (where, forward)
        assert backward == [("all_reduce", B * S * C)], (where, backward)  # the head's input gradient
    if vocab == 5 and t == 4:
        assert r["real"] == 0  # the last rank holds only padding: its max is -inf, its sums 0


@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_ignored_targets_add_nothing_and_get_no_gradient(ignore_index):
    """``ignore_index`` -100, and a real token id (3) used as one: those rows' loss 0 and no
    gradient, as ``F.cross_entropy`` gives; "mean" divides by the rows that count."""
    for r in run_ranks(functools.partial(_worker, head=_head(37), ignore_index=ignore_index,
                                         reduction="mean"), 2):
        assert max(r["loss"], r["dx"], r["weight"], r["bias"]) <= TOL, r


def _llama_worker(rank: int, world: int, model: nn.Sequential) -> dict:
    """A whole tiny Llama (vocab-parallel embedding, two sharded decoder layers, the head
    sharded) with HF's causal loss on its sharded logits, against one process."""
    from chimera.hf.layers import causal_lm_loss
    group = tp_group(rank, world)
    ref, sharded = copy.deepcopy(model), shard_llama(copy.deepcopy(model), group, logits="sharded")
    ids = llama_ids(1)
    labels = ids.clone()
    labels[1, 2:4] = -100  # padding's labels
    losses = []
    for m in (ref, sharded):
        out = m[0](ids)
        for layer in m[1:]:
            out = layer(*out)
        losses.append(causal_lm_loss(out, labels))
        losses[-1].backward()
    mine = dict(sharded.named_parameters())
    return {"loss": abs(losses[0].item() - losses[1].item()), "sharded": isinstance(out, tp.ShardedLogits),
            "grads": {n: diff(p.grad, tp.full_grad(mine[n], group)) for n, p in ref.named_parameters()}}


def test_a_tp2_llama_with_sharded_logits_and_hf_causal_loss_equals_one_process():
    model = llama_model(1)
    for r in run_ranks(functools.partial(_llama_worker, model=model), 2):
        assert r["sharded"] and r["loss"] <= TOL, r["loss"]
        bad = {n: d for n, d in r["grads"].items() if not d <= TOL}
        assert not bad, bad


def test_sharded_logits_gather_whole_and_index_leading_dims_only():
    def body(rank: int) -> dict:
        group = tp_group(rank, 2)
        whole = torch.arange(2 * 3 * 7, dtype=torch.float64).view(2, 3, 7)
        padded = torch.cat([whole, torch.zeros(2, 3, 1, dtype=torch.float64)], -1)  # 7 -> 8
        logits = tp.ShardedLogits(padded.chunk(2, -1)[rank].contiguous(), group, 7)
        try:
            logits[..., :3]
            refused = ""
        except IndexError as exc:
            refused = str(exc)
        return {"full": torch.equal(logits.full(), whole), "shifted": tuple(logits[:, :-1].shape),
                "refused": refused, "real": logits.real}
    for rank, r in enumerate(run_virtual(2, body)):
        assert r["full"] and r["shifted"] == (2, 2, 7) and r["real"] == (4 if rank == 0 else 3), r
        assert "leading dims only" in r["refused"], r


def test_a_head_gathers_its_logits_unless_the_loss_takes_them_sharded():
    """``VocabHead()`` (the built-in plans' ``head_plan``) is "auto": gathered for any loss,
    sharded where ``parallelize`` is told the loss takes sharded logits (``Pipeline`` tells it
    for a loss marked ``tp.takes_sharded_logits``: the built-in LM losses are)."""
    from chimera.hf.layers import causal_lm_loss, token_loss
    from chimera.models import loss_fn

    def body(rank: int) -> tuple[str, str, str]:
        group = tp_group(rank, 2)
        plan = tp.head_plan("0")
        kinds = [type(tp.parallelize(nn.Sequential(nn.Linear(4, 6)), plan, group,
                                     sharded_logits=s)[0]).__name__ for s in (False, True)]
        forced = tp.parallelize(nn.Sequential(nn.Linear(4, 6)), tp.head_plan("0", "gathered"), group,
                                sharded_logits=True)[0]
        return (*kinds, type(forced).__name__)

    assert run_virtual(2, body) == [("GatheredHead", "ShardedHead", "GatheredHead")] * 2
    assert all(tp.accepts_sharded_logits(f) for f in (causal_lm_loss, token_loss, loss_fn(None, "sum")))
    assert not tp.accepts_sharded_logits(F.cross_entropy)
    with pytest.raises(Exception, match="VocabHead.logits='whole'.: one of auto, gathered, sharded"):
        tp.resolve(nn.Sequential(nn.Linear(4, 6)), tp.head_plan("0", "whole"), 2)


class _Sharding(nn.Module):
    """A last layer returning sharded logits whose group holds what does not pickle (a lock
    stands in for a communicator)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(4, 6)
        import threading
        self.group = tp.TPGroup(threading.Lock(), None, 0, 1)

    def forward(self, x):
        return tp.ShardedLogits(self.head(x), self.group, 5)


def test_the_probe_of_a_last_stage_with_sharded_logits_sends_a_spec_that_pickles():
    """Processes broadcast the probe's result (pickled): the last stage's output is no
    boundary, so its sharded logits travel as their type's name (a gloo run failed with
    "cannot pickle" before)."""
    import pickle

    from chimera.runtime.pipeline import _probe_stage
    x, y = torch.randn(2, 3, 4), torch.randint(0, 5, (2, 3))
    kind, spec = _probe_stage(_Sharding(), 1, x, True, tp.cross_entropy, y, torch.device("cpu"))
    assert kind == "ok", spec
    assert "ShardedLogits" in pickle.loads(pickle.dumps(spec)).leaves[0].const


def test_half_precision_sharded_logits_are_computed_on_in_float32():
    """bf16 logits: the loss equals ``F.cross_entropy`` of the same values in float32 (a bf16
    sum of exponentials would be off by about 1e-2), its gradient bf16 like the logits."""
    gen = torch.Generator().manual_seed(0)
    whole = (4 * torch.randn(2, 3, 37, generator=gen)).bfloat16()
    y = torch.randint(0, 37, (2, 3), generator=gen)
    want = F.cross_entropy(whole.float().flatten(0, 1), y.flatten(), reduction="sum")

    def body(rank: int) -> tuple[float, torch.dtype]:
        padded = torch.cat([whole, whole.new_zeros(2, 3, 1)], -1)  # 37 -> 38
        local = padded.chunk(2, -1)[rank].contiguous().requires_grad_()
        loss = tp.cross_entropy(tp.ShardedLogits(local, tp_group(rank, 2), 37), y, reduction="sum")
        loss.backward()
        return loss.item(), local.grad.dtype

    for loss, dtype in run_virtual(2, body):
        assert abs(loss - want.item()) <= 1e-5 * abs(want.item()) and dtype == torch.bfloat16
