"""Mixed precision for the trainer: bf16 weights with float32 master copies, and the loss
scaler float16 autocast needs.

``--dtype bf16-master``: the stage modules hold bfloat16 parameters (half the weight and
gradient memory, bf16 matmuls, bf16 gradient allreduce); the optimizer updates a float32
master copy of each one and holds its state in float32, and the bf16 parameters are rounded
from the masters after every step. Without masters, AdamW's small updates vanish when added
to bf16 weights (8 bits of mantissa), which is why large-scale trainers keep them.

``--dtype fp16``: float32 weights under float16 autocast. float16's range is narrow, so small
gradients underflow: the losses are multiplied by a scale before the backward and the
gradients divided by it after, and a step whose gradients overflowed is skipped and the scale
halved (doubled again after ``growth_interval`` good steps), as ``torch.amp.GradScaler``
does. Not GradScaler itself: its inf check is per process, while here the gradient norm is
all-reduced first, so every rank of the pipeline skips the same steps.
"""

from __future__ import annotations

import torch


class MasterWeights:
    """float32 masters of low-precision parameters: the tensors the optimizer updates."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = list(params)
        # leaves of their own (not views): the optimizer's state is keyed by them
        self.masters = [p.detach().float().clone() for p in self.params]
        self._by_id = {id(p): m for p, m in zip(self.params, self.masters)}

    def grads_to_masters(self) -> None:
        """Each master's .grad: its parameter's gradient in float32 (None where it has none)."""
        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                m.grad = None
            elif m.grad is None:
                m.grad = p.grad.float()
            else:
                m.grad.copy_(p.grad)

    @torch.no_grad()
    def masters_to_params(self) -> None:
        """Round every master into its parameter (after a step, and after a load)."""
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    def master_of(self) -> dict[int, torch.Tensor]:
        """id(parameter) -> its master."""
        return self._by_id


class LossScaler:
    """The dynamic loss scale of float16 training (torch.amp.GradScaler's defaults)."""

    def __init__(self, scale: float = 2.0 ** 16, growth: float = 2.0, backoff: float = 0.5,
                 growth_interval: int = 2000):
        self.scale, self.growth, self.backoff = scale, growth, backoff
        self.growth_interval, self.good_steps = growth_interval, 0

    @torch.no_grad()
    def unscale_(self, grads: list[torch.Tensor]) -> None:
        for g in grads:
            g.div_(self.scale)

    def update(self, overflow: bool) -> None:
        """After a step: halve the scale on overflow, double it after enough good steps."""
        if overflow:
            self.scale *= self.backoff
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth
            self.good_steps = 0
