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
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

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
    """The padding row as this rank's shard indexes it, None where another rank holds it:
    DTensor hands the module's padding_idx to the local lookup unchanged, and a global index
    there would freeze the gradient of another token's row on every other rank."""
    if padding_idx is None:
        return None
    local = padding_idx - rank * (rows // tp)
    return local if 0 <= local < rows // tp else None


class VocabEmbedding(RowwiseParallel):
    """An ``nn.Embedding`` with its vocabulary sharded (padded to a multiple of T): each rank
    looks up the tokens in its rows, zeros elsewhere; one allreduce sums them."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        tp, real = device_mesh.size(), module.num_embeddings
        rows = padded_size(real, tp)
        _pad_rows(module, "weight", rows)
        module.num_embeddings = rows
        module = super()._apply(module, device_mesh)
        module.padding_idx = _local_padding_idx(module.padding_idx, rows,
                                                device_mesh.get_local_rank(), tp)
        _mark(module, real)
        return module


def _strip(real: int, module, inputs, logits: torch.Tensor) -> torch.Tensor:
    return logits[..., :real]


class VocabHead(ColwiseParallel):
    """An ``nn.Linear`` LM head with its output vocabulary sharded (padded to a multiple of
    T); the logits are gathered and the padding stripped: (B, S, C) -> (B, S, V), plain."""

    def __init__(self):
        super().__init__(output_layouts=Replicate(), use_local_output=True)

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
