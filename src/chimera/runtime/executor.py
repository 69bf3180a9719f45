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
from torch.utils.checkpoint import checkpoint

from chimera.comm_plan import Launch, Post
from chimera.ir import Action, Op, Schedule
from chimera.runtime.split_backward import backward_input, backward_weight


@dataclass
class MicroData:
    """What one iteration feeds this rank: stage-0 inputs, last-stage targets, loss weights."""

    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    targets: dict[int, torch.Tensor] = field(default_factory=dict)
    weights: dict[int, float] = field(default_factory=dict)


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
    def __init__(self, schedule: Schedule, modules: dict[tuple[int, int], nn.Module], loss_fn,
                 mailbox, sync, recompute: bool = False, autocast: torch.dtype | None = None,
                 device: torch.device = torch.device("cpu"), early: frozenset = frozenset()):
        self.schedule, self.modules, self.loss_fn = schedule, modules, loss_fn
        self.arm = early  # last backwards inside which buckets may reduce (CommPlan.early)
        self.mailbox, self.sync = mailbox, sync
        self.recompute, self.autocast, self.device = recompute, autocast, device
        self.last = schedule.stages - 1
        self.record_epoch: float | None = None  # wall-clock time of the recorded run's t0
        self._calls_of: tuple = (None, [])  # (program, its handler per step)
        self.params = {k: [p for p in m.parameters() if p.requires_grad] for k, m in modules.items()}
        self.handlers = {
            Op.F: self._forward, Op.B: self._backward, Op.I: self._backward_input,
            Op.W: self._backward_weight, Op.SEND_F: self._send_f, Op.SEND_B: self._send_b,
            Op.RECV_F: self._recv, Op.RECV_B: self._recv, Op.SYNC: self._sync, Op.STEP: self._step,
        }

    def run(self, program, data: MicroData, record: list[ActionRecord] | None = None) -> float:
        """Run ``program`` (a CommPlan's steps for this rank: actions, receive posts and
        allreduce launches); return the sum of the (weighted) losses computed on this rank."""
        self.data, self.loss_sum = data, 0.0
        self.inp: dict[tuple, torch.Tensor] = {}
        self.out: dict[tuple, torch.Tensor] = {}
        self.recv: dict[tuple, torch.Tensor] = {}
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

    def _stage_input(self, a: Action) -> torch.Tensor:
        p, s, m = a.key
        if s == 0:
            return self.data.inputs[m]
        if (Op.RECV_F, p, s, m) in self.recv:
            x = self.recv.pop((Op.RECV_F, p, s, m))
        else:  # previous stage on this rank (V placement): hand the output over directly
            x = self.out[(p, s - 1, m)]
        return x.detach().requires_grad_()

    def _forward(self, a: Action) -> None:
        x = self._stage_input(a)
        module = self.modules[(a.pipe, a.stage)]
        with self._autocast():
            if self.recompute and a.stage != self.last:
                y = checkpoint(module, x, use_reentrant=False)
            else:
                y = module(x)
            if a.stage == self.last:
                y = self.loss_fn(y, self.data.targets[a.micro]) * self.data.weights[a.micro]
                self.loss_sum += float(y.detach())
        if a.stage > 0:
            self.inp[a.key] = x
        self.out[a.key] = y

    def _output_grad(self, a: Action) -> torch.Tensor | None:
        p, s, m = a.key
        if s == self.last:
            return None
        if (Op.RECV_B, p, s, m) in self.recv:
            g = self.recv.pop((Op.RECV_B, p, s, m))
        else:  # next stage on this rank
            g = self.inp.pop((p, s + 1, m)).grad
        return g

    def _backward(self, a: Action) -> None:
        y, g = self.out.pop(a.key), self._output_grad(a)
        if a in self.arm:  # the replica's gradients become final in this backward
            self.sync.arm(a.pipe, a.stage)
        torch.autograd.backward(y, None if g is None else g.to(y.dtype))

    def _backward_input(self, a: Action) -> None:
        """I: the input gradient only (what the previous stage waits for)."""
        y, g = self.out.pop(a.key), self._output_grad(a)
        x = self.inp.get(a.key)
        dx, pending = backward_input(y, x, None if g is None else g.to(y.dtype), self.params[(a.pipe, a.stage)])
        if x is not None:
            x.grad = dx
        self.out[a.key] = pending  # W finishes it

    def _backward_weight(self, a: Action) -> None:
        """W: the weight gradients, from what I kept; frees the graph."""
        backward_weight(self.out.pop(a.key))

    # -- communication ------------------------------------------------------------
    def _send_f(self, a: Action) -> None:
        self.mailbox.send(a, self.out[a.key])

    def _send_b(self, a: Action) -> None:
        self.mailbox.send(a, self.inp.pop(a.key).grad)

    def _recv(self, a: Action) -> None:
        self.recv[(a.op, a.pipe, a.stage, a.micro)] = self.mailbox.receive(a)

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
