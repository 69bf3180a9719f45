"""chimera's GPT-2 presets as Hugging Face ``GPT2LMHeadModel`` folders (``chimera export``).

Our GPT-2 (``chimera.models.gpt2``) is HF's GPT-2 with three differences of form, none of
arithmetic: projections are ``nn.Linear`` (HF's ``Conv1D`` stores the transpose), the head is
untied (``tie_word_embeddings=False``), and names differ. GELU is the tanh approximation
(HF's ``gelu_new``), LayerNorm's epsilon 1e-5, attention scaled by 1/sqrt(head size), so
``from_pretrained`` gives our logits. BERT presets have no HF twin (no token-type
embeddings, an untied decoder with its own bias) and are refused.
"""

from __future__ import annotations

from pathlib import Path

import torch

from chimera.errors import UserError
from chimera.hf.weights import save_folder

# our name inside a block -> (HF's, transposed: Linear -> Conv1D)
_BLOCK = {"ln1.weight": ("ln_1.weight", False), "ln1.bias": ("ln_1.bias", False),
          "attn.qkv.weight": ("attn.c_attn.weight", True), "attn.qkv.bias": ("attn.c_attn.bias", False),
          "attn.proj.weight": ("attn.c_proj.weight", True), "attn.proj.bias": ("attn.c_proj.bias", False),
          "ln2.weight": ("ln_2.weight", False), "ln2.bias": ("ln_2.bias", False),
          "mlp.fc.weight": ("mlp.c_fc.weight", True), "mlp.fc.bias": ("mlp.c_fc.bias", False),
          "mlp.proj.weight": ("mlp.c_proj.weight", True), "mlp.proj.bias": ("mlp.c_proj.bias", False)}
_OUTER = {"embed.tok.weight": "transformer.wte.weight", "embed.pos.weight": "transformer.wpe.weight",
          "head.ln_f.weight": "transformer.ln_f.weight", "head.ln_f.bias": "transformer.ln_f.bias",
          "head.lm_head.weight": "lm_head.weight"}


def gpt2_config(cfg):
    """The ``GPT2Config`` of a chimera GPT-2 ``ModelConfig``."""
    from transformers import GPT2Config  # start-up time: transformers loads when exporting

    if cfg.kind != "gpt2":
        raise UserError(f"chimera's {cfg.kind} presets have no Hugging Face twin (no token-type "
                         "embeddings, an untied decoder): export writes GPT-2 presets and "
                         "Hugging Face models (--model hf-..., hf:PATH)")
    return GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.seq_len, n_embd=cfg.d_model,
                      n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=cfg.mlp_ratio * cfg.d_model,
                      activation_function="gelu_new", resid_pdrop=cfg.dropout,
                      embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, layer_norm_epsilon=1e-5,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                      architectures=["GPT2LMHeadModel"])


def hf_name(name: str) -> tuple[str, bool]:
    """Our model-wide name -> (HF's, transposed)."""
    if name in _OUTER:
        return _OUTER[name], False
    _, index, rest = name.split(".", 2)  # blocks.<i>.<rest>
    hf, transposed = _BLOCK[rest]
    return f"transformer.h.{index}.{hf}", transposed


def export_preset(cfg, state: dict[str, torch.Tensor], folder: str | Path) -> Path:
    """A GPT-2 preset's checkpoint state (``build_model(cfg).state_dict()`` keys) -> a
    ``save_pretrained`` folder of ``GPT2LMHeadModel``."""
    config = gpt2_config(cfg)
    tensors = {}
    for name, t in state.items():
        try:
            hf, transposed = hf_name(name)
        except (KeyError, ValueError):
            raise UserError(f"{name}: not a parameter of chimera's GPT-2") from None
        tensors[hf] = t.t() if transposed else t
    config.dtype = next(iter(tensors.values())).dtype
    save_folder(Path(folder), tensors, config)
    return Path(folder)
