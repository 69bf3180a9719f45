"""Hugging Face models as pipeline layers: ``GPT2LMHeadModel``, ``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``MistralForCausalLM``, ``Qwen3ForCausalLM``, ``GemmaForCausalLM``,
``Phi3ForCausalLM``, ``BertForMaskedLM``
(``ARCHS``; optional extra ``hf``: ``pip install 'chimera-pipeline[hf]'``).

Sketch (every rank runs ``main``; ``ids``, ``mask``: a padded batch, the same on every rank;
the folder was written by ``save_pretrained``, or holds only a ``config.json``)::

    import torch
    import chimera.api as chimera
    from chimera import hf

    def main(rank, world):
        model = hf.load("my-llama/")                # reads nothing yet
        pipe = model.pipeline(schedule="chimera", stages=2, micro_batches=4, micro_batch_size=2)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
        for step in range(100):
            inputs = {"input_ids": ids, "attention_mask": mask}     # (8, T) each, same on all ranks
            labels = ids.masked_fill(mask == 0, -100)               # shifted inside the loss
            opt.zero_grad()
            pipe.step(inputs, labels)
            opt.step()
        model.save_pretrained(pipe, "trained/")        # rank 0 writes; from_pretrained loads it

    chimera.spawn(main, world=2)

What it computes is what HF's model computes on the same batch: the layers are HF's own
modules, masks come from HF's mask functions (``attention_mask`` padding, causality, packed
sequences), and the loss is HF's (a token mean over labels != -100; causal labels shifted).
Each rank reads only the checkpoint tensors of the stages it holds.
"""

try:
    import safetensors  # noqa: F401
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"chimera.hf needs transformers and safetensors ({exc.name} is missing): "
                      "pip install 'chimera-pipeline[hf]'") from None

from chimera.hf.layers import causal_label_count, causal_lm_loss, target_count, token_loss
from chimera.hf.model import ARCHS, HFModel, check_config, load

__all__ = ["ARCHS", "HFModel", "causal_label_count", "causal_lm_loss", "check_config", "load",
           "target_count", "token_loss"]
