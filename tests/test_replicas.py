"""Replicas of a stage start equal even when each rank built its copy differently."""

import torch

from chimera.passes import lower
from chimera.runtime.context import RunContext
from chimera.runtime.grid import ProcessGrid
from chimera.runtime.pipeline import PipelineRuntime
from chimera.runtime.virtual import run_virtual
from chimera.schedules import build


def test_replicas_are_made_equal_at_construction():
    schedule = lower(build("chimera", 2, 4))

    def rank_body(rank: int):
        def stage(s: int):  # a per-rank RNG, as a list built on each rank without a seed
            gen = torch.Generator().manual_seed(100 * rank + s)
            layer = torch.nn.Linear(4, 4)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(4, 4, generator=gen))
            layer.register_buffer("count", torch.tensor([rank + 1]))
            return torch.nn.Sequential(layer)

        grid = ProcessGrid(schedule.placement, 1, rank)
        runtime = PipelineRuntime(schedule, grid, stage, torch.nn.functional.mse_loss,
                                  RunContext.here(), rows=2, example=torch.zeros(2, 4))
        return {s: [t.clone() for t in list(m.parameters()) + list(m.buffers())]
                for (_, s), m in runtime.modules.items()}

    held = run_virtual(2, rank_body)
    for stage in (0, 1):
        for a, b in zip(held[0][stage], held[1][stage]):
            assert torch.equal(a, b)
