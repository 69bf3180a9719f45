"""What the emulated bench charges for, on our rows and torch's alike (no torch).

The bidirectional placement costs something and saves something, and the bench prices both
the same way for every schedule (issue 36):

- per-layer costs: the model has ``layers_per_stage`` layers per D-th; the last layer is
  heavier by ``head - 1`` D-ths (the LM head) and the first by ``embed - 1`` (the
  embedding), so with ``head=1.5`` the last D-th of the model costs 1.5 D-ths;
- the cut: ``layers`` gives every stage of a placement the same number of layers (what a
  user gets without thinking); ``cost`` cuts each placement for its own ranks
  (:func:`chimera.modelcfg.partition_for_ranks`: the busiest rank does least, counting both
  stages of a V or Chimera rank), as torchtitan users put fewer layers on the first and last
  stage by hand;
- p2p links: ``link_ms``, each hop delivered that much later than the measured link;
- gradient collectives priced by their bytes: ``allreduce_ms`` for the allreduce of a
  D-th of the model's gradients (a stage pays for the gradient floats of the layers it
  holds: ``WIDTH`` a layer, the last and first more by ``head_params - 1`` and
  ``embed_params - 1`` D-ths, :func:`layer_params`: an LM head's and an embedding's
  gradients, where ``head`` and ``embed`` are their compute), over a
  stage's replicas times ``data_parallel``: at W=1 only Chimera's replica allreduce runs,
  at W >= 2 (W copies of the pipeline on W*D ranks) every schedule's data-parallel one
  (Chimera's rank reduces two D-ths, a V rank two half D-ths; torch's rows issue theirs at
  their REDUCE_GRAD, :mod:`chimera.bench.torch_dp`).

Every simulated column of the bench follows these prices (:func:`cost_model`); the emulated
layers wait as long (:mod:`chimera.models.emulated`, with :func:`layer_weights` and
:func:`cut`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from chimera.errors import UserError
from chimera.ir import Placement, Schedule
from chimera.modelcfg import partition_for_ranks
from chimera.sim.cost import CostModel

PARTITIONS = ("layers", "cost")
WIDTH = 16  # floats an emulated layer computes with, (rows, WIDTH), and its bias's gradient
# what the bench prices beyond uniform stages: (flag, BenchConfig field, default), one list
# for the CLI, the file names' tag, the regime table's commands
FLAGS = (("--head", "head", 1.0), ("--embed", "embed", 1.0),
         ("--head-params", "head_params", 1.0), ("--embed-params", "embed_params", 1.0),
         ("--layers-per-stage", "layers_per_stage", 2), ("--partition", "partition", "layers"),
         ("--link-ms", "link_ms", 0.0), ("--allreduce-ms", "allreduce_ms", 0.0),
         ("--data-parallel", "data_parallel", 1))


def layer_count(cfg) -> int:
    """Layers of the emulated model: ``layers_per_stage`` per D-th."""
    return cfg.layers_per_stage * cfg.stages


def layer_weights(cfg) -> list[float]:
    """Each layer's cost in D-ths of a uniform model: 1/k for k layers per D-th, the first
    and last heavier by ``embed - 1`` and ``head - 1``."""
    weights = [1.0 / cfg.layers_per_stage] * layer_count(cfg)
    weights[0] += cfg.embed - 1.0
    weights[-1] += cfg.head - 1.0
    return weights


def layer_params(cfg) -> list[int]:
    """Each layer's gradient floats: ``WIDTH`` (its bias), the first and last more by
    ``embed_params - 1`` and ``head_params - 1`` D-ths of the model's (a D-th:
    ``layers_per_stage * WIDTH`` floats), rounded to whole floats; the emulated layers carry
    the extra (:class:`chimera.models.emulated.EmulatedLayer`), the simulator prices them."""
    per_dth = cfg.layers_per_stage * WIDTH
    floats = [WIDTH] * layer_count(cfg)
    floats[0] += round((cfg.embed_params - 1.0) * per_dth)
    floats[-1] += round((cfg.head_params - 1.0) * per_dth)
    return floats


def extra_params(cfg) -> list[int]:
    """Each emulated layer's gradient floats beyond its bias (:func:`layer_params`)."""
    return [n - WIDTH for n in layer_params(cfg)]


def held_shares(placement: Placement, micro_pipe: Sequence[int]) -> list[list[tuple[int, float]]]:
    """Per rank, (stage, part of the mini-batch through that replica) of what it holds."""
    n = max(len(micro_pipe), 1)
    share = [sum(1 for p in micro_pipe if p == pipe) / n for pipe in range(placement.pipes)]
    return [[(stage, share[pipe]) for pipe, stage in placement.held(r)]
            for r in range(placement.ranks)]


