"""The sharded modules ``parallelize`` puts in place of a layer's projections and embedding.

Each holds plain ``nn.Parameter``s named as the module it replaces (``weight``, ``bias``:
state-dict keys do not change), each this rank's slice of the whole parameter, with its
:class:`~chimera.tp.shard.Shard` (``shard_of``), and calls the collectives of
:mod:`chimera.tp.group` through its :class:`~chimera.tp.group.TPGroup`:

- :class:`ColumnParallel`: an ``nn.Linear`` (weight (out, in)) or HF ``Conv1D`` (weight
  (in, out), the transpose) on this rank's output features; its input replicated, its output
  sharded along the last dim (or gathered: HF's ``colwise_rep``);
- :class:`RowParallel`: the same on this rank's input features; its partial outputs summed
  over the group, then the bias (whole, replicated) added once;
- :class:`VocabEmbedding`: an ``nn.Embedding`` on this rank's rows of the vocabulary
  (padded to a multiple of T): its tokens looked up, the others zero, summed over the group;
- :class:`GatheredHead`: an LM head column-parallel over the (padded) vocabulary, its
  logits gathered and the padding stripped: (B, S, C) -> (B, S, V), replicated, as any loss
  function takes it. Each rank then holds the whole logits and computes the same loss;
- :class:`ShardedHead`: the same head, its logits kept sharded: (B, S, C) ->
  :class:`~chimera.tp.loss.ShardedLogits` of (B, S, V_padded / T) per rank, for a loss that
  takes them (:func:`chimera.tp.loss.cross_entropy`, Megatron's vocab-parallel
  cross-entropy: three reductions of (B, S) instead of a gather of (B, S, V)).

The padding rows of an embedding or head are never looked up and their logits are
stripped, so their gradients stay zero and an optimizer leaves them zero. Copies keep the
shards: ``copy.deepcopy`` makes new Parameters, and a module's ``__setstate__`` marks them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from chimera.tp.group import TPGroup, copy_to_tp, gather_from_tp, reduce_from_tp, split_to_tp
from chimera.tp.loss import ShardedLogits
from chimera.tp.shard import Shard, local_slice, mark, shard_of


class TPModule(nn.Module):
    """A sharded module: its parameters' Shards by name, restored on a copy's Parameters."""

    def __init__(self, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.shards: dict[str, Shard | None] = {}

    def add_slice(self, name: str, full: torch.Tensor | None, shard: Shard | None) -> None:
        """Parameter ``name``: this rank's slice of ``full`` (None: no such parameter)."""
        self.shards[name] = shard
        if full is None:
            self.register_parameter(name, None)
            return
        local = local_slice(full.detach(), shard, self.tp)
        self.register_parameter(name, mark(nn.Parameter(local, requires_grad=full.requires_grad),
                                           shard))

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for name, shard in self.shards.items():
            p = self._parameters.get(name)
            if p is not None and shard_of(p) is None:
                mark(p, shard)


