"""Split backward (I then W) gives exactly the gradients of one full backward."""

import pytest
import torch
from torch import nn

from chimera.models import build_layers, get_config, loss_fn
from chimera.runtime.split_backward import backward_input, backward_weight


def _stage(name, rng):
    return nn.Sequential(*build_layers(get_config(name), 0, rng)).double()


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny"])
def test_middle_stage_split_equals_full(name):
    cfg = get_config(name)
    stage = _stage(name, range(1, 4))
    params = list(stage.parameters())
    x0 = torch.randn(3, cfg.seq_len, cfg.d_model, dtype=torch.float64)
    g = torch.randn(3, cfg.seq_len, cfg.d_model, dtype=torch.float64)
    _check_split_equals_full(stage, params, x0, g)


def _check_split_equals_full(stage, params, x0, g):
    x = x0.clone().requires_grad_()
    torch.autograd.backward(stage(x), g)
    ref_dx, ref = x.grad, [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    x = x0.clone().requires_grad_()
    dx, pending = backward_input(stage(x), x, g, params)
    assert torch.allclose(dx, ref_dx, rtol=1e-12, atol=1e-14)
    assert all(p.grad is None for p in params)  # I computed no weight gradient
    backward_weight(pending)
    for p, r in zip(params, ref):
        assert torch.allclose(p.grad, r, rtol=1e-12, atol=1e-14)


def test_last_stage_with_loss_and_accumulation():
    cfg = get_config("gpt2-tiny")
    stage = _stage("gpt2-tiny", range(5, cfg.n_layers_total))
    params = list(stage.parameters())
    x0 = torch.randn(2, cfg.seq_len, cfg.d_model, dtype=torch.float64)
    t = torch.randint(0, 256, (2, cfg.seq_len))
    loss = loss_fn(cfg)
    for p in params:
        p.grad = torch.ones_like(p)  # accumulates on top, like micro-batches do
    x = x0.clone().requires_grad_()
    loss(stage(x), t).backward()
    ref = [p.grad.clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    x = x0.clone().requires_grad_()
    _, pending = backward_input(loss(stage(x), t), x, None, params)
    backward_weight(pending)
    for p, r in zip(params, ref):
        assert torch.allclose(p.grad, r, rtol=1e-12, atol=1e-14)


def test_first_stage_has_no_input_gradient():
    cfg = get_config("gpt2-tiny")
    stage = _stage("gpt2-tiny", range(0, 2))
    params = list(stage.parameters())
    tokens = torch.randint(0, 256, (2, cfg.seq_len))
    g = torch.randn(2, cfg.seq_len, cfg.d_model, dtype=torch.float64)
    torch.autograd.backward(stage(tokens), g)
    ref = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    dx, pending = backward_input(stage(tokens), None, g, params)
    assert dx is None
    backward_weight(pending)
    for p, r in zip(params, ref):
        assert torch.equal(p.grad, r)


class _Twice(nn.Module):
    """One weight on the input path twice (a layer applied twice) plus a tied weight term."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6).double()

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x))) + self.lin.weight.sum()


def test_weight_below_two_boundaries_falls_back_to_a_plain_w():
    stage = _Twice()
    params = list(stage.parameters())
    _check_split_equals_full(stage, params, torch.randn(4, 6, dtype=torch.float64),
                             torch.randn(4, 6, dtype=torch.float64))


def test_split_backward_of_pass_through_and_input_independent_stages():
    """I then W equals a plain backward when a stage's output is its input (an Identity
    stage sent zeros upstream) and when it does not depend on its input (no weight gradient)."""
    from chimera.runtime.split_backward import backward_input, backward_weight

    w = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    g = torch.randn(3, dtype=torch.float64)
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    dx, pending = backward_input(x, [x], g, [w])
    backward_weight(pending)
    assert torch.equal(dx[0], g) and w.grad is None
    y = w * 2.0  # ignores its input
    dx, pending = backward_input(y, [x], g, [w])
    backward_weight(pending)
    assert dx == [None] and torch.equal(w.grad, 2.0 * g)


def test_the_engine_calls_give_what_autograd_grad_and_backward_give():
    """grad_of / backward_of (the engine without autograd's argument handling) against the
    public calls: a scalar loss without a gradient, explicit gradients, GradientEdges, unused
    inputs; a non-scalar output without a gradient is refused as autograd refuses it."""
    from torch.autograd.graph import get_gradient_edge

    from chimera.runtime.split_backward import backward_of, grad_of

    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    x, unused = torch.randn(2, 4, requires_grad=True), torch.randn(2, requires_grad=True)
    y = torch.tanh(lin(x))
    loss = (y ** 2).sum()
    got = grad_of([loss], [None], [x, unused], keep_graph=True)
    want = torch.autograd.grad(loss, [x, unused], retain_graph=True, allow_unused=True)
    assert torch.equal(got[0], want[0]) and got[1] is None and want[1] is None
    g = torch.randn(2, 3)
    assert torch.equal(grad_of([y], [g], [x], keep_graph=True)[0],
                       torch.autograd.grad(y, x, g, retain_graph=True)[0])
    edge = get_gradient_edge(y)
    got = grad_of([edge], [g], [lin.weight, lin.bias], keep_graph=True)
    want = torch.autograd.grad([edge], [lin.weight, lin.bias], [g], retain_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(RuntimeError, match="scalar outputs"):
        grad_of([y], [None], [x], keep_graph=True)
    with pytest.raises(RuntimeError, match="Mismatch in shape"):  # not broadcast silently
        grad_of([y[:1]], [torch.ones(2, 3)], [x], keep_graph=True)
    with pytest.raises(RuntimeError, match="cannot be empty"):  # not every leaf
        backward_of([y], [g], [])

    backward_of([loss], [None])  # into every leaf's .grad, as autograd.backward
    ref = [t.grad.clone() for t in (x, lin.weight, lin.bias)]
    for t in (x, lin.weight, lin.bias):
        t.grad = None
    loss2 = (torch.tanh(lin(x)) ** 2).sum()
    torch.autograd.backward(loss2)
    assert all(torch.equal(a, t.grad) for a, t in zip(ref, (x, lin.weight, lin.bias)))
    x.grad = None
    lin.weight.grad = None
    backward_of([torch.tanh(lin(x))], [g], [lin.weight])  # only the inputs named
    assert x.grad is None and lin.weight.grad is not None


def test_split_backward_frees_the_graph_without_a_garbage_collection():
    """After I and W nothing is left of the micro-batch's graph once its tensors go: the
    tensors autograd saved are freed by reference counting alone (a hook left on a node would
    hold the node and its boundary in a cycle until the collector runs)."""
    import gc
    import weakref

    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    params = list(stage.parameters())
    ids = {id(p) for p in params}
    saved = []

    def pack(t):  # keeps a detached alias (the tensor itself, if an output, would be a cycle)
        if id(t) in ids:
            return t
        alias = t.detach()
        saved.append(weakref.ref(alias))
        return alias

    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            x = torch.randn(2, 4, requires_grad=True)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = stage(x)
            dx, pending = backward_input(y, x, torch.ones(2, 4), params)
            backward_weight(pending)
            del x, y, dx, pending
        assert saved and all(r() is None for r in saved), \
            f"{sum(r() is not None for r in saved)} of {len(saved)} saved tensors still alive"
    finally:
        gc.enable()
