"""What crosses a stage boundary: any pytree of tensors, packed into one byte message.

The Mailbox moves one tensor per message, so a boundary's leaves travel as one flat uint8
buffer: each tensor leaf's bytes at an aligned offset, viewed in place on the receiving side
with the leaf's own dtype. Integer leaves (masks, position ids) therefore arrive bit-exact,
whatever the parameters' precision. Leaves that are not tensors (None, a flag) are constants
of the spec: they are not sent, and a send that changes one is refused. Gradients travel back
only for the floating leaves that required grad when the stage was probed.

Calling convention (the same everywhere: probe, forward, loss): a tuple is spread over the
positional arguments (``layer(*x)``), anything else is passed as is (``layer(x)``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import _pytree as pytree

from chimera.errors import UserError

ALIGN = 16  # bytes; a uint8 slice can be viewed as any dtype of at most this size


class BoundaryMismatch(UserError):
    """A stage produced a boundary whose structure, shape or dtype differs from the probe's."""


def call_layer(layer, x):
    return layer(*x) if isinstance(x, tuple) else layer(x)


def call_loss(loss_fn, out, target):
    """Extra last-stage outputs (a tuple) reach the loss: ``loss_fn(*out, target)``."""
    return loss_fn(*out, target) if isinstance(out, tuple) else loss_fn(out, target)


class Stage(nn.Module):
    """Layers of one stage, named by their model-wide index (``"3.attn.weight"``), so a stage's
    parameter and state_dict names are those of ``nn.Sequential(*all_layers)``."""

    def __init__(self, layers: dict[int, nn.Module]):
        super().__init__()
        for index, layer in layers.items():
            self.add_module(str(index), layer)

    def forward(self, x):
        for layer in self.children():
            x = call_layer(layer, x)
        return x


def describe(x) -> str:
    """``(2, 16, 64) float64`` or ``((2, 16, 64) float64, (2, 16) int64)``: for error messages."""
    leaves, spec = pytree.tree_flatten(x)
    parts = [f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" if isinstance(t, torch.Tensor)
             else repr(t) for t in leaves]
    if len(parts) == 1 and isinstance(x, torch.Tensor):
        return parts[0]
    return f"{type(x).__name__}({', '.join(parts)})"


@dataclass(frozen=True)
class LeafSpec:
    """One leaf: a tensor (shape, dtype, whether a gradient flows back) or a constant."""

    shape: tuple | None  # None: not a tensor
    dtype: torch.dtype | None = None
    grad: bool = False
    const: object = None

    def on_wire(self, wire: torch.dtype | None) -> torch.dtype:
        """The dtype this leaf travels in: ``wire`` for a wider floating leaf, else its own."""
        if wire is not None and self.dtype.is_floating_point and self.dtype.itemsize > wire.itemsize:
            return wire
        return self.dtype

    def nbytes(self, wire: torch.dtype | None = None) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.on_wire(wire).itemsize


