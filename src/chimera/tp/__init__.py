"""Tensor parallelism inside a pipeline stage: each layer sharded over the T ranks of a TP
group, with torch's DTensor tensor parallelism.

Conventions (said once):
- T ranks hold the same stage(s), each a shard of every sharded parameter; global rank =
  (w*D + d)*T + t, TP innermost. A layer's TP group is a 1-D ``DeviceMesh`` made from an
  existing process group (``tp_mesh``).
- Every plan takes its layer's input replicated and returns its output replicated and
  plain (column-parallel in, row-parallel out, one allreduce per sub-block), so what crosses
  a stage boundary is the tensor it is without TP.
- A plan maps submodule name patterns to torch ``ParallelStyle``s or HF
  ``base_model_tp_plan`` strings (``plans``); ``parallelize`` checks it whole, then shards.
- Parameters become DTensors, and so do their gradients; ``norm`` gives local and full
  tensors and each rank's share of a gradient norm.
"""

from chimera.tp.apply import parallelize, resolve, tp_mesh
from chimera.tp.norm import (full_grad, full_state_dict, full_tensor, local_tensor,
                             squared_norm_share)
from chimera.tp.plans import (HF_LLAMA_TP_PLAN, HF_STYLES, embedding_plan, from_hf, gpt2_block_plan,
                              head_plan, hf_gpt2_block_plan, llama_decoder_plan, prefixed, shared_input,
                              style, styles)
from chimera.tp.styles import Colwise, LocalHeads, Replicated, Rowwise
from chimera.tp.vocab import PADDED_ROWS, VocabEmbedding, VocabHead, padded_size

__all__ = ["Colwise", "HF_LLAMA_TP_PLAN", "HF_STYLES", "LocalHeads", "PADDED_ROWS", "Replicated",
           "Rowwise", "VocabEmbedding", "VocabHead", "embedding_plan", "from_hf", "full_grad", "full_state_dict", "full_tensor",
           "gpt2_block_plan", "head_plan", "hf_gpt2_block_plan", "llama_decoder_plan",
           "local_tensor", "padded_size", "parallelize", "prefixed", "resolve", "shared_input",
           "squared_norm_share", "style", "styles", "tp_mesh"]
