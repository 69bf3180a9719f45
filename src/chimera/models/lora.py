"""Parameter-efficient fine-tuning: parameters frozen by name, LoRA adapters on linear layers.

Names are model-wide: ``"<layer index>.<name in the layer>"`` (``"3.attn.qkv.weight"``), as
``nn.Sequential(*layers)`` names them; patterns are shell-style globs over them
(``fnmatch``: ``*`` matches across dots, so ``"*.q_proj"`` names every layer's ``q_proj``).

LoRA (Hu et al., 2021): a target linear layer ``y = x W^T + b`` computes ``y + s B A
dropout(x)``, ``A`` (r x in) kaiming-uniform, ``B`` (out x r) zero, ``s = alpha / r``, so
training starts from the base model; the base weights are frozen. The adapter is added to the
layer in place: two bias-free ``nn.Linear`` children ``lora_A`` and ``lora_B`` and a forward
hook. The layer keeps its own parameter names, so the base weights' checkpoint keys, HF names,
ties and tensor-parallel plans do not change, and an adapter's names are the ones ``peft``
writes (``q_proj.lora_A.weight``). ``nn.Linear`` and HF's ``Conv1D`` (GPT-2's ``c_attn``:
weight stored in x out) take an adapter.

Why not ``peft`` itself: its ``LoraLayer`` replaces the module, renaming the base weight
(``q_proj.base_layer.weight``) and inserting the adapter's name (``lora_A.default.weight``),
so every name-keyed part of a run (checkpoint keys, HF export, ties, plans, ``--freeze``
patterns) would need a translation; it draws its initialization from the global RNG inside
the wrap (a stage's layers must get the same adapters on every layout) and imports
``transformers`` even for the built-in models. What ``peft`` is needed for, loading the
adapter folder ``chimera export --adapter-only`` writes, is tested against ``peft`` itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Sequence

import torch
from torch import nn

from chimera.byo import layer_seed
from chimera.errors import UserError
from chimera.rng import seeded

# the attention query and value projections of the families chimera builds (names do not
# collide across them): HF Llama-like (q_proj, v_proj), Phi-3 (qkv_proj: q, k and v in one),
# HF GPT-2 (c_attn, likewise), chimera's GPT-2 (attn.qkv), HF BERT (query, value)
DEFAULT_TARGETS = ("*.q_proj", "*.v_proj", "*.qkv_proj", "*.c_attn", "*.attn.qkv", "*.query",
                   "*.value")
ADAPTER_PARTS = ("lora_A", "lora_B")
_SALT = 0x10EA  # adapters draw from another stream than their layer's own initialization


@dataclass(frozen=True)
class LoRAOptions:
    """LoRA adapters: ``rank`` r, ``alpha`` (the update is scaled by alpha / r),
    ``targets``: globs over model-wide module names (None: :data:`DEFAULT_TARGETS`, the
    attention query and value projections), ``dropout`` on the adapter's input (0: the
    gradients equal one process's; dropout draws differ across ranks)."""

    rank: int = 8
    alpha: float = 16.0
    targets: Sequence[str] | None = None
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise UserError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        number = isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool)
        if not number or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise UserError(f"LoRA alpha must be a positive number, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if self.targets is not None and (isinstance(self.targets, str) or not self.targets):
            raise UserError(f"LoRA targets must be a non-empty list of patterns, got "
                            f"{self.targets!r}")

    @property
    def patterns(self) -> tuple[str, ...]:
        return tuple(self.targets) if self.targets is not None else DEFAULT_TARGETS

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def matches(patterns: Sequence[str], name: str) -> list[str]:
    """The patterns of ``patterns`` that match ``name``."""
    return [p for p in patterns if fnmatchcase(name, p)]


def linear_sizes(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a layer that takes an adapter, None for any other module."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    weight = getattr(module, "weight", None)  # HF's Conv1D: y = x W + b, W is (in, out)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return weight.shape[0], weight.shape[1]
    return None


def _lora_forward(module: nn.Module, args, output):
    """The forward hook of an adapted layer: its output plus the scaled low-rank update."""
    x = module.lora_dropout(args[0])
    return output + module.lora_B(module.lora_A(x)) * module.lora_scaling


def add_adapter(module: nn.Module, options: LoRAOptions) -> None:
    """``module`` (a linear layer, checked by the caller) gets ``lora_A``, ``lora_B`` and the
    hook (freezing its base weights is the caller's). Draws A from the global RNG (seed it)."""
    fan_in, fan_out = linear_sizes(module)
    like = dict(dtype=module.weight.dtype, device=module.weight.device)
    module.lora_A = nn.Linear(fan_in, options.rank, bias=False, **like)
    module.lora_B = nn.Linear(options.rank, fan_out, bias=False, **like)
    nn.init.kaiming_uniform_(module.lora_A.weight, a=math.sqrt(5))  # nn.Linear's and peft's
    nn.init.zeros_(module.lora_B.weight)
    module.lora_dropout = nn.Dropout(options.dropout) if options.dropout else nn.Identity()
    module.lora_scaling = options.scaling
    module.register_forward_hook(_lora_forward)


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (``...q_proj.lora_A.weight``)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ADAPTER_PARTS


def adapt_layer(index: int, layer: nn.Module, options: LoRAOptions, seed: int) -> set[str]:
    """Adapters on the submodules of layer ``index`` whose model-wide names match a target,
    every other parameter of the layer frozen; the patterns that matched (the layer itself is
    named by its index: ``"2"``). A given pattern naming a module that is not a linear layer is
    refused (the default ones pass over it). The same adapters on every rank and layout: drawn
    with a seed of the layer's."""
    used: set[str] = set()
    targets = []
    for name, module in layer.named_modules():
        hit = matches(options.patterns, f"{index}.{name}" if name else str(index))
        if not hit or (options.targets is None and linear_sizes(module) is None):
            continue
        if linear_sizes(module) is None:
            raise UserError(f"LoRA target {hit[0]!r} names {index}.{name}, a "
                            f"{type(module).__name__}: adapters go on linear layers (nn.Linear, "
                            "HF Conv1D); name the projections, e.g. '*.q_proj'")
        used.update(hit)
        targets.append(module)
    for p in layer.parameters():
        p.requires_grad_(False)
    with seeded(layer_seed(seed, index) ^ _SALT):
        for module in targets:
            add_adapter(module, options)
    return used


def freeze(module: nn.Module, patterns: Sequence[str],
           ties: Sequence[Sequence[str]] = ()) -> set[str]:
    """Freeze the parameters of ``module`` (named model-wide) that a pattern matches; a tied
    weight is frozen under all its names when any matches (its copies in other stages must
    agree). The patterns that matched."""
    tie_of = {n: names for names in ties for n in names}
    used: set[str] = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        hit = {q for n in tie_of.get(name, (name,)) for q in matches(patterns, n)}
        if hit:
            p.requires_grad_(False)
            used |= hit
    return used


def refuse_tied_targets(options: LoRAOptions | None, ties: Sequence[Sequence[str]]) -> None:
    """An adapter on a tied weight would train one copy's update and not the other's: refused
    (leave the tied projection out of the targets, or untie it)."""
    for names in ties if options is not None else ():
        for name in names:
            hit = matches(options.patterns, name.rpartition(".")[0])
            if hit:
                raise UserError(f"LoRA target {hit[0]!r} names {name.rpartition('.')[0]}, whose "
                                f"weight is tied ({', '.join(names)}): adapters on tied weights "
                                "are not supported; leave it out of the targets")


def refuse_unused(every: Sequence[set[tuple[str, str]]], freeze_patterns: Sequence[str],
                  options: LoRAOptions | None, examples: dict | None = None) -> None:
    """``every``: per rank, the patterns that named something there. A freeze pattern or an
    explicit LoRA target that named nothing on any rank is a typo: refused, with some of the
    model's names (``examples``: "parameters" and "linear" lists); the default targets must
    name something."""
    used = set().union(*every) if every else set()
    examples = examples or {}
    unused = [p for p in freeze_patterns if ("freeze", p) not in used]
    if unused:
        raise UserError(f"freeze pattern(s) {', '.join(map(repr, unused))} match no parameter "
                        "(globs over model-wide names; this model's include "
                        f"{_some(examples.get('parameters'))})")
    if options is None:
        return
    hits = [p for p in options.patterns if ("lora", p) in used]
    if options.targets is None and not hits:
        raise UserError(f"LoRA: the default targets ({', '.join(DEFAULT_TARGETS)}) name no "
                        "linear layer of this model: give the targets (--lora-targets); its "
                        f"linear layers include {_some(examples.get('linear'))}")
    unused = [p for p in options.patterns if ("lora", p) not in used] if options.targets else []
    if unused:
        raise UserError(f"LoRA target(s) {', '.join(map(repr, unused))} name no module "
                        "(globs over model-wide module names; this model's linear layers "
                        f"include {_some(examples.get('linear'))})")


def _some(names) -> str:
    def order(name: str) -> tuple:
        head = name.split(".")[0]
        return (int(head) if head.isdigit() else 0, name)
    names = sorted(set(names or ()), key=order)
    return ", ".join(names[:6]) + (", ..." if len(names) > 6 else "") if names else "none"


class Tuning:
    """What a run trains, applied to each stage as it is built: adapters per layer
    (:meth:`layer`, before tensor-parallel sharding), then the frozen patterns over the
    stage (:meth:`stage`). ``used`` collects ("lora" | "freeze", pattern) of the patterns
    that named something on this rank (for :func:`refuse_unused`, over every rank)."""

    def __init__(self, freeze_patterns: Sequence[str], lora: LoRAOptions | None, seed: int,
                 ties: Sequence[Sequence[str]] = ()):
        self.freeze_patterns, self.lora, self.seed = tuple(freeze_patterns), lora, seed
        self.ties = [tuple(t) for t in ties]
        self.used: set[tuple[str, str]] = set()
        self.examples: dict[str, list[str]] = {"parameters": [], "linear": []}  # for refusals

    @property
    def active(self) -> bool:
        return bool(self.freeze_patterns) or self.lora is not None

    def trains(self, name: str) -> bool:
        """Whether the base parameter ``name`` (model-wide) trains."""
        tie = next((t for t in self.ties if name in t), (name,))
        return self.lora is None and not any(matches(self.freeze_patterns, n) for n in tie)

    def layer(self, index: int, layer: nn.Module) -> nn.Module:
        self.examples["linear"] += [f"{index}.{n}" for n, m in layer.named_modules()
                                    if n and linear_sizes(m) is not None][:2]
        if self.lora is not None:
            self.used |= {("lora", p) for p in adapt_layer(index, layer, self.lora, self.seed)}
        return layer

    def stage(self, module: nn.Module) -> nn.Module:
        self.examples["parameters"] += [n for n, _ in module.named_parameters()][:3]
        self.used |= {("freeze", p) for p in freeze(module, self.freeze_patterns, self.ties)}
        return module


@torch.no_grad()
def merged(state: dict[str, torch.Tensor], scaling: float,
           transposed=lambda name: False) -> dict[str, torch.Tensor]:
    """A state dict with adapters -> the base model's: each adapted weight ``W + s B A`` (``W
    + s (B A)^T`` where ``transposed(name)``: a Conv1D weight), the adapters dropped."""
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for key in [k for k in state if k.endswith(".lora_A.weight")]:
        base = key[:-len(".lora_A.weight")]
        a, b = state[key], state[f"{base}.lora_B.weight"]
        delta = (b.double() @ a.double()) * scaling
        weight = out[f"{base}.weight"]
        delta = delta.T if transposed(f"{base}.weight") else delta
        out[f"{base}.weight"] = (weight.double() + delta).to(weight.dtype)
    return out
