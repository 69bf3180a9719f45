"""torch.distributed.pipelining's schedules as our Schedules, without processes.

A multi-stage schedule of torch runs its ``pipeline_order``; torch's own visualizer helper
(``_schedule_visualizer.get_schedule_ops``) builds it on mock stages, so the order can be
simulated beside ours at any (D, N) with the same cost model. A single-stage one (GPipe,
1F1B) runs its own loop, the textbook order our schedule of the same name has (its
``pipeline_order`` is for pictures only).
"""

from __future__ import annotations

from torch.distributed import pipelining
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from chimera.bench.rows import TORCH_SCHEDULES
from chimera.ir import Action, Op, Placement, Schedule
from chimera.schedules import build

# torch's computation types -> ours (communication, REDUCE_GRAD, UNSHARD/RESHARD are dropped:
# our lowering adds the messages; DualPipeV's OVERLAP_F_B is its sub-actions in order)
_TORCH_OPS = {"F": Op.F, "B": Op.B, "I": Op.I, "W": Op.W}


def torch_placement(name: str, ranks: int) -> Placement:
    """The placement of torch's schedule ``name`` (a ``TORCH_SCHEDULES`` row) on ``ranks``."""
    _, style, per_rank = TORCH_SCHEDULES[name]
    return {"linear": Placement.linear(ranks), "v": Placement.v(ranks),
            "loop": Placement.loop(ranks, per_rank)}[style]


def from_pipeline_order(name: str, cls_name: str, ranks: int, micro_batches: int, order) -> Schedule:
    """torch's ``pipeline_order`` (rank -> actions) as our unlowered Schedule."""
    programs = tuple(tuple(ours(order.get(r, []) if isinstance(order, dict) else order[r]))
                     for r in range(ranks))
    return Schedule(f"torch:{cls_name}", torch_placement(name, ranks), (0,) * micro_batches, programs)


def torch_order(name: str, ranks: int, micro_batches: int) -> Schedule:
    """The order torch's schedule ``name`` runs on ``ranks`` ranks and N micro-batches."""
    cls_name, _, per_rank = TORCH_SCHEDULES[name]
    cls = getattr(pipelining, cls_name)
    if issubclass(cls, PipelineScheduleSingle):
        return build(name, ranks, micro_batches)
    ops = get_schedule_ops(cls, ranks, micro_batches, num_stages_per_rank=per_rank)
    return from_pipeline_order(name, cls_name, ranks, micro_batches, ops)


def ours(actions) -> list[Action]:
    out = []
    for a in actions:
        if a is None:
            continue
        if a.sub_actions:
            out += ours(a.sub_actions)
            continue
        op = _TORCH_OPS.get(a.computation_type.value)
        if op is not None:
            out.append(Action(op, 0, a.stage_index, a.microbatch_index))
    return out
