"""Tiny HF models and padded batches the chimera.hf tests run pipelined and in one process.

Each model is saved (``save_pretrained``, float64 safetensors) to a folder the pipelined
runs load; the reference trains the same HF model object in one process. Dropout is off.
"""

from __future__ import annotations

import torch
import transformers
from transformers import BertConfig, GPT2Config, LlamaConfig

V, T = 37, 8  # vocabulary, longest sequence
MASK_ID = 3  # BERT's [MASK] in these batches


def config(arch: str, attn: str):
    if arch == "gpt2":  # tied lm_head (GPT-2's default)
        return GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=4, n_positions=16, bos_token_id=0,
                          eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                          attn_implementation=attn)
    if arch == "llama":  # GQA: 4 query heads share 2 key/value heads; RoPE; untied head
        return LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                           bos_token_id=0, eos_token_id=0, pad_token_id=None, attn_implementation=attn)
    if arch == "bert":  # tied decoder weight and bias
        return BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, pad_token_id=0, attn_implementation=attn)
    raise KeyError(arch)


CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertForMaskedLM"}
ATTN = {"gpt2": "sdpa", "llama": "eager", "bert": "eager"}  # eager Llama: the causal-mask trap


def build(arch: str, attn: str | None = None, dtype=torch.float64, seed: int = 0):
    torch.manual_seed(seed)
    cls = getattr(transformers, CLASSES[arch])
    return cls(config(arch, attn or ATTN[arch])).to(dtype).train()


def saved(root, archs) -> dict:
    """Per architecture: the folder ``save_pretrained`` wrote under ``root`` (float64) and the
    model object."""
    out = {}
    for arch in archs:
        model = build(arch)
        model.save_pretrained(root / arch)
        out[arch] = (str(root / arch), model)
    return out


def batch(arch: str, seed: int, rows: int, length: int = T, left: bool = False):
    """(inputs dict, labels): right-padded rows of random lengths (left-padded with ``left``);
    causal labels are the ids (-100 on padding), MLM labels the ids at ~40% of real tokens
    (those inputs replaced by [MASK]); BERT gets token types too."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, V, (rows, length), generator=g)
    lengths = torch.randint(2, length + 1, (rows,), generator=g)
    pos = torch.arange(length)[None, :]
    mask = (pos >= length - lengths[:, None]) if left else (pos < lengths[:, None])
    mask = mask.long()
    inputs = {"input_ids": ids, "attention_mask": mask}
    if arch != "bert":
        return inputs, ids.masked_fill(mask == 0, -100)
    chosen = (torch.rand(rows, length, generator=g) < 0.4) & (mask == 1)
    chosen[:, 0] |= mask[:, 0] == 1  # at least one label per row
    inputs["input_ids"] = ids.masked_fill(chosen, MASK_ID)
    inputs["token_type_ids"] = (pos >= length // 2).long().expand(rows, length).clone()
    return inputs, ids.masked_fill(~chosen, -100)


def plan(arch: str, rows: int) -> list:
    """3 steps; the second one shorter (a new shape: the pipeline probes again)."""
    return [batch(arch, 0, rows), batch(arch, 1, rows, length=T - 3), batch(arch, 2, rows)]


def loss_of(arch: str, logits, labels):
    """HF's loss definition (shifted for causal LMs, token mean), kept in float64 (HF's own
    ``labels=`` loss computes in float32)."""
    from chimera import hf

    if arch == "bert":
        return hf.token_loss(logits, labels) / hf.target_count(labels)
    return hf.causal_lm_loss(logits, labels) / hf.causal_label_count(labels)


# AdamW's eps above the float64 noise of gradients that are exactly zero in exact arithmetic
# (attention key biases: softmax ignores a shift of all scores; ~1e-20 here): with the
# default 1e-8, Adam's normalization turns that noise into lr-sized, run-dependent steps
LR, DECAY, EPS = 0.05, 0.1, 1e-6


def reference(model, arch: str, rows: int) -> dict:
    """HF's model trained in one process: gradients of each step, parameters after 3 AdamW steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=DECAY, eps=EPS)
    out = {"grads": [], "losses": []}
    for inputs, labels in plan(arch, rows):
        opt.zero_grad()
        loss = loss_of(arch, model(**inputs).logits, labels)
        loss.backward()
        out["losses"].append(float(loss.detach()))
        named = model.named_parameters(remove_duplicate=False)  # a tied one under both names
        out["grads"].append({n: p.grad.clone() for n, p in named})
        opt.step()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return out


def pipelined(model, pipe, arch: str, rows: int) -> dict:
    """The same through a Pipeline of ``model`` (a chimera.hf.HFModel); names are HF's."""
    # (a group: a rank whose stages are all frozen has nothing to give AdamW, which refuses
    # an empty list but not an empty group)
    opt = torch.optim.AdamW([{"params": pipe.parameters()}], lr=LR, weight_decay=DECAY, eps=EPS)
    out = {"grads": [], "losses": []}
    for inputs, labels in plan(arch, rows):
        opt.zero_grad()
        out["losses"].append(pipe.step(inputs, labels))
        out["grads"].append([(model.hf_name(n), None if p.grad is None else p.grad.clone())
                             for n, p in pipe.named_parameters()])  # None: frozen
        opt.step()
    out["params"] = [(model.hf_name(n), p.detach().clone()) for n, p in pipe.named_parameters()]
    out["read"] = model.read_keys
    out["held"] = sorted({i for (_, s) in pipe.runtime.modules for i in pipe.ranges[s]})
    return out
