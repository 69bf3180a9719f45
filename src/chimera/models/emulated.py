"""Accelerator-like layers: compute that runs "elsewhere", so the host only waits for it.

A GPU runs a stage's kernels while the host thread waits for them; two CPU cores cannot
compute eight pipeline ranks, but they can host eight ranks that each *wait* as long as their
kernels would run. An :class:`EmulatedLayer` does exactly that, at the autograd level so that
any runtime sees the same costs (ours, ``torch.distributed.pipelining``'s):

- its forward waits ``F``;
- its input-gradient path waits ``I`` (the part of a backward that the previous stage waits
  for), its weight-gradient path waits ``W``: a backward that computes both waits ``I + W``,
  a split backward waits each where it runs (autograd runs only the nodes a call needs);
- every wait is scaled by the rows it is given (a halved micro-batch waits half) and by the
  layer's share of a stage (a model of ``layers`` layers cut into D stages: each layer waits
  ``D / layers`` of the per-stage time, so a cut into 2D stages halves every stage's times, as
  :meth:`chimera.sim.CostModel.compute` assumes);
- it keeps a saved activation of ``activation_bytes`` per full micro-batch and stage until its
  backward frees it, so peak activation memory per rank can be measured per schedule;
- it computes something real and small, ``y = x + bias`` on ``(rows, width)`` float tensors,
  so p2p carries real tensors and gradients are checked against one process.

Where a layer's input carries no gradient (the first layer of the first stage), there is no
input-gradient path to split off: every backward op is needed for the weights, so the weight
path waits ``I + W`` (the runtime's W, or B, pays the whole backward there).

Waiting is ``time.sleep`` (the thread sleeps; the CPU is free), as a host blocked on a device
synchronize; nothing here measures kernels or memory bandwidth, only the schedule and the
runtime around it.
"""

from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from chimera.errors import UserError
from chimera.sim.cost import parse_times

__all__ = ["EmulatedCost", "EmulatedLayer", "WaitLog", "emulated_batch", "emulated_layers",
           "tighten_timer_slack"]