def is_conv1d(module: nn.Module) -> bool:
    """HF's Conv1D (GPT-2), known by name: tp imports no transformers (a layer above it)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def widths(module: nn.Module) -> tuple[int, int]:
    """(input features, output features) of a Linear or a Conv1D."""
    if is_conv1d(module):
        return module.nx, module.nf
    return module.in_features, module.out_features


def _project(x: torch.Tensor, weight: torch.Tensor, bias, conv1d: bool) -> torch.Tensor:
    """x W^T + b (Linear) or x W + b (Conv1D, as HF computes it: its bias always there)."""
    if not conv1d:
        return F.linear(x, weight, bias)
    out = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight)  # (B*S, out)
    return out.view(*x.shape[:-1], weight.shape[1])


class ColumnParallel(TPModule):
    """A Linear or Conv1D on this rank's output features (``parts`` > 1: a fused projection,
    each part sharded on its own). ``copy_input``: allreduce the input gradient here (off
    where the plan shares one copy among the projections of a sub-block); ``gather``: the
    output gathered whole, ``real`` features of it kept (the rest is padding)."""

    def __init__(self, module: nn.Module, tp: TPGroup, *, parts: int = 1, copy_input: bool = True,
                 gather: bool = False, padded: int | None = None):
        super().__init__(tp)
        self.conv1d, self.copy_input, self.gather = is_conv1d(module), copy_input, gather
        self.in_features, self.real = widths(module)
        rows = padded or self.real
        self.out_features = rows // tp.size
        w, b = module.weight, module.bias
        self.add_slice("weight", w, Shard(int(self.conv1d), parts, tuple(w.shape), rows))
        self.add_slice("bias", b, None if b is None else Shard(0, parts, tuple(b.shape), rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.tp) if self.copy_input else x
        y = _project(x, self.weight, self.bias, self.conv1d)     # (..., out/T)
        if not self.gather:
            return y
        y = gather_from_tp(y, self.tp)                           # (..., out padded)
        return y if y.shape[-1] == self.real else y[..., :self.real]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} of {self.real}, "
                f"conv1d={self.conv1d}, copy_input={self.copy_input}, gather={self.gather}")


class GatheredHead(ColumnParallel):
    """An ``nn.Linear`` LM head over the vocabulary, padded to a multiple of T; its logits
    gathered, the padding stripped."""

    def __init__(self, module: nn.Linear, tp: TPGroup, *, copy_input: bool = True, padded: int):
        super().__init__(module, tp, copy_input=copy_input, gather=True, padded=padded)


class ShardedHead(ColumnParallel):
    """An ``nn.Linear`` LM head over the vocabulary, padded to a multiple of T; its logits
    kept sharded (``ShardedLogits``: this rank's columns, the padding among them)."""

    def __init__(self, module: nn.Linear, tp: TPGroup, *, copy_input: bool = True, padded: int):
        super().__init__(module, tp, copy_input=copy_input, gather=False, padded=padded)

    def forward(self, x: torch.Tensor) -> ShardedLogits:
        return ShardedLogits(super().forward(x), self.tp, self.real)   # (B, S, V_padded/T)


class RowParallel(TPModule):
    """A Linear or Conv1D on this rank's input features: the partial outputs summed over
    the group, then the bias added. ``split_input``: it is given the whole input and takes
    its own slice (HF's ``rowwise_rep``); otherwise the slice (a column-parallel output)."""

    def __init__(self, module: nn.Module, tp: TPGroup, *, split_input: bool = False):
        super().__init__(tp)
        self.conv1d, self.split_input = is_conv1d(module), split_input
        n_in, self.out_features = widths(module)
        self.in_features = n_in // tp.size
        w = module.weight
        self.add_slice("weight", w, Shard(1 - int(self.conv1d), 1, tuple(w.shape), n_in))
        self.add_slice("bias", module.bias, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = split_to_tp(x, self.tp) if self.split_input else x  # (..., in/T)
        if self.conv1d:  # summed before the view: a fresh tensor is summed in place
            y = reduce_from_tp(x.reshape(-1, x.shape[-1]).mm(self.weight), self.tp)
            y = y.view(*x.shape[:-1], self.out_features)
        else:
            y = reduce_from_tp(F.linear(x, self.weight), self.tp)  # (..., out), partial before
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} of {self.in_features * self.tp.size}, "
                f"out_features={self.out_features}, conv1d={self.conv1d}, split_input={self.split_input}")


class VocabEmbedding(TPModule):
    """An ``nn.Embedding`` on this rank's rows of the (padded) vocabulary: (B, S) ids,
    replicated -> (B, S, C), replicated. ``padding_idx`` is kept on the rank whose rows hold
    it, as a local row (a global index would freeze another token's row elsewhere)."""

    def __init__(self, module: nn.Embedding, tp: TPGroup, *, padded: int):
        super().__init__(tp)
        self.num_embeddings, self.embedding_dim = module.num_embeddings, module.embedding_dim
        self.rows = padded // tp.size
        self.start = tp.rank * self.rows
        pad = module.padding_idx
        self.padding_idx = pad - self.start if pad is not None and 0 <= pad - self.start < self.rows \
            else None
        w = module.weight
        self.add_slice("weight", w, Shard(0, 1, tuple(w.shape), padded))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx)  # partial
        return reduce_from_tp(out.masked_fill(outside.unsqueeze(-1), 0), self.tp)   # (B, S, C)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows {self.start}..{self.start + self.rows}"
                f", padding_idx={self.padding_idx}")
