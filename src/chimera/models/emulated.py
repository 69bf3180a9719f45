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
  so p2p carries real tensors and gradients are checked against one process;
- it may carry ``extra`` more parameters (floats) that stand for a layer's larger gradient
  (an LM head's, an embedding's): they take no part in the value, their gradient is zero,
  and gradient collectives move their bytes.

Where a layer's input carries no gradient (the first layer of the first stage), there is no
input-gradient path to split off: every backward op is needed for the weights, so the weight
path waits ``I + W`` (the runtime's W, or B, pays the whole backward there).

Waiting is ``time.sleep`` (the thread sleeps; the CPU is free), as a host blocked on a device
synchronize. Each wait ends a set time after the host *entered* the layer (its forward, or
its backward's first node), not after the layer's own host code: that code (autograd's
bookkeeping, an allocation; ~0.3 ms a layer on this machine after a sleep) runs inside the
wait, as kernel launches overlap a device's work, so a layer costs what the simulator prices
it at; the runtime's code between layers is not hidden. Nothing here measures kernels or
memory bandwidth, only the schedule and the runtime around it.
"""

from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from chimera.errors import UserError
from chimera.sim.cost import parse_times

__all__ = ["EmulatedCost", "EmulatedLayer", "WaitLog", "emulated_batch", "emulated_layers",
           "emulated_pieces", "emulated_stages", "tighten_timer_slack"]


@dataclass(frozen=True)
class EmulatedCost:
    """Seconds per full micro-batch of ``rows`` rows on one D-th of the model."""

    forward_s: float
    input_grad_s: float
    weight_grad_s: float
    rows: int = 1
    width: int = 16
    activation_bytes: int = 1 << 20
    # busy-wait instead of sleeping: the host stays warm, as a spinning device synchronize
    # keeps it (a core per rank; a host woken from a sleep runs its next code cold)
    spin: bool = False

    def __post_init__(self) -> None:
        for name in ("forward_s", "input_grad_s", "weight_grad_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise UserError(f"emulated {name} must be a finite number >= 0, got {v!r}")
        for name in ("rows", "width"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise UserError(f"emulated {name} must be a positive integer, got {v!r}")
        if not isinstance(self.spin, bool):
            raise UserError(f"emulated spin must be True or False, got {self.spin!r}")
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


def _sleep_until(due: float, spin: bool = False) -> bool:
    """Sleep (or spin) until ``due``; whether there was anything left to wait."""
    now = time.perf_counter()
    if due <= now:
        return False
    if not spin:
        time.sleep(due - now)
        return True
    while time.perf_counter() < due:
        pass
    return True


class _Device:
    """One layer's emulated device: when the work queued on it so far ends. Work is queued
    (``launch``) when the host enters the layer's forward or backward and waited for where
    the layer ends, so the host code the layer runs in between (autograd, allocation) is
    inside the wait, as kernel launches overlap a device's work; the runtime's own code
    between layers is not."""

    def __init__(self, log: WaitLog | None, spin: bool = False):
        self.log, self.spin = log, spin
        self.due = 0.0  # when this layer's queued work ends (host perf_counter seconds)
        self.input_begin = 0.0  # when the current backward's input-gradient part starts
        self.input_due = 0.0  # and ends

    def slot(self, seconds: float, at: float | None = None) -> tuple[float, float]:
        """(start, end) that ``seconds`` of work queued at host time ``at`` (now) would have;
        nothing is queued until ``due`` is set to its end."""
        begin = max(self.due, time.perf_counter() if at is None else at)
        return begin, begin + seconds

    def launch(self, seconds: float, at: float | None = None) -> tuple[float, float]:
        """Queue ``seconds`` of work at host time ``at`` (now): (its start, its end)."""
        begin, self.due = self.slot(seconds, at)
        return begin, self.due

    def wait(self, begin: float, due: float, asked: float, label: str) -> None:
        """Sleep until ``due`` (a device synchronize); log the work as ``begin`` .. now."""
        if asked <= 0:
            return
        slept = _sleep_until(due, self.spin)
        if self.log is None:
            return
        # done when the sleep ended, or at ``due`` where the host came later (a full backward's
        # I, covered by its W's wait): the device's time, not the host's
        end = time.perf_counter() if slept else due
        total = self.log.totals.setdefault(label[0], [0.0, 0.0])
        total[0] += end - begin
        total[1] += asked
        if self.log.on:
            self.log.events.append((label, begin, end, asked))


class _Span(torch.autograd.Function):
    """The layer's last node: its backward (the first node of the layer's backward) queues
    the input-gradient work I, which the input path waits for. Identity in value."""

    @staticmethod
    def forward(ctx, y, device, input_s):
        ctx.device, ctx.input_s = device, input_s
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        device = ctx.device
        device.input_begin, device.input_due = device.launch(ctx.input_s)
        return grad, None, None


class _InputPath(torch.autograd.Function):
    """Identity; its backward (towards the layer input) waits for the queued I."""

    @staticmethod
    def forward(ctx, x, device, input_s, label):
        ctx.device, ctx.input_s, ctx.label = device, input_s, label
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        d = ctx.device
        d.wait(d.input_begin, d.input_due, ctx.input_s, f"I {ctx.label}")
        return grad, None, None, None


class _WeightPath(torch.autograd.Function):
    """The bias broadcast over the rows (a fused layer's biases summed first); keeps the
    activation buffer; backward queues W (after whatever this layer queued before, I
    included) and waits for it. ``extra`` (or None): the layer's extra parameters, which get
    a zero gradient on the same path."""

    @staticmethod
    def forward(ctx, bias, extra, rows, device, weight_s, saved_bytes, label):
        ctx.device, ctx.weight_s, ctx.label, ctx.shape = device, weight_s, label, bias.shape
        ctx.extra = None if extra is None else extra.shape
        # the activation a real layer would keep for its backward: freed with this node
        ctx.save_for_backward(torch.empty(saved_bytes, dtype=torch.uint8, device=bias.device))
        b = bias if bias.dim() == 1 else bias.sum(0)  # (fuse, width) -> (width,)
        return b.unsqueeze(0).expand(rows, -1).clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors  # noqa: B018 -- held until now, as a real activation is
        d = ctx.device
        begin, due = d.launch(ctx.weight_s)
        bias_grad = grad.sum(0)  # host code, inside the wait
        if len(ctx.shape) > 1:  # a fused layer: each of its biases gets the same gradient
            bias_grad = bias_grad.expand(ctx.shape)
        extra_grad = None if ctx.extra is None else grad.new_zeros(ctx.extra)
        d.wait(begin, due, ctx.weight_s, f"W {ctx.label}")
        return bias_grad, extra_grad, None, None, None, None, None


def _initial_bias(width: int, seed: int, index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * seed + index)
    return torch.randn(width, generator=g) * 0.01


class EmulatedLayer(nn.Module):
    """One layer of an emulated model; ``share`` is its part of a D-th of the model.

    ``fuse`` > 1: the layer stands for layers ``index .. index + fuse - 1`` fused (the bench's
    floor rows, one layer per stage): their initial biases as the rows of one ``(fuse,
    width)`` parameter, summed on the weight path, so it computes what they compute, and
    ``share`` is theirs together, so each wait is all of theirs at once. ``extra``: floats of
    gradient the layer carries beyond its bias (see the module's docstring)."""

    def __init__(self, cost: EmulatedCost, share: float, seed: int = 0, index: int = 0,
                 log: WaitLog | None = None, fuse: int = 1, extra: int = 0):
        super().__init__()
        self.cost, self.share, self.index, self.log, self.fuse = cost, share, index, log, fuse
        self.device = _Device(log, cost.spin)
        biases = [_initial_bias(cost.width, seed, i) for i in range(index, index + fuse)]
        self.bias = nn.Parameter(biases[0] if fuse == 1 else torch.stack(biases))
        if not isinstance(extra, int) or extra < 0:
            raise UserError(f"emulated extra parameters must be an integer >= 0, got {extra!r}")
        self.extra = nn.Parameter(torch.zeros(extra)) if extra else None
        self.label = f"L{index}" if fuse == 1 else f"L{index}-{index + fuse - 1}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (rows, width) -> (rows, width)
        begin = time.perf_counter()  # the layer's work is queued as the host enters it
        c = self.cost
        scale = self.share * x.shape[0] / c.rows
        f, i, w = (t * scale for t in (c.forward_s, c.input_grad_s, c.weight_grad_s))
        # queued when the host entered the layer, committed to the device once the layer got
        # to its end: a recomputation that stops early (checkpointing) queues nothing
        start, due = self.device.slot(f, at=begin)
        label = self.label
        # no gradient to the input: no input path to split off, the weight path pays it all
        has_input_grad = x.requires_grad
        h = _InputPath.apply(x, self.device, i, label)
        saved = int(c.activation_bytes * scale)
        y = h + _WeightPath.apply(self.bias, self.extra, x.shape[0], self.device,
                                  w if has_input_grad else i + w, saved, label)
        out = _Span.apply(y, self.device, i if has_input_grad else 0.0)
        # the forward's work was queued as the host entered the layer: wait for it once the
        # layer's host code (its ops and autograd nodes) has run, as a device overlaps it
        self.device.due = due
        self.device.wait(start, due, f, f"F {label}")
        return out

    def extra_repr(self) -> str:
        fused = f", fuse={self.fuse}" if self.fuse > 1 else ""
        extra = f", extra={self.extra.numel()}" if self.extra is not None else ""
        return f"{self.cost.text} ms x {self.share:g}, width={self.cost.width}{fused}{extra}"


def emulated_layers(cost: EmulatedCost, stages: int, layers: int, seed: int = 0,
                    log: WaitLog | None = None, weights: Sequence[float] | None = None,
                    extra: Sequence[int] | None = None) -> Callable[[int], EmulatedLayer]:
    """``make_layer(i)`` for a model of ``layers`` layers whose D = ``stages`` equal cuts each
    cost ``cost`` (``layers`` must be a multiple of ``stages``); or, with ``weights``, layer
    i costs ``weights[i]`` D-ths (a heavier head or embedding: ``chimera.bench.prices``);
    ``extra[i]``: layer i's extra gradient floats (default none)."""
    _check_cut(layers, stages)
    shares = _shares(stages, layers, weights)
    extra = _extra(layers, extra)
    return lambda i: EmulatedLayer(cost, shares[i], seed, i, log, extra=extra[i])


def emulated_stages(cost: EmulatedCost, stages: int, layers: int, pieces: int, seed: int = 0,
                    log: WaitLog | None = None) -> Callable[[int], EmulatedLayer]:
    """``make_stage(s)`` for the model of :func:`emulated_layers` cut into ``pieces`` equal
    pieces: piece ``s`` as one layer that fuses its layers (same biases, same sum), so each
    action of it is one wait of the piece's whole cost, as the simulator prices it."""
    _check_cut(layers, stages)
    _check_cut(layers, pieces)
    fuse = layers // pieces
    ranges = [range(k * fuse, (k + 1) * fuse) for k in range(pieces)]
    return emulated_pieces(cost, ranges, _shares(stages, layers, None), seed, log)


def emulated_pieces(cost: EmulatedCost, ranges: Sequence[range], weights: Sequence[float],
                    seed: int = 0, log: WaitLog | None = None,
                    extra: Sequence[int] | None = None) -> Callable[[int], EmulatedLayer]:
    """``make_stage(s)``: the layers ``ranges[s]`` (layer i costing ``weights[i]`` D-ths and
    carrying ``extra[i]`` extra gradient floats) fused into one layer, as
    :func:`emulated_stages` does for an equal cut."""
    extra = _extra(len(weights), extra)
    return lambda s: EmulatedLayer(cost, sum(weights[i] for i in ranges[s]), seed,
                                   ranges[s].start, log, len(ranges[s]),
                                   sum(extra[i] for i in ranges[s]))


def _extra(layers: int, extra: Sequence[int] | None) -> list[int]:
    if extra is None:
        return [0] * layers
    if len(extra) != layers:
        raise UserError(f"emulated extra parameters must be {layers} integers, got {extra!r}")
    return list(extra)


def _shares(stages: int, layers: int, weights: Sequence[float] | None) -> list[float]:
    if weights is None:
        return [stages / layers] * layers
    if len(weights) != layers or any(not (isinstance(x, (int, float)) and x > 0) for x in weights):
        raise UserError(f"emulated layer weights must be {layers} positive numbers, got {weights!r}")
    return list(weights)


def _check_cut(layers: int, stages: int) -> None:
    if layers % stages:
        raise UserError(f"{layers} emulated layers cannot be cut into {stages} equal stages")


def emulated_batch(cost: EmulatedCost, rows: int, step: int, seed: int = 0):
    """(inputs, targets) of ``rows`` rows for ``step``: the same on every rank."""
    g = torch.Generator().manual_seed(seed * 7919 + step)
    return torch.randn(rows, cost.width, generator=g), torch.randn(rows, cost.width, generator=g)
