"""Tiny HF models and padded batches the chimera.hf tests run pipelined and in one process.

Each model is saved (``save_pretrained``, float64 safetensors) to a folder the pipelined
runs load; the reference trains the same HF model object in one process. Dropout is off.
"""

from __future__ import annotations

import torch
import transformers
from transformers import (BertConfig, GemmaConfig, GPT2Config, LlamaConfig, MistralConfig, Phi3Config,
                          Qwen2Config, Qwen3Config)

V, T = 37, 8  # vocabulary, longest sequence
WINDOW = 4  # sliding_window of the Mistral and Qwen3 configs: shorter than T
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
    small = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                 bos_token_id=0, eos_token_id=0, pad_token_id=None, attn_implementation=attn)
    if arch == "qwen2":  # q/k/v biases, tied head (the small Qwen2s' default), full attention
        return Qwen2Config(**small, tie_word_embeddings=True)
    if arch == "mistral":  # every layer slides: a window of 4 in sequences of up to 8
        return MistralConfig(**small, sliding_window=WINDOW)
    if arch == "qwen3":  # q/k norms, head_dim 8 != 16 / 4; layer 0 full, layer 1 sliding
        return Qwen3Config(**small, head_dim=8, use_sliding_window=True, sliding_window=WINDOW,
                           max_window_layers=1)
    if arch == "gemma":  # embedding scaled by sqrt(16), RMSNorm by (1 + w), GELU, tied head
        return GemmaConfig(**small, head_dim=4)
    if arch == "phi3":  # fused qkv_proj (GQA: unequal parts) and gate_up_proj, half the dims rotate
        return Phi3Config(**small, partial_rotary_factor=0.5)
    if arch == "bert":  # tied decoder weight and bias
        return BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, pad_token_id=0, attn_implementation=attn)
    raise KeyError(arch)


CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertForMaskedLM",
           "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "gemma": "GemmaForCausalLM", "phi3": "Phi3ForCausalLM"}
# eager Llama and Qwen2: the causal-mask trap; sdpa where a window is: eager HF gives NaN on
# the rows of a right-padded sequence whose window holds padding only (and NaN gradients)
ATTN = {"gpt2": "sdpa", "llama": "eager", "bert": "eager", "qwen2": "eager", "mistral": "sdpa",
        "qwen3": "sdpa", "gemma": "eager", "phi3": "eager"}
FAMILIES = ("qwen2", "mistral", "qwen3", "gemma", "phi3")  # the Llama-like families beyond Llama


def build(arch: str, attn: str | None = None, dtype=torch.float64, seed: int = 0):
    """HF's model of ``config(arch)``, initialized by HF from ``seed``; the new families'
    biases and norm weights (zeros and ones from HF) perturbed, so that they matter."""
    torch.manual_seed(seed)
    cls = getattr(transformers, CLASSES[arch])
    model = cls(config(arch, attn or ATTN[arch])).to(dtype).train()
    if arch in FAMILIES:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.add_(0.1 * torch.randn(p.shape, dtype=p.dtype))
    return model


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
TOL = dict(rtol=1e-10, atol=1e-12)  # float64: a pipelined run against one process
# Gemma's RMSNorm computes in float32 in a float64 model too (``(x * (1 + w)).float()``), so
# its weight gradients are float32 sums over the rows, whose order micro-batching changes
# (~1e-7 relative): float32's agreement, not float64's
TOL32 = dict(rtol=1e-5, atol=1e-6)


def tolerance(arch: str) -> dict:
    return TOL32 if arch == "gemma" else TOL


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


def check_pipelined(got: list[dict], ref: dict, tol: dict = TOL) -> None:
    """``pipelined``'s results of every rank against ``reference``: every rank's every copy
    of every parameter (tied ones under both names), gradients of each step and parameters
    after the last at 1e-10 (``tol``), the losses too."""
    import pytest

    for rank, res in enumerate(got):
        for k in range(3):
            for name, g in res["grads"][k]:
                assert torch.allclose(g, ref["grads"][k][name], **tol), (rank, k, name)
        assert res["losses"] == pytest.approx(ref["losses"], rel=tol["rtol"])
        for name, p in res["params"]:
            assert torch.allclose(p, ref["params"][name], **tol), (rank, name)
