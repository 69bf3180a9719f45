"""PipelineRuntime: build what one rank holds for a lowered schedule and run iterations."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from chimera.comm_plan import Message, plan_comm
from chimera.ir import Schedule, ScheduleError
from chimera.runtime.executor import ActionRecord, Executor, MicroData
from chimera.runtime.grid import ProcessGrid
from chimera.runtime.nccl_emulation import transport_from_env
from chimera.runtime.p2p import Mailbox
from chimera.runtime.sync import BUCKET_BYTES, GradSync, ReplicaGrads


def _probe_forward(module: nn.Module, shape: tuple, dtype: torch.dtype) -> tuple[tuple, torch.dtype]:
    """Output (shape, dtype) of ``module`` for a zero input of ``shape`` (one or two rows).

    A real forward rather than the meta device: meta's first use imports torch's compiler
    stack (seconds per process), and a two-row forward costs little.
    """
    device = next(module.parameters()).device
    with torch.no_grad():
        y = module(torch.zeros(shape, dtype=dtype, device=device))
    return tuple(y.shape), y.dtype


def infer_boundary_shapes(grid: ProcessGrid, modules: dict, input_shape: tuple,
                          input_dtype: torch.dtype) -> list[tuple[tuple, torch.dtype]]:
    """Per stage, the (per-row shape, dtype) of its output, agreed on by every rank.

    Stage s is probed by the rank holding its pipe-0 replica in data replica 0, which
    broadcasts the result; shapes exclude the leading batch dimension.
    """
    shape, dtype = (2,) + tuple(input_shape), input_dtype
    out = []
    for stage in range(grid.placement.stages):
        owner = grid.global_rank(grid.placement.rank_of(0, stage), 0)
        box: list = [None]
        if grid.rank == owner:
            y_shape, y_dtype = _probe_forward(modules[(0, stage)], shape, dtype)
            box = [(y_shape[1:], str(y_dtype).replace("torch.", ""))]
        dist.broadcast_object_list(box, src=owner)
        row_shape, dtype_name = box[0]
        dtype = getattr(torch, dtype_name)
        shape = (2,) + tuple(row_shape)
        out.append((tuple(row_shape), dtype))
    return out


class PipelineRuntime:
    """One rank's share of a pipelined model, running a lowered schedule.

    ``stage_factory(stage)`` builds stage ``stage`` (identical weights on every replica);
    ``loss_fn(output, targets)`` turns the last stage's output into a loss.
    """

    def __init__(self, schedule: Schedule, grid: ProcessGrid,
                 stage_factory: Callable[[int], nn.Module], loss_fn, input_shape: tuple,
                 input_dtype: torch.dtype, rows: int, recompute: bool = False,
                 autocast: torch.dtype | None = None, device: torch.device | None = None,
                 comm_timeout: float = 300.0):
        if not schedule.lowered:
            raise ScheduleError("the runtime needs a lowered schedule (chimera.passes.lower)")
        self.schedule, self.grid = schedule, grid
        self.device = device or torch.device("cpu")
        self.rows = rows  # rows of one schedule micro-batch
        self.modules = {(p, s): stage_factory(s).to(self.device) for p, s in grid.held()}
        self.grads = {key: ReplicaGrads(m) for key, m in self.modules.items()}
        self.plan = plan_comm(schedule)
        grid.build_groups()
        grid.warm_up(self.plan, self.device)
        self.shapes = infer_boundary_shapes(grid, self.modules, input_shape, input_dtype)
        wire = next(iter(self.modules.values())).parameters().__next__().dtype
        # NCCL: no timed (CPU-blocking, polling) waits; its timeout and watchdog catch hangs
        timeout = None if dist.get_backend() == "nccl" else comm_timeout
        self.mailbox = Mailbox(self.plan, grid, self._message_shape, wire, self.device, timeout,
                               transport_from_env(grid.rank))
        # Buckets reduced inside the last backward pay off where the allreduce runs beside the
        # compute (NCCL); with gloo on CPU cores the reduction competes with the compute for the
        # same cores and measured no faster than one allreduce per replica at SYNC (README).
        buckets = BUCKET_BYTES if self.device.type == "cuda" else 0
        self.sync = GradSync(self.grads, grid.stage_groups, grid.rank, timeout, buckets)
        self.executor = Executor(schedule, self.modules, loss_fn, self.mailbox, self.sync,
                                 recompute, autocast, self.device, self.plan.early[grid.d])
        self.program = self.plan.steps[grid.d]

    def _message_shape(self, msg: Message) -> tuple:
        # an activation into stage s is stage s-1's output; a gradient into s is s's output's
        stage = msg.stage - 1 if msg.kind.name == "RECV_F" else msg.stage
        return (self.rows,) + self.shapes[stage][0]

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules.values() for p in m.parameters()]

    def zero_grad(self) -> None:
        for g in self.grads.values():
            g.zero()

    def run(self, data: MicroData, record: list[ActionRecord] | None = None) -> float:
        """One iteration's forwards, backwards and gradient sync (not the optimizer step)."""
        return self.executor.run(self.program, data, record)

    def owned_sq_norm(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (float64 scalar).

        After the allreduce every replica of a stage holds the same gradient, so each of the
        stage's replica ranks sums the squares of one slice of it: the stage counts once, and
        the work is spread evenly (a norm in the parameters' own precision is ~40x faster than
        converting to float64 first; the partial sums are added in float64).
        """
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for (p, s), g in self.grads.items():
            if min(q for q, t in self.grads if t == s) != p:
                continue  # a second replica of the same stage on this rank
            ranks = self.grid.stage_ranks[s]
            k, n = ranks.index(self.grid.rank), len(ranks)
            size = -(-g.flat.numel() // n)
            part = g.flat[k * size:(k + 1) * size]
            if part.numel():
                total += torch.linalg.vector_norm(part).double() ** 2
        return total
