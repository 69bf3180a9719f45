"""Executes one rank's lowered program for one iteration: one small handler per action kind.

Tensors are keyed by (pipe, stage, micro). A forward keeps its input (a leaf that requires
grad, so backward leaves the input gradient in ``.grad``) and its output (or, on the last
stage, the weighted loss); the backward pops both. Recomputation wraps a stage in
non-reentrant activation checkpointing, which keeps only the stage input (and RNG state).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from chimera.check.comm_plan import Launch, Post
from chimera.ir import Action, Op, Schedule, input_stage, peer_stage, recv_of
from chimera.runtime.boundary import call_loss, detach_input
from chimera.runtime.context import ExecOptions
from chimera.runtime.split_backward import (PendingWeightGrad, backward_input, backward_of,
                                            backward_weight)


@dataclass
class MicroData:
    """What one iteration feeds this rank: stage-0 inputs, last-stage targets, loss weights
    (pytrees of tensors, per micro-batch); ``outputs``, when a dict, collects the last stage's
    outputs of a forward-only run."""

    inputs: dict[int, object] = field(default_factory=dict)
    targets: dict[int, object] = field(default_factory=dict)
    weights: dict[int, float] = field(default_factory=dict)
    outputs: dict[int, object] | None = None


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; to CUDA through pinned memory without blocking the host (the
    copy is ordered before the kernels that read it on the same stream)."""
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class ActionRecord:
    action: Action
    start: float  # wall seconds since the iteration started
    end: float
    cpu: float  # thread CPU seconds spent in the action


