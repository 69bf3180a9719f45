"""Bring your own model: pipeline-train any sequence of layers with any schedule.

Example (runs as is; see ``examples/byo_model.py``)::

    import torch
    from torch import nn
    import chimera.api as chimera

    def make_layers():                    # called on every rank with the same seed
        return [nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)]

    def main(rank, world):                # one call per process
        pipe = chimera.Pipeline(make_layers, nn.functional.mse_loss, schedule="chimera",
                                stages=2, micro_batches=4, micro_batch_size=8,
                                example_input=torch.zeros(1, 16))
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        for step in range(100):
            x, y = torch.randn(32, 16), torch.randn(32, 1)   # the same mini-batch on every rank
            loss = pipe.step(x, y)                            # forward, backward, gradient sync
            opt.step()

    chimera.spawn(main, world=2)          # or run main under torchrun

A layer is any module mapping one tensor to one tensor; the first takes the raw input, the
last's output goes to ``loss_fn(output, target)`` (a mean over the micro-batch). Every rank
receives the whole mini-batch and takes its rows, so the gradient equals single-device
training on the same mini-batch (the tests check this to 1e-10 in float64).
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from chimera.ir import ScheduleError
from chimera.passes import lower
from chimera.runtime.allocator import keep_freed_memory
from chimera.runtime.executor import ActionRecord, MicroData
from chimera.runtime.grid import ProcessGrid, end_group
from chimera.runtime.pipeline import PipelineRuntime
from chimera.schedules import build, require_runnable
from chimera.validate import validate

__all__ = ["Pipeline", "balanced_partition", "spawn"]


def balanced_partition(layers: Sequence[nn.Module], parts: int) -> list[range]:
    """Contiguous ranges balancing parameter counts (layers without weights count a little)."""
    from chimera.models.partition import partition

    costs = [1.0 + sum(p.numel() for p in layer.parameters()) for layer in layers]
    return partition(costs, parts)


class Pipeline:
    """This rank's share of a pipelined model. Construct it on every rank, same arguments.

    ``make_layers()`` must return the same layers with the same weights on every rank (it
    is called after ``torch.manual_seed(seed)``). ``partition`` gives one range of layer
    indices per stage (default: balanced by parameter count).
    """

    def __init__(self, make_layers: Callable[[], Sequence[nn.Module]], loss_fn: Callable,
                 schedule: str = "chimera", stages: int = 2, micro_batches: int | None = None,
                 micro_batch_size: int = 1, example_input: torch.Tensor | None = None,
                 data_parallel: int = 1,
                 partition: Sequence[range] | None = None, seed: int = 0, sync: str = "eager",
                 recompute: bool = False, comm_timeout: float = 300.0, **schedule_options):
        if not dist.is_initialized():
            raise RuntimeError("chimera.api.Pipeline needs torch.distributed initialized "
                               "(use chimera.api.spawn or torchrun)")
        keep_freed_memory()  # this process trains: keep its freed buffers (under torchrun too)
        if example_input is None:
            raise ValueError("example_input (one row of input, batch dimension first) is required")
        world = dist.get_world_size()
        if world != stages * data_parallel:
            raise ScheduleError(f"world size {world} != stages x data_parallel = {stages * data_parallel}")
        n = micro_batches or stages
        require_runnable(schedule)
        self.schedule = validate(lower(build(schedule, stages, n, **schedule_options), sync))
        torch.manual_seed(seed)
        layers = list(make_layers())
        self.ranges = list(partition) if partition else balanced_partition(layers, self.schedule.stages)
        if len(self.ranges) != self.schedule.stages:
            raise ScheduleError(f"partition has {len(self.ranges)} stages, the schedule needs "
                                f"{self.schedule.stages}")
        self.grid = ProcessGrid(self.schedule.placement, data_parallel, dist.get_rank())
        self.batch_rows = micro_batch_size * n * data_parallel
        self.rows = int(micro_batch_size * self.schedule.micro_scale)
        if self.rows * self.schedule.micro_batches * data_parallel != self.batch_rows:
            raise ValueError(f"micro_batch_size {micro_batch_size} cannot be halved for {schedule}")
        self.runtime = PipelineRuntime(
            self.schedule, self.grid, lambda s: self._stage(layers, s), loss_fn,
            input_shape=tuple(example_input.shape[1:]), input_dtype=example_input.dtype,
            rows=self.rows, recompute=recompute, comm_timeout=comm_timeout)

    def _stage(self, layers: list[nn.Module], stage: int) -> nn.Module:
        import copy

        # each replica gets its own copy: two replicas of one stage may live on one rank's host
        return nn.Sequential(*[copy.deepcopy(layers[i]) for i in self.ranges[stage]])

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (all replicas it holds): give them to your optimizer."""
        return self.runtime.parameters()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor,
             record: list[ActionRecord] | None = None) -> float:
        """Forward, backward and gradient sync of one mini-batch; returns the mean loss.

        Gradients are left in ``.grad`` of :meth:`parameters` (zeroed here first): call your
        optimizer's ``step()`` next.
        """
        if inputs.shape[0] != self.batch_rows:
            raise ValueError(f"expected a mini-batch of {self.batch_rows} rows "
                             f"(W x N x micro_batch_size), got {inputs.shape[0]}")
        runtime, rows = self.runtime, self.rows
        s, grid = self.schedule, self.grid
        lo = grid.w * s.micro_batches * rows
        data = MicroData(weights={m: rows / inputs.shape[0] for m in range(s.micro_batches)})
        held = set(grid.held())
        for m, pipe in enumerate(s.micro_pipe):
            sl = slice(lo + m * rows, lo + (m + 1) * rows)
            if (pipe, 0) in held:
                data.inputs[m] = inputs[sl].to(runtime.device)
            if (pipe, s.stages - 1) in held:
                data.targets[m] = targets[sl].to(runtime.device)
        runtime.zero_grad()
        loss = torch.tensor([runtime.run(data, record)], dtype=torch.float64)
        dist.all_reduce(loss)
        return float(loss)


def _entry(rank: int, world: int, fn, port: int, backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        fn(rank, world)
    except BaseException:
        dist.destroy_process_group()  # no barrier: a peer may be gone
        raise
    end_group(torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu"))


def spawn(fn: Callable[[int, int], None], world: int, backend: str = "gloo") -> None:
    """Run ``fn(rank, world)`` in ``world`` local processes joined in one process group."""
    import torch.multiprocessing as mp

    from chimera.train.launch import free_port

    mp.start_processes(_entry, args=(world, fn, free_port(), backend), nprocs=world,
                       start_method="spawn")
