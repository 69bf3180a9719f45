"""A vocab-parallel embedding and a column-parallel LM head, for any vocabulary size.

Both shard the vocabulary (dim 0 of the weight) over the T ranks. A vocabulary that T does
not divide is padded with zero rows to the next multiple of T, so every rank holds an equal
shard (NCCL's collectives want equal sizes, and an embedding and a head tied across stages
then have the same layout and sum their local shards). The padding rows are never looked
up, their logits are stripped, so their gradients stay zero and an optimizer leaves them
zero; each padded parameter carries its real row count (``PADDED_ROWS``) so that
``norm.full_tensor`` strips the padding on export.

The head gathers its logits (an all-gather of (B, S, V) per micro-batch) and strips the
padding, so the last stage's output is the plain, replicated (B, S, V) the loss functions
already take: exact, and nothing downstream knows about TP. The trade-off: each TP rank
holds the full logits and computes the same loss, where a vocab-parallel cross-entropy
(Megatron's; torch's ``loss_parallel``) keeps only (B, S, V/T) per rank and exchanges
(B, S) sums, at the price of a loss that must see the sharded logits and mask the padding.
That is the one to add when the logits' memory matters (large V, long sequences).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from chimera.tp.styles import Colwise, distribute_params

# On a padded parameter: how many of its rows (dim 0) are real.
PADDED_ROWS = "chimera_tp_rows"


def padded_size(rows: int, tp: int) -> int:
    """``rows`` rounded up to a multiple of ``tp``."""
    return -(-rows // tp) * tp


def _pad_rows(module: nn.Module, name: str, rows: int) -> None:
    """Zero rows appended to parameter ``name`` up to ``rows`` (no-op when already there)."""
    param = getattr(module, name)
    if param is None or param.shape[0] == rows:
        return
    extra = param.new_zeros((rows - param.shape[0], *param.shape[1:]))
    with torch.no_grad():
        padded = torch.cat([param.detach(), extra])
    module.register_parameter(name, nn.Parameter(padded, requires_grad=param.requires_grad))


def _mark(module: nn.Module, rows: int) -> None:
    for param in module.parameters(recurse=False):
        setattr(param, PADDED_ROWS, rows)


def _local_padding_idx(padding_idx: int | None, rows: int, rank: int, tp: int) -> int | None:
    """The padding row as this rank's shard indexes it, None where another rank holds it (a
    global index would freeze another token's row on the other ranks)."""
    if padding_idx is None:
        return None
    local = padding_idx - rank * (rows // tp)
    return local if 0 <= local < rows // tp else None


class VocabEmbedding(ParallelStyle):
    """An ``nn.Embedding`` with its vocabulary sharded (padded to a multiple of T): each rank
    looks up the tokens in its rows, zeros elsewhere; one allreduce sums them.

    The lookup is local, not DTensor's: DTensor has no row-sharded rule for the embedding's
    backward and computes the full (V, C) gradient, replicated, on every rank (T times the
    memory, and a gradient whose layout differs from its parameter's)."""

    def problem(self, module: nn.Module, tp: int) -> str | None:
        if not isinstance(module, nn.Embedding):
            return "VocabEmbedding takes an nn.Embedding"
        if module.scale_grad_by_freq or module.sparse or module.max_norm is not None:
            # each counts or renormalizes rows of the local lookup, where other ranks'
            # tokens stand in as row 0
            return "VocabEmbedding does not take max_norm, scale_grad_by_freq or sparse embeddings"
        return None

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        tp, real = device_mesh.size(), module.num_embeddings
        rows = padded_size(real, tp)
        _pad_rows(module, "weight", rows)
        module.num_embeddings = rows
        distribute_params(module, device_mesh, {"weight": Shard(0)}, self.src_data_rank)
        module.padding_idx = _local_padding_idx(module.padding_idx, rows,
                                                device_mesh.get_local_rank(), tp)
        module.forward = partial(_vocab_lookup, module, device_mesh)
        _mark(module, real)
        return module


def _vocab_lookup(module: nn.Embedding, mesh, ids: torch.Tensor) -> torch.Tensor:
    """(B, S) token ids, replicated -> (B, S, C), replicated: this rank's rows looked up,
    other tokens zero, summed over the ranks (backward: no collective)."""
    weight = module.weight.to_local()                         # (V/T, C)
    local = ids - mesh.get_local_rank() * weight.shape[0]
    outside = (local < 0) | (local >= weight.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), weight, module.padding_idx)  # (B, S, C), partial
    out = out.masked_fill(outside.unsqueeze(-1), 0)
    summed = DTensor.from_local(out, mesh, [Partial()]).redistribute(placements=[Replicate()])
    return summed.to_local()


def _strip(real: int, module, inputs, logits: torch.Tensor) -> torch.Tensor:
    return logits[..., :real]


class VocabHead(Colwise):
    """An ``nn.Linear`` LM head with its output vocabulary sharded (padded to a multiple of
    T); the logits are gathered and the padding stripped: (B, S, C) -> (B, S, V), plain."""

    def __init__(self):
        super().__init__(output_layouts=Replicate(), use_local_output=True)

    def problem(self, module: nn.Module, tp: int) -> str | None:
        return None if isinstance(module, nn.Linear) else "VocabHead takes an nn.Linear"

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        real = module.out_features
        rows = padded_size(real, device_mesh.size())
        _pad_rows(module, "weight", rows)
        _pad_rows(module, "bias", rows)
        module.out_features = rows
        module = super()._apply(module, device_mesh)
        module.register_forward_hook(partial(_strip, real))  # after the gather, registered first
        _mark(module, real)
        return module