@dataclass(frozen=True)
class EmulatedCost:
    """Seconds per full micro-batch of ``rows`` rows on one D-th of the model."""

    forward_s: float
    input_grad_s: float
    weight_grad_s: float
    rows: int = 1
    width: int = 16
    activation_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("forward_s", "input_grad_s", "weight_grad_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise UserError(f"emulated {name} must be a finite number >= 0, got {v!r}")
        for name in ("rows", "width"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UserError(f"emulated {name} must be a positive integer, got {v!r}")
        if not isinstance(self.activation_bytes, int) or self.activation_bytes < 0:
            raise UserError(f"emulated activation_bytes must be an integer >= 0, "
                            f"got {self.activation_bytes!r}")

    @classmethod
    def parse(cls, text: str, **kw) -> "EmulatedCost":
        """``"F:I:W"`` or ``"F:B"`` in milliseconds (B is split evenly into I and W)."""
        f, i, w = parse_times(text, "--emulate (milliseconds)")
        return cls(f / 1e3, i / 1e3, w / 1e3, **kw)

    @property
    def text(self) -> str:
        return ":".join(f"{x * 1e3:g}" for x in (self.forward_s, self.input_grad_s,
                                                   self.weight_grad_s))


class WaitLog:
    """Where the waits of a set of layers went: ``(label, start, end, asked)`` in host
    seconds (``time.perf_counter``; ``asked``: the wait's nominal length, which the sleep
    overshoots by the kernel's wake-up latency), while ``on``, for traces of what a runtime
    actually ran; and always, per kind (F, I, W), the seconds taken and asked in all."""

    def __init__(self):
        self.on = False
        self.events: list[tuple[str, float, float, float]] = []
        self.totals: dict[str, list[float]] = {}  # F/I/W -> [seconds taken, seconds asked], always


def tighten_timer_slack() -> bool:
    """Let this thread's sleeps (and those of threads it starts) end within a microsecond of
    their deadline instead of the kernel's default 50 us slack (Linux ``prctl``; measured
    here: a 5 ms sleep overshoots by ~25 us instead of ~75 us). Call it first thing in each
    process that hosts emulated layers; False where the system does not allow it."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(29, 1, 0, 0, 0) == 0  # PR_SET_TIMERSLACK
    except (OSError, AttributeError):
        return False


def wait(seconds: float, log: WaitLog | None = None, label: str = "") -> None:
    """Sleep ``seconds`` (a device kernel the host waits for)."""
    if seconds <= 0:
        return
    start = time.perf_counter()
    time.sleep(seconds)
    if log is None:
        return
    end = time.perf_counter()
    total = log.totals.setdefault(label[0], [0.0, 0.0])
    total[0] += end - start
    total[1] += seconds
    if log.on:
        log.events.append((label, start, end, seconds))


class _InputPath(torch.autograd.Function):
    """Forward waits F; backward (towards the layer input) waits I. Identity in value."""

    @staticmethod
    def forward(ctx, x, forward_s, input_s, log, label):
        wait(forward_s, log, f"F {label}")
        ctx.input_s, ctx.log, ctx.label = input_s, log, label
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        wait(ctx.input_s, ctx.log, f"I {ctx.label}")
        return grad, None, None, None, None


class _WeightPath(torch.autograd.Function):
    """The bias broadcast over the rows; keeps the activation buffer; backward waits W."""

    @staticmethod
    def forward(ctx, bias, rows, weight_s, saved_bytes, log, label):
        ctx.weight_s, ctx.log, ctx.label = weight_s, log, label
        # the activation a real layer would keep for its backward: freed with this node
        ctx.save_for_backward(torch.empty(saved_bytes, dtype=torch.uint8, device=bias.device))
        return bias.unsqueeze(0).expand(rows, -1).clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors  # noqa: B018 -- held until now, as a real activation is
        wait(ctx.weight_s, ctx.log, f"W {ctx.label}")
        return grad.sum(0), None, None, None, None, None


class EmulatedLayer(nn.Module):
    """One layer of an emulated model; ``share`` is its part of a D-th of the model."""

    def __init__(self, cost: EmulatedCost, share: float, seed: int = 0, index: int = 0,
                 log: WaitLog | None = None):
        super().__init__()
        self.cost, self.share, self.index, self.log = cost, share, index, log
        g = torch.Generator().manual_seed(1_000_003 * seed + index)
        self.bias = nn.Parameter(torch.randn(cost.width, generator=g) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (rows, width) -> (rows, width)
        c = self.cost
        scale = self.share * x.shape[0] / c.rows
        f, i, w = (t * scale for t in (c.forward_s, c.input_grad_s, c.weight_grad_s))
        label = f"L{self.index}"
        h = _InputPath.apply(x, f, i, self.log, label)
        # no gradient to the input: no input path to split off, the weight path pays it all
        weight_s = w if x.requires_grad else i + w
        saved = int(c.activation_bytes * scale)
        return h + _WeightPath.apply(self.bias, x.shape[0], weight_s, saved, self.log, label)

    def extra_repr(self) -> str:
        return f"{self.cost.text} ms x {self.share:g}, width={self.cost.width}"


def emulated_layers(cost: EmulatedCost, stages: int, layers: int, seed: int = 0,
                    log: WaitLog | None = None) -> Callable[[int], EmulatedLayer]:
    """``make_layer(i)`` for a model of ``layers`` layers whose D = ``stages`` equal cuts each
    cost ``cost`` (``layers`` must be a multiple of ``stages``)."""
    if layers % stages:
        raise UserError(f"{layers} emulated layers cannot be cut into {stages} equal stages")
    share = stages / layers
    return lambda i: EmulatedLayer(cost, share, seed, i, log)


def emulated_batch(cost: EmulatedCost, rows: int, step: int, seed: int = 0):
    """(inputs, targets) of ``rows`` rows for ``step``: the same on every rank."""
    g = torch.Generator().manual_seed(seed * 7919 + step)
    return torch.randn(rows, cost.width, generator=g), torch.randn(rows, cost.width, generator=g)
