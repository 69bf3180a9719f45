"""--wire-dtype: floating boundary tensors travel narrower (half the bytes), integers exact."""

import dataclasses

import pytest
import torch

from chimera.runtime.boundary import BoundarySpec
from chimera.train.config import ConfigError, TrainConfig
from chimera.train.equivalence import check_virtual


def test_float_leaves_travel_in_bf16_and_come_back_in_their_dtype():
    hidden = torch.randn(2, 5, 8, requires_grad=True) * 3
    mask = torch.randint(0, 2**40, (2, 5))  # int64: must stay exact
    spec = BoundarySpec.of((hidden, mask))
    narrow = dataclasses.replace(spec, wire=torch.bfloat16)
    assert narrow.nbytes(backward=False) < 0.75 * spec.nbytes(backward=False)
    assert narrow.nbytes(backward=True) == 2 * 5 * 8 * 2  # bf16 gradient of the float leaf
    h, m = narrow.unpack(narrow.pack((hidden, mask), 0, "cpu"))
    assert h.dtype == torch.float32 and torch.equal(h, hidden.detach().bfloat16().float())
    assert torch.equal(m, mask)
    (g,) = narrow.unpack_grads(narrow.pack_grads([torch.ones(2, 5, 8) / 3], "cpu"))
    assert g.dtype == torch.float32 and torch.equal(g, (torch.ones(2, 5, 8) / 3).bfloat16().float())


def test_training_with_a_bf16_wire_stays_close_to_the_float32_run():
    cfg = TrainConfig(schedule="chimera", stages=2, micro_batches=4, micro_batch_size=2, steps=3)
    exact = check_virtual(cfg)
    narrow = check_virtual(dataclasses.replace(cfg, wire_dtype="bf16"))
    assert exact["max_grad_rel_err"] < 1e-5  # float32 wire: the reference's gradients
    assert 0 < narrow["max_grad_rel_err"] < 5e-2  # rounded to bf16 on the wire: close, not equal
    assert narrow["max_loss_rel_err"] < 1e-2
    assert narrow["replicas_identical"]


def test_unknown_wire_dtype_is_refused():
    with pytest.raises(ConfigError, match="--wire-dtype"):
        TrainConfig(wire_dtype="int8")


def test_a_single_tensor_boundary_takes_the_same_bytes_as_its_pytree_form():
    """A bare tensor boundary (the fast path: no pytree round trip) packs the same message and
    unpacks the same values as the same tensor inside a one-element tuple (the general path),
    with and without a narrower wire; a tensor of another shape is still refused."""
    from chimera.runtime.boundary import BoundaryMismatch, detach_input

    x = torch.randn(2, 5, 8, requires_grad=True) * 3
    for wire in (None, torch.bfloat16):
        bare = dataclasses.replace(BoundarySpec.of(x), wire=wire)
        boxed = dataclasses.replace(BoundarySpec.of((x,)), wire=wire)
        assert bare.bare and not boxed.bare
        msg = bare.pack(x, 0, "cpu")
        assert torch.equal(msg, boxed.pack((x,), 0, "cpu"))
        (y,) = boxed.unpack(msg)
        assert torch.equal(bare.unpack(msg), y) and bare.unpack(msg).dtype == torch.float32
        g = torch.randn(2, 5, 8)
        assert torch.equal(bare.pack_grads([g], "cpu"), boxed.pack_grads([g], "cpu"))
        assert [t is x for t in bare.grad_leaves(x)] == [True]
        with pytest.raises(BoundaryMismatch):
            bare.pack(torch.randn(3, 5, 8), 0, "cpu")
    leaf, grads = detach_input(x, BoundarySpec.of(x))
    assert leaf.requires_grad and leaf.grad_fn is None and grads == [leaf]
    leaf, grads = detach_input(x, None)
    assert not leaf.requires_grad and grads == []


def test_a_receive_buffer_is_viewed_once_and_its_views_follow_each_new_message():
    """The mailbox refills one buffer per message every iteration: the executor makes its
    views once (no new view ops) and they read each new message; another buffer, or another
    spec, gets its own; a leaf sent narrower is cast back afresh from every message."""
    from types import SimpleNamespace

    from chimera.ir import Action, Op
    from chimera.runtime.executor import Executor

    def received(ex, recv, buf, spec, backward=False):
        ex.recv[recv] = buf
        return Executor._received(ex, recv, spec, backward)

    ex = SimpleNamespace(recv={}, _views={}, forward_only=False)
    recv = Action(Op.RECV_F, 0, 1, 0)
    x = torch.randn(3, 4)
    spec = BoundarySpec.of((x.requires_grad_(), torch.arange(3)))
    x = x.detach()
    buf = spec.pack((x, torch.arange(3)), 0, "cpu").clone()  # stands for a receive buffer
    first = received(ex, recv, buf, spec)
    again = received(ex, recv, buf, spec)
    assert all(a is b for a, b in zip(first, again)) and not ex.recv  # the same view objects
    buf.copy_(spec.pack((2 * x, torch.arange(3) + 1), 0, "cpu"))  # the next iteration's message
    h, m = spec.from_views(received(ex, recv, buf, spec))
    assert torch.equal(h, 2 * x) and torch.equal(m, torch.arange(3) + 1)
    other = buf.clone()  # a mailbox built again: its own buffer, its own views
    assert received(ex, recv, other, spec)[0].data_ptr() != h.data_ptr()
    assert len(ex._views) == 1  # one entry per receive: nothing piles up
    grads = spec.pack_grads([torch.ones(3, 4)], "cpu").clone()
    (g,) = received(ex, Action(Op.RECV_B, 0, 0, 0), grads, spec, backward=True)
    assert torch.equal(g, torch.ones(3, 4))

    narrow = dataclasses.replace(BoundarySpec.of(x), wire=torch.bfloat16)
    assert narrow.copies_on_unpack and not spec.copies_on_unpack
    wire = narrow.pack(x, 0, "cpu").clone()
    (once,) = received(ex, recv, wire, narrow)
    wire.copy_(narrow.pack(3 * x, 0, "cpu"))
    (now,) = received(ex, recv, wire, narrow)
    assert torch.equal(now, (3 * x).bfloat16().float())  # not the old copy
    assert torch.equal(once, x.bfloat16().float())  # and the earlier result was left alone


def test_forward_only_runs_get_fresh_views_of_each_message():
    """An evaluation hands a stage the received views themselves (no detach): each run gets
    its own, so an in-place reshape of one run's input does not reach the next."""
    from types import SimpleNamespace

    from chimera.ir import Action, Op
    from chimera.runtime.executor import Executor

    ex = SimpleNamespace(recv={}, _views={}, forward_only=True)
    recv = Action(Op.RECV_F, 0, 1, 0)
    spec = BoundarySpec.of(torch.randn(3, 4))
    buf = spec.pack(torch.randn(3, 4), 0, "cpu").clone()
    ex.recv[recv] = buf
    (first,) = Executor._received(ex, recv, spec, False)
    first.unsqueeze_(0)  # what a stage might do to its input under no_grad
    ex.recv[recv] = buf
    (second,) = Executor._received(ex, recv, spec, False)
    assert second is not first and second.shape == (3, 4) and not ex._views