def cut(cfg, placement: Placement, micro_pipe: Sequence[int]) -> list[range]:
    """The layer ranges of the placement's stages under ``cfg.partition``."""
    layers, stages = layer_count(cfg), placement.stages
    if cfg.partition == "layers":
        if layers % stages:
            raise UserError(f"{layers} emulated layers cannot be cut into {stages} equal stages "
                            f"(--layers-per-stage {cfg.layers_per_stage} x D={cfg.stages}); "
                            f"give a multiple of {stages // math.gcd(stages, cfg.stages)} "
                            "or --partition cost")
        per = layers // stages
        return [range(k * per, (k + 1) * per) for k in range(stages)]
    return partition_for_ranks(layer_weights(cfg), held_shares(placement, micro_pipe), stages)


def stage_weights(cfg, schedule: Schedule) -> tuple[float, ...]:
    """Each stage's cost in D-ths of a uniform model, under the schedule's cut."""
    weights = layer_weights(cfg)
    return tuple(sum(weights[i] for i in r) for r in cut(cfg, schedule.placement, schedule.micro_pipe))


def tag(cfg) -> str:
    """What the bench's file names add for priced runs, e.g. ``-head1.5-cost``."""
    words = [f"head{cfg.head:g}" if cfg.head != 1 else "", f"embed{cfg.embed:g}" if cfg.embed != 1 else "",
             f"hp{cfg.head_params:g}" if cfg.head_params != 1 else "",
             f"ep{cfg.embed_params:g}" if cfg.embed_params != 1 else "",
             f"L{cfg.layers_per_stage}" if cfg.layers_per_stage != 2 else "",
             "cost" if cfg.partition == "cost" else "",
             f"link{cfg.link_ms:g}ms" if cfg.link_ms else "",
             f"ar{cfg.allreduce_ms:g}ms" if cfg.allreduce_ms else "",
             f"W{cfg.data_parallel}" if cfg.data_parallel != 1 else "",
             "zero1" if cfg.shard_optimizer else ""]
    return "".join("-" + w for w in words if w)


def cost_model(cfg, schedule: Schedule, f: float, i: float, w: float, p2p_s: float = 0.0,
               allreduce_s: float = 0.0, free: bool = False, sharded: bool = False) -> CostModel:
    """``schedule`` priced at F, I, W seconds per micro-batch per D-th, each stage at its
    weight (:func:`stage_costs`); p2p ``p2p_s`` (the measured link) plus ``link_ms``; per
    collective ``allreduce_s`` (measured) plus the priced bytes. ``free``: no communication
    cost at all (the schedule's own makespan). ``sharded``: ZeRO-1 over each stage's group
    (a reduce-scatter and an all-gather, each half an allreduce's bytes)."""
    sizes = stage_weights(cfg, schedule)
    ranges = cut(cfg, schedule.placement, schedule.micro_pipe)
    floats, per_dth = layer_params(cfg), cfg.layers_per_stage * WIDTH
    links = {} if free else dict(
        p2p_time=p2p_s + cfg.link_ms / 1e3, allreduce_time=allreduce_s,
        reduce=tuple(cfg.allreduce_ms / 1e3 * sum(floats[i] for i in r) / per_dth for r in ranges),
        data_parallel=cfg.data_parallel, shard_optimizer=sharded)
    return stage_costs(schedule, f, i, w, sizes, **links)


def stage_costs(schedule: Schedule, f: float, i: float, w: float,
                sizes: Sequence[float] | None = None, **links) -> CostModel:
    """The emulated layers' costs on ``schedule``'s cut: per stage its size in D-ths
    (``sizes``; default the uniform share D/S) times F, I and W, except the first stage: its
    input carries no gradient, so its layers do their I on the weight path (I = 0, W = I + W
    there, as ``EmulatedLayer`` waits and as a real first stage's backward is all needed for
    its weights)."""
    if sizes is None:
        sizes = (schedule.ranks / schedule.stages,) * schedule.stages
    fs = tuple(f * x for x in sizes)
    is_ = (0.0,) + tuple(i * x for x in sizes[1:])
    ws = ((i + w) * sizes[0],) + tuple(w * x for x in sizes[1:])
    return CostModel(f=fs, b=tuple(a + b for a, b in zip(is_, ws)), i=is_, w=ws, **links)


def priced(cfg) -> bool:
    """Whether ``cfg`` prices anything beyond uniform stages and the measured links."""
    return any(getattr(cfg, key) != default for _, key, default in FLAGS)
