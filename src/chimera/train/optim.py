"""The optimizer of a training run: AdamW with its parameter groups, and the learning rate
of each step (warm-up, then the schedule's shape)."""

from __future__ import annotations

import math

import torch

from chimera.train.config import TrainConfig


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up, then ``lr_schedule`` down to ``min_lr_ratio * lr``: cosine, linear,
    wsd (warm-up, stable at the peak, then a linear decay over the last ``wsd_decay`` of the
    steps: Hu et al. 2024, MiniCPM) or constant (the peak to the end)."""
    warm = cfg.warmup_steps
    if step < warm:
        return cfg.optim.lr * (step + 1) / warm
    return cfg.optim.lr * _decay_factor(cfg, step, warm)


def _decay_factor(cfg: TrainConfig, step: int, warm: int) -> float:
    """The fraction of the peak after warm-up (1 at the peak, min_lr_ratio at the floor)."""
    o = cfg.optim
    floor = o.min_lr_ratio
    if o.lr_schedule == "constant":
        return 1.0
    if o.lr_schedule == "wsd":
        start = max(warm, o.steps - round(o.wsd_decay * o.steps))  # where the decay begins
        if step < start:
            return 1.0
        warm = start
    progress = (step - warm) / max(1, o.steps - warm)
    if o.lr_schedule == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return floor + (1 - floor) * (1 - progress)  # linear, and wsd's decay


def make_optimizer(params, cfg: TrainConfig, matrix: list[bool] | None = None) -> torch.optim.Optimizer:
    """AdamW; matrices decay, biases and norms do not (as nanoGPT). ``matrix`` says which
    are matrices where the tensors are flat pieces of parameters (a sharded optimizer)."""
    params = list(params)
    matrix = [p.dim() >= 2 for p in params] if matrix is None else matrix
    decay = [p for p, m in zip(params, matrix) if m]
    rest = [p for p, m in zip(params, matrix) if not m]
    o = cfg.optim
    groups = [{"params": decay, "weight_decay": o.weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    # fused: one kernel per tensor, ~5x faster than the per-parameter loop on a CPU core, and
    # elementwise like it, so every replica and the reference still update bit-identically
    # a rank whose stages are all frozen updates nothing: one empty group (AdamW refuses none)
    return torch.optim.AdamW([g for g in groups if g["params"]] or groups[1:], lr=o.lr,
                             betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, fused=True)