class _Clock:
    """Action times in seconds since the iteration started: the host clock on CPU; on CUDA,
    events on the compute stream (the host only says when a kernel was queued, not when it
    ran), resolved after one synchronize at the end of the recorded iteration."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.t0 = self.mark()

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark) -> float:
        if not self.cuda:
            return mark - self.t0
        mark.synchronize()
        return self.t0.elapsed_time(mark) / 1000.0


class Executor:
    """Runs one rank's program: ``modules`` by (pipe, stage), ``sync`` its stage collectives,
    ``options`` how stages run (recompute, autocast); the mailbox is set per boundary layout
    (``PipelineRuntime.prepare``)."""

    def __init__(self, schedule: Schedule, modules: dict[tuple[int, int], nn.Module], loss_fn,
                 sync, options: ExecOptions, device: torch.device, *,
                 early: frozenset = frozenset(), forward_only: bool = False):
        self.schedule, self.modules, self.loss_fn = schedule, modules, loss_fn
        mailbox, recompute, autocast = None, options.recompute, options.autocast
        self.arm = early  # last backwards inside which buckets may reduce (CommPlan.early)
        self.forward_only = forward_only  # evaluation: no graph kept, nothing sent back
        self.boundaries: list = []  # per stage, the BoundarySpec of its output (set by the runtime)
        self.mailbox, self.sync = mailbox, sync
        self.recompute, self.autocast, self.device = recompute, autocast, device
        self.last = schedule.stages - 1
        self.before_forward = None  # called with (pipe, stage) before each forward, if set
        self.record_epoch: float | None = None  # wall-clock time of the recorded run's t0
        self._calls_of: tuple = (None, [])  # (program, its handler per step)
        self._links: dict[Action, tuple] = {}  # per F/B/I: (input_stage, its RECV), worked out once
        self._views: dict[Action, tuple] = {}  # per RECV: (its buffer, spec, leaf views), _received
        self.params = {k: [p for p in m.parameters() if p.requires_grad] for k, m in modules.items()}
        self.handlers = {
            Op.F: self._forward, Op.B: self._backward, Op.I: self._backward_input,
            Op.W: self._backward_weight, Op.SEND_F: self._send_f, Op.SEND_B: self._send_b,
            Op.RECV_F: self._recv, Op.RECV_B: self._recv, Op.SYNC: self._sync, Op.STEP: self._step,
        }

    def run(self, program, data: MicroData, record: list[ActionRecord] | None = None) -> torch.Tensor:
        """Run ``program`` (a CommPlan's steps for this rank: actions, receive posts and
        allreduce launches); return the sum of the (weighted) losses computed on this rank (a
        float64 device scalar: read it once per step, not once per micro-batch)."""
        self.data = data
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.inp: dict[tuple, torch.Tensor] = {}
        self.out: dict[tuple, torch.Tensor] = {}
        self.recv: dict[Action, torch.Tensor] = {}  # by RECV action
        self.mailbox.begin_iteration()
        if record is None:
            for call, step in self._calls(program):
                call(step)
            return self.loss_sum
        self.record_epoch = time.time()  # t0 on the wall clock: aligns the ranks' records
        clock = _Clock(self.device)
        marks = []
        for call, step in self._calls(program):
            if not isinstance(step, Action):
                call(step)
                continue
            c, start = time.thread_time(), clock.mark()
            call(step)
            marks.append((step, start, clock.mark(), time.thread_time() - c))
        record.extend(ActionRecord(a, clock.seconds(s), clock.seconds(e), cpu)
                      for a, s, e, cpu in marks)
        return self.loss_sum

    def _calls(self, program) -> list:
        """(handler, step) per step of ``program``, worked out once per program."""
        if self._calls_of[0] is not program:
            calls = []
            for step in program:
                if isinstance(step, Post):
                    calls.append((self._post, step))
                elif isinstance(step, Launch):
                    calls.append((self._launch, step))
                else:
                    calls.append((self.handlers[step.op], step))
            self._calls_of = (program, calls)
        return self._calls_of[1]

    # -- compute ------------------------------------------------------------------
    def _autocast(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def _link(self, a: Action) -> tuple:
        """(the stage whose output ``a`` consumes or None, the RECV that would bring it)."""
        link = self._links.get(a)
        if link is None:
            link = self._links[a] = (input_stage(a, self.schedule.stages), recv_of(a))
        return link

    def _received(self, recv: Action, spec, backward: bool) -> tuple:
        """The tensor leaves of ``recv``'s message. The mailbox refills one buffer per message
        every iteration, so the views of a buffer are made once and stay valid (each view op
        costs ~20 us on a host just woken from a wait); where a leaf travels narrower and is
        cast back (a copy of one message's values), or where the stage is given the views
        themselves (forward only: no detach in between, so what a stage did to its input
        object, an in-place reshape, would reach the next run), they are made every time."""
        buf = self.recv.pop(recv)
        hit = self._views.get(recv)
        if hit is not None and hit[0] is buf and hit[1] is spec:
            return hit[2]
        views = spec.views(buf, backward)
        if not spec.copies_on_unpack and not self.forward_only:
            self._views[recv] = (buf, spec, views)
        return views

    def _stage_input(self, a: Action) -> tuple[object, list[torch.Tensor]]:
        """(input pytree, its leaves that get a gradient) of the forward ``a``."""
        src, recv = self._link(a)
        if src is None:
            return self.data.inputs[a.micro], []
        spec = self.boundaries[src]
        if recv in self.recv:
            x = spec.from_views(self._received(recv, spec, False))
        else:  # previous stage on this rank (V placement): hand the output over directly
            x = self.out[(a.pipe, src, a.micro)]
        if self.forward_only:
            return x, []
        return detach_input(x, spec)

    def _forward(self, a: Action) -> None:
        if self.before_forward is not None:
            self.before_forward((a.pipe, a.stage))
        x, grad_leaves = self._stage_input(a)
        module = self.modules[(a.pipe, a.stage)]
        with self._autocast():
            if self.recompute and a.stage != self.last and not self.forward_only:
                # a stage with random streams of its own (TP dropout) replays them too
                y = checkpoint(module, x, use_reentrant=False,
                               context_fn=getattr(module, "recompute_context", noop_context_fn))
            else:
                y = module(x)
            if a.stage == self.last:
                y = self._loss(y, a.micro)
        if self._link(a)[0] is not None and not self.forward_only:
            self.inp[a.key] = grad_leaves  # SEND_B or the previous stage (same rank) reads their .grad
        self.out[a.key] = y

    def _loss(self, y, micro: int):
        """The weighted loss of micro-batch ``micro`` (summed on the device, read once per run);
        in a forward-only run also the outputs, and no loss without targets."""
        if self.data.outputs is not None:
            self.data.outputs[micro] = y
        if micro not in self.data.targets:
            return None
        loss = call_loss(self.loss_fn, y, self.data.targets[micro]) * self.data.weights[micro]
        self.loss_sum += loss.detach()
        return loss

    def _output_grad(self, a: Action) -> tuple[list[torch.Tensor], list]:
        """(outputs, their gradients) that backward starts from; only outputs that require grad."""
        y = self.out.pop(a.key)
        src, recv = self._link(a)
        if src is None:  # the last stage: backward starts from the loss
            return ([y], [None]) if y is not None and y.requires_grad else ([], [])
        spec = self.boundaries[a.stage]
        if recv in self.recv:
            grads = list(self._received(recv, spec, True))
        else:  # next stage on this rank
            grads = [x.grad for x in self.inp.pop((a.pipe, src, a.micro))]
        pairs = [(t, g) for t, g in zip(spec.grad_leaves(y), grads)
                 if t.requires_grad and g is not None]
        return ([t for t, _ in pairs],
                [g if g.dtype == t.dtype else g.to(t.dtype) for t, g in pairs])

    def _backward(self, a: Action) -> None:
        ys, gs = self._output_grad(a)
        if a in self.arm:  # the replica's gradients become final in this backward
            self.sync.arm(a.pipe, a.stage)
        if ys:  # a frozen stage (nothing requires grad) has nothing to do
            backward_of(ys, gs)

    def _backward_input(self, a: Action) -> None:
        """I: the input gradient only (what the previous stage waits for)."""
        ys, gs = self._output_grad(a)
        xs = self.inp.get(a.key, [])
        if not ys:
            self.out[a.key] = PendingWeightGrad()
            return
        if len(ys) == 1:
            y, g = ys[0], gs[0]
        else:  # one root: d(sum_i <y_i, g_i>)/dθ is exactly sum_i g_i·dy_i/dθ
            y, g = sum((t * u).sum() for t, u in zip(ys, gs)), None
        dxs, pending = backward_input(y, xs or None, g, self.params[(a.pipe, a.stage)])
        for x, dx in zip(xs, dxs or []):
            x.grad = dx
        self.out[a.key] = pending  # W finishes it

    def _backward_weight(self, a: Action) -> None:
        """W: the weight gradients, from what I kept; frees the graph."""
        backward_weight(self.out.pop(a.key))

    # -- communication ------------------------------------------------------------
    def _send_f(self, a: Action) -> None:
        y = self.out.pop(a.key) if self.forward_only else self.out[a.key]
        self.mailbox.send(a, self.boundaries[a.stage].pack(y, a.stage, self.device))

    def _send_b(self, a: Action) -> None:
        xs = self.inp.pop(a.key)
        receiver = peer_stage(a, self.schedule.stages)  # its output's boundary is our input's
        self.mailbox.send(a, self.boundaries[receiver].pack_grads([x.grad for x in xs], self.device))

    def _recv(self, a: Action) -> None:
        self.recv[a] = self.mailbox.receive(a)

    def _post(self, post: Post) -> None:
        self.mailbox.post(post.message)

    def _launch(self, launch: Launch) -> None:
        self.sync.start(launch.pipe, launch.stage)

    def _sync(self, a: Action) -> None:
        """The replica's gradients are final; the plan's Launch (here or later) reduces them."""

    def _step(self, a: Action) -> None:
        """End of the iteration's communication; the optimizer step is the trainer's."""
        self.mailbox.finish_iteration()
        self.sync.wait_all()
