"""The parallel styles torch lacks: HF's Conv1D, fused projections, local head counts.

torch's ``ColwiseParallel`` / ``RowwiseParallel`` take ``nn.Linear`` and ``nn.Embedding``
only. ``Colwise`` and ``Rowwise`` are the same styles (same input and output layouts, the
same DTensor parameters) that also take HF's ``Conv1D``, whose weight is ``(in, out)``, the
transpose of a Linear's, so the dimension sharded is the other one. ``Colwise(parts=k)``
shards a fused projection (GPT-2's ``qkv`` / ``c_attn``: k = 3) part by part, so each rank
holds whole heads of each of q, k and v: the weight is a ``_StridedShard`` (the placement
torch's FSDP2 + TP and HF's own ``packed_colwise`` use), so ``full_tensor()`` gives the
weight in its original order and DCP reshards it to another T correctly, whereas a
permuted ``Shard`` would give a T-dependent order.

``LocalHeads`` goes on the attention module itself: after q, k, v are sharded a rank sees
n_head / T heads, and a module that stores its head count must be told so.
"""

from __future__ import annotations

import types
from functools import partial
from typing import Callable

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard


def is_conv1d(module: nn.Module) -> bool:
    """HF's Conv1D (GPT-2), known by name: tp imports no transformers (a layer above it)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def out_dim(module: nn.Module) -> int:
    """The weight dimension that indexes output features: 0 for Linear, 1 for Conv1D."""
    return 1 if is_conv1d(module) else 0


def widths(module: nn.Module) -> tuple[int, int]:
    """(input features, output features) of a Linear or a Conv1D."""
    if is_conv1d(module):
        return module.nx, module.nf
    return module.in_features, module.out_features


def distribute_params(module: nn.Module, mesh, placements: dict[str, object],
                      src_data_rank: int | None = 0) -> None:
    """Each named parameter of ``module`` becomes a DTensor parameter with its placement,
    its values from rank ``src_data_rank`` of the mesh (None: each rank's own, no collective)."""
    for name, param in list(module.named_parameters(recurse=False)):
        dist_param = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist_param, requires_grad=param.requires_grad))


class Colwise(ColwiseParallel):
    """``ColwiseParallel`` for Linear and Conv1D; ``parts`` > 1: a fused projection whose
    output is ``parts`` blocks (q, k, v), each sharded over the ranks on its own."""

    def __init__(self, *, parts: int = 1, input_layouts=None, output_layouts=None,
                 use_local_output: bool = True):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)
        self.parts = parts

    def placement(self, dim: int):
        return Shard(dim) if self.parts == 1 else _StridedShard(dim, split_factor=self.parts)

    def _partition(self, name, module, mesh):
        distribute_params(module, mesh, {"weight": self.placement(out_dim(module)),
                                         "bias": self.placement(0)}, self.src_data_rank)

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, mesh):
        # Shard(-1) asked: the local block (plain or strided) is this rank's output already;
        # torch's own fn would redistribute a strided one to a plain Shard (a collective).
        # Otherwise gathered, and waited for (see Rowwise).
        if not isinstance(output_layouts[0], Shard):
            outputs = outputs.redistribute(placements=output_layouts)
        return outputs.to_local() if use_local_output else outputs

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if isinstance(module, nn.Embedding) and self.parts == 1:
            return super()._apply(module, device_mesh)
        return distribute_module(
            module, device_mesh, self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Rowwise(RowwiseParallel):
    """``RowwiseParallel`` for Linear, Embedding and Conv1D (weight sharded on its input
    dimension, bias replicated; the partial outputs are summed by one allreduce, waited for:
    torch's asynchronous one returns an ``AsyncCollectiveTensor``, a wrapper that waits at
    its first use, and such a tensor must not be what a layer hands the pipeline)."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if outputs.placements != output_layouts:
            outputs = outputs.redistribute(placements=output_layouts)
        return outputs.to_local() if use_local_output else outputs

    def _partition(self, name, module, mesh):
        distribute_params(module, mesh, {"weight": Shard(1 - out_dim(module)), "bias": Replicate()},
                          self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, self._partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Replicated(ParallelStyle):
    """HF's ``replicate``: every rank keeps the whole module (its parameters stay plain)."""

    def problem(self, module: nn.Module, tp: int) -> str | None:
        return None

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return module


def attribute(module: nn.Module, path: str):
    """``module.a.b`` for ``path`` "a.b" (a head count may live in the module's config)."""
    value = module
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _has(module: nn.Module, path: str) -> bool:
    try:
        attribute(module, path)
    except AttributeError:
        return False
    return True


class LocalHeads(ParallelStyle):
    """On an attention module: its heads are split over the T ranks.

    ``heads`` / ``kv_heads``: where the module keeps its (key/value) head count, as an
    attribute path (``"n_head"``, ``"config.num_key_value_heads"``): read to check that T
    divides them. ``divide``: the attributes its forward reads that count heads (or their
    width), set to value / T. ``forward``: a replacement forward, for a module whose own one
    takes a width from its input, which stays full-width under TP."""

    def __init__(self, heads: str, kv_heads: str | None = None, divide: tuple[str, ...] = (),
                 forward: Callable | None = None):
        super().__init__()
        self.heads, self.kv_heads, self.divide, self.forward = heads, kv_heads, divide, forward

    def problem(self, module: nn.Module, tp: int) -> str | None:
        """Why ``tp`` ranks cannot split this module's heads, or None."""
        paths = [p for p in (self.heads, self.kv_heads, *self.divide) if p is not None]
        missing = [p for p in paths if not _has(module, p)]
        if missing:
            return f"LocalHeads: the module has no {', '.join(missing)} (a plan for another model?)"
        for what, path in (("heads", self.heads), ("key/value heads", self.kv_heads)):
            count = None if path is None else attribute(module, path)
            if count is not None and count % tp:
                return f"T={tp} does not divide the {count} {what} ({path})"
        return None

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        tp = device_mesh.size()
        for name in self.divide:
            setattr(module, name, getattr(module, name) // tp)
        if self.forward is not None:
            module.forward = types.MethodType(self.forward, module)
        return module

    def __repr__(self) -> str:
        return f"LocalHeads(heads={self.heads!r}, kv_heads={self.kv_heads!r}, divide={self.divide!r})"
