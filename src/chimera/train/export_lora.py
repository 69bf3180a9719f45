"""``chimera export`` of a run that trained LoRA adapters (``--lora-rank``).

A checkpoint holds the frozen base weights under their own names and each adapter beside its
layer (``model.layers.0.self_attn.q_proj.lora_A.weight``). The export is either

- merged (the default): each adapted weight becomes ``W + (alpha / r) B A`` (transposed for
  HF's Conv1D, which stores in x out), the adapters dropped: an ordinary HF folder;
- the base alone (``--no-merge-lora``): the weights the adapters were trained on;
- the adapters alone (``--adapter-only``): the folder ``peft`` writes and
  ``peft.PeftModel.from_pretrained(base, folder)`` loads onto the base (adapter_config.json,
  adapter_model.safetensors keyed ``base_model.model.<HF module>.lora_A.weight``).
"""

from __future__ import annotations

import json
from pathlib import Path

from chimera.errors import UserError
from chimera.models.lora import is_adapter, merged

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def _hf_module(source, name: str) -> tuple[str, bool]:
    """A checkpoint's module name -> (HF's module path, whether HF stores its weight in x
    out: a Conv1D). HF sources are keyed by HF names already; a GPT-2 preset's map through
    ``chimera.hf.preset`` (HF's GPT2LMHeadModel)."""
    if hasattr(source, "model"):  # chimera.hf.source.HFSource: the HF model on meta
        module = source.model.source.get_submodule(name)
        return name, type(module).__name__ == "Conv1D"
    from chimera.hf.preset import hf_name  # optional extra (hf): transformers

    hf, transposed = hf_name(f"{name}.weight")
    return hf[:-len(".weight")], transposed


def _adapted(state: dict) -> list[str]:
    """The module names that carry an adapter."""
    return sorted(k[:-len(".lora_A.weight")] for k in state if k.endswith(".lora_A.weight"))


def prepare(source, state: dict, lora: dict | None, merge: bool) -> dict:
    """The weights an HF folder gets: merged with the adapters, or the base alone."""
    if lora is None:
        return state
    if not merge:
        return {k: v for k, v in state.items() if not is_adapter(k)}
    conv = {m for m in _adapted(state) if hasattr(source, "model") and _hf_module(source, m)[1]}
    return merged(state, lora["alpha"] / lora["rank"],
                  lambda weight: weight[:-len(".weight")] in conv)


def write_adapter(source, state: dict, lora: dict | None, folder: Path) -> None:
    """The folder ``peft`` loads: adapter_config.json and adapter_model.safetensors."""
    from safetensors.torch import save_file  # optional extra (hf)

    if lora is None:
        raise UserError("--adapter-only: the checkpoint has no LoRA adapters (it was trained "
                        "without --lora-rank); export the whole model")
    modules, tensors, transposed = [], {}, False
    for name in _adapted(state):
        hf, conv = _hf_module(source, name)
        modules.append(hf)
        transposed |= conv
        for part in ("lora_A", "lora_B"):
            tensors[f"base_model.model.{hf}.{part}.weight"] = \
                state[f"{name}.{part}.weight"].detach().cpu().contiguous().clone()
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM" if source.kind == "gpt2" else None,
              "r": lora["rank"], "lora_alpha": lora["alpha"], "lora_dropout": 0.0,
              "target_modules": modules, "fan_in_fan_out": transposed, "bias": "none",
              "inference_mode": True, "init_lora_weights": True, "base_model_name_or_path": None}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