def _layout(leaves, wire: torch.dtype | None = None) -> tuple[list[int], int]:
    offsets, end = [], 0
    for leaf in leaves:
        offsets.append(end)
        end += -(-leaf.nbytes(wire) // ALIGN) * ALIGN
    return offsets, max(end, 1)  # never an empty message


@dataclass(frozen=True)
class BoundarySpec:
    """Structure and per-leaf layout of what one stage hands the next (or the loss).

    ``wire``: floating leaves wider than this travel in it (``--wire-dtype bf16`` halves the
    bytes of fp32 activations and gradients) and are cast back on arrival; None: as computed.
    """

    tree: pytree.TreeSpec
    leaves: tuple[LeafSpec, ...]
    wire: torch.dtype | None = None

    @staticmethod
    def of(x) -> "BoundarySpec":
        leaves, tree = pytree.tree_flatten(x)
        specs = tuple(
            LeafSpec(tuple(t.shape), t.dtype, bool(t.requires_grad and t.is_floating_point()))
            if isinstance(t, torch.Tensor) else LeafSpec(None, const=t) for t in leaves)
        return BoundarySpec(tree, specs)

    @functools.cached_property
    def bare(self) -> bool:
        """Whether the boundary is one tensor, no pytree around it (the fast path)."""
        return len(self.leaves) == 1 and self.leaves[0].shape is not None and self.tree.is_leaf()

    @functools.cached_property
    def _plans(self) -> dict[bool, tuple]:
        """Per direction (backward?): (leaf indices, their specs, offsets, message bytes),
        worked out once per spec."""
        plans = {}
        for backward, idx in ((False, self.tensors), (True, self.grads)):
            specs = [self.leaves[i] for i in idx]
            plans[backward] = (idx, specs, *_layout(specs, self.wire))
        return plans

    @property
    def tensors(self) -> list[int]:
        return [i for i, s in enumerate(self.leaves) if s.shape is not None]

    @property
    def grads(self) -> list[int]:
        return [i for i, s in enumerate(self.leaves) if s.grad]

    def nbytes(self, backward: bool) -> int:
        return self._plans[backward][3]

    def example(self, device) -> object:
        """Zeros of the right structure (for probing the next stage); grad leaves require grad."""
        leaves = [s.const if s.shape is None else
                  torch.zeros(s.shape, dtype=s.dtype, device=device).requires_grad_(s.grad)
                  for s in self.leaves]
        return pytree.tree_unflatten(leaves, self.tree)

    # -- forward messages ------------------------------------------------------------
    def check(self, leaves: list, tree, stage: int) -> None:
        if tree != self.tree or len(leaves) != len(self.leaves):
            raise BoundaryMismatch(f"stage {stage} returned a different structure than when probed "
                                   f"({tree} vs {self.tree})")
        for k, (t, s) in enumerate(zip(leaves, self.leaves)):
            if s.shape is None:
                if isinstance(t, torch.Tensor) or t != s.const:
                    raise BoundaryMismatch(f"stage {stage} output leaf {k}: constant {s.const!r} "
                                           f"became {t!r}")
            elif not isinstance(t, torch.Tensor) or tuple(t.shape) != s.shape:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else repr(t)
                raise BoundaryMismatch(
                    f"stage {stage} output leaf {k} has shape {got}, the probe saw {s.shape}: "
                    "boundary shapes must depend only on the input's shape")

    def pack(self, x, stage: int, device) -> torch.Tensor:
        if self.bare and isinstance(x, torch.Tensor) and tuple(x.shape) == self.leaves[0].shape:
            return self._pack([x], False, device)
        leaves, tree = pytree.tree_flatten(x)
        self.check(leaves, tree, stage)
        return self._pack([leaves[i] for i in self.tensors], False, device)

    @functools.cached_property
    def _alone(self) -> dict[bool, tuple | None]:
        """Per direction, (shape, wire dtype) of the one leaf whose own bytes can be the whole
        message (one leaf, no alignment padding after it), or None."""
        alone = {}
        for backward, (_, specs, _, total) in self._plans.items():
            s = specs[0] if len(specs) == 1 else None
            fits = s is not None and s.nbytes(self.wire) == total
            alone[backward] = (s.shape, s.on_wire(self.wire)) if fits else None
        return alone

    def _pack(self, tensors: list, backward: bool, device) -> torch.Tensor:
        _, specs, offsets, total = self._plans[backward]
        alone = self._alone[backward]
        if alone is not None and _sendable_as_is(tensors[0], *alone, device):
            # the message is the leaf's own bytes: send them, as torch's pipelining does, not a
            # copy (the sender keeps the leaf alive and unchanged until the send completes)
            return tensors[0].detach().view(-1).view(torch.uint8)  # contiguous: views
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        for t, s, off in zip(tensors, specs, offsets):
            dst = buf[off:off + s.nbytes(self.wire)].view(s.on_wire(self.wire)).view(s.shape)
            if t is None:
                dst.zero_()
            else:
                dst.copy_(t.detach())  # casts a bf16 (autocast) leaf to the probed dtype
        return buf

    @functools.cached_property
    def copies_on_unpack(self) -> bool:
        """Whether a leaf travels narrower than computed: unpacking casts it back, a copy that
        holds one message's values (otherwise every leaf is a view of the buffer)."""
        return any(s.shape is not None and s.on_wire(self.wire) != s.dtype for s in self.leaves)

    def views(self, buf: torch.Tensor, backward: bool = False) -> tuple[torch.Tensor, ...]:
        """The tensor leaves (``backward``: the gradients) of the message in ``buf``."""
        _, specs, offsets, total = self._plans[backward]
        if buf.numel() != total:
            raise BoundaryMismatch(f"message of {buf.numel()} bytes, the spec needs {total}")
        # a leaf sent narrower than computed is cast back (a copy); otherwise a view, no copy
        return tuple(buf[off:off + s.nbytes(self.wire)].view(s.on_wire(self.wire)).view(s.shape)
                     .to(s.dtype) for s, off in zip(specs, offsets))

    def from_views(self, views: tuple):
        """The pytree around a message's tensor leaves (:meth:`views`), constants put back."""
        if self.bare:
            return views[0]
        it = iter(views)
        leaves = [s.const if s.shape is None else next(it) for s in self.leaves]
        return pytree.tree_unflatten(leaves, self.tree)

    def unpack(self, buf: torch.Tensor):
        """The pytree, its tensor leaves viewing ``buf`` (no copy)."""
        return self.from_views(self.views(buf))

    # -- backward messages -------------------------------------------------------------
    def pack_grads(self, grads: list, device) -> torch.Tensor:
        """Gradients of the grad leaves, in order; a None (leaf unused) travels as zeros."""
        return self._pack(grads, True, device)

    def unpack_grads(self, buf: torch.Tensor) -> list[torch.Tensor]:
        return list(self.views(buf, True))

    def grad_leaves(self, x) -> list:
        """The leaves of ``x`` (this boundary's structure) that carry gradients."""
        if self.bare and isinstance(x, torch.Tensor):
            return [x] if self.leaves[0].grad else []
        leaves = pytree.tree_leaves(x)
        return [leaves[i] for i in self.grads]


def _sendable_as_is(t, shape: tuple, dtype: torch.dtype, device) -> bool:
    """Whether the tensor ``t`` already is its message: ``shape`` in the wire's ``dtype``,
    contiguous, on ``device``."""
    if t is None or t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
        return False
    if type(device) is not torch.device:
        device = torch.device(device)
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def signature(x) -> tuple:
    """Structure, shapes and dtypes of a pytree: equal signatures share boundary specs."""
    leaves, tree = pytree.tree_flatten(x)
    return (tree, tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else ("const", repr(t))
                        for t in leaves))


def detach_input(x, spec: BoundarySpec | None):
    """A stage input cut from the graph; leaves the spec marks get ``requires_grad`` (so
    backward leaves their gradient in ``.grad``). Returns (tree, those leaves)."""
    if isinstance(x, torch.Tensor):  # the common case, without the pytree round trip
        x = x.detach()
        return x, ([x.requires_grad_()] if spec is not None and spec.grads else [])
    leaves, tree = pytree.tree_flatten(x)
    leaves = [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves]
    grad = [] if spec is None else [leaves[i].requires_grad_() for i in spec.grads]
    return pytree.tree_unflatten(leaves, tree), grad
