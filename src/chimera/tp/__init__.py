"""Tensor parallelism inside a pipeline stage: each layer sharded over the T ranks of a TP
group, Megatron-style, with collectives through the run's transport.

Conventions (said once):
- T ranks hold the same stage(s), each a slice of every sharded parameter; global rank =
  (w*D + d)*T + t, TP innermost. A layer's TP group is a :class:`TPGroup`: the transport,
  the ``new_group`` of its ranks, t and T.
- Every TP rank builds the same whole layer (one seed); ``parallelize`` replaces its
  projections, embedding and head by sharded modules holding this rank's slices as plain
  ``nn.Parameter``s, each carrying a :class:`Shard` (``shard_of``); parameters without one
  are replicated. No communication.
- Every plan takes its layer's input replicated and returns its output replicated and
  plain (column-parallel in, row-parallel out, one allreduce per sub-block each way), so what
  crosses a stage boundary is the tensor it is without TP.
- A plan maps submodule name patterns to entries of ours, torch ``ParallelStyle``s or HF
  ``base_model_tp_plan`` strings (``plans``); ``parallelize`` checks it whole, then shards.
- An LM head's logits are gathered whole for any loss, or kept sharded over the vocabulary
  for a loss that takes them (``takes_sharded_logits``; ``cross_entropy``: Megatron's
  vocab-parallel cross-entropy, three reductions of (B, S) instead of a gather of (B, S, V)).
- Dropout draws from explicit generators (``TPRandom``), never torch's global one: a
  replicated stream (the same on the T ranks) for replicated tensors, a sharded stream (one
  per t) for sharded ones, replayed by recomputation (Megatron's RNG discipline).
- ``full_tensor`` / ``local_slice`` go between a slice and the whole (export, checkpoints);
  ``squared_norm_share`` is a rank's share of the gradient norm.
"""

from chimera.tp.apply import parallelize, resolve
from chimera.tp.group import TPGroup, copy_to_tp, gather_from_tp, reduce_from_tp, split_to_tp
from chimera.tp.layers import ColumnParallel, GatheredHead, RowParallel, ShardedHead, TPModule, VocabEmbedding
from chimera.tp.loss import ShardedLogits, accepts_sharded_logits, cross_entropy, takes_sharded_logits
from chimera.tp.plans import (HF_LLAMA_TP_PLAN, HF_STYLES, embedding_plan, from_hf, gpt2_block_plan,
                              head_plan, hf_gpt2_block_plan, llama_decoder_plan, prefixed, shared_input,
                              style, styles)
from chimera.tp.shard import (Shard, full_grad, full_state_dict, full_tensor, local_slice, padded_size,
                              replicated_mask, shard_of, squared_norm_share)
from chimera.tp.random import TPDropout, TPRandom
from chimera.tp.styles import (Colwise, Dropout, EmbeddingRowwise, LocalHeads, Replicated, Rowwise,
                               SharedInput, VocabHead)

__all__ = ["Colwise", "ColumnParallel", "Dropout", "EmbeddingRowwise", "GatheredHead",
           "HF_LLAMA_TP_PLAN", "HF_STYLES", "LocalHeads", "Replicated", "RowParallel", "Rowwise",
           "Shard", "ShardedHead", "ShardedLogits", "SharedInput", "TPDropout", "TPGroup",
           "TPModule", "TPRandom", "VocabEmbedding", "VocabHead", "accepts_sharded_logits",
           "copy_to_tp", "cross_entropy", "embedding_plan", "from_hf", "full_grad",
           "full_state_dict", "full_tensor", "gather_from_tp", "gpt2_block_plan", "head_plan",
           "hf_gpt2_block_plan", "llama_decoder_plan", "local_slice", "padded_size", "parallelize",
           "prefixed", "reduce_from_tp", "replicated_mask", "resolve", "shard_of", "shared_input",
           "split_to_tp", "squared_norm_share", "style", "styles", "takes_sharded_logits"]
