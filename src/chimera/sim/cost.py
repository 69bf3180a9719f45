"""Cost model: how long each action takes and how much memory it holds (no torch).

Times are per full-size micro-batch on one stage. ``unit(...)`` gives the paper's unit-time
model where one forward of one micro-batch on one D-th of the model takes ``f``; placements
that cut the model into S > D stages (interleaved, V) scale per-stage times by D / S.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from chimera.collectives import AFTER_STEP, ALL_REDUCE, Choices, replica_collectives
from chimera.ir import Op, OpTimes, ScheduleError


def parse_times(text: str, flag: str = "--cost") -> tuple[float, float, float]:
    """(F, I, W) from ``"F:B"`` (B split evenly into I and W) or ``"F:I:W"``, positive numbers."""
    try:
        parts = [float(x) for x in text.split(":")]
    except ValueError:
        parts = []
    if len(parts) not in (2, 3) or any(p <= 0 or math.isnan(p) or math.isinf(p) for p in parts):
        raise ScheduleError(f"{flag} must be F:B or F:I:W with positive numbers, got {text!r}")
    return (parts[0], parts[1] / 2, parts[1] / 2) if len(parts) == 2 else tuple(parts)


@dataclass(frozen=True)
class Link:
    """Alpha-beta link: a message of n bytes takes ``alpha + n / beta`` seconds (or units)."""

    alpha: float = 0.0
    beta: float = math.inf  # bytes per time unit

    def time(self, nbytes: float) -> float:
        return self.alpha + (nbytes / self.beta if self.beta != math.inf else 0.0)

    def allreduce(self, nbytes: float, group: int) -> float:
        """Ring allreduce: 2(n-1) steps, each moving nbytes/n."""
        if group <= 1:
            return 0.0
        steps = 2 * (group - 1)
        return steps * self.alpha + (steps * nbytes / group / self.beta if self.beta != math.inf else 0.0)

    def all_gather(self, nbytes: float, group: int) -> float:
        """Ring all-gather of ``nbytes`` in all (each rank brings nbytes/n): n-1 steps, half
        of an allreduce."""
        return self.allreduce(nbytes, group) / 2


@dataclass(frozen=True)
class CostModel:
    """Per-stage compute times, p2p and allreduce links, and byte sizes.

    ``f, b, i, w``: lists of per-stage times (one entry per stage of the placement, or one
    entry for all). ``b`` defaults to ``i + w``; split ops default to half of ``b``.
    ``p2p_time`` is a fixed time per hop added to ``p2p.time(act_bytes)``.
    ``overlap_allreduce``: when False, an allreduce blocks its rank's compute stream.
    ``optimizer``: per stage, the optimizer step of one replica (a rank runs one for every
    replica it holds, after its STEP's allreduces: Chimera's second copy of each stage doubles
    it); one entry is the time for a D-th of the model, as for compute. With
    ``shard_optimizer`` each replica updates only its 1/group slice (ZeRO-1), so the time
    is divided by the stage's group (its replicas times W), and a rank then waits for the
    parameter all-gather of the stage it runs first (the runtime prefetches the others
    behind its first forwards): the iteration's price for the smaller step.
    ``reduce``: per stage, the time of its gradient allreduce priced by its bytes: one entry
    is the time for a D-th of the model's gradients, so a stage of an S > D cut (V,
    interleaved) pays D/S of it and a rank pays once per D-th it holds (Chimera's two
    replicas: twice), on top of the fixed ``allreduce_time`` per collective.
    ``w_keeps``: the share of a micro-batch's activations that W still needs after I; I
    frees the rest. 1 (the default) is what our runtime and torch's hold: I keeps the
    autograd graph whole for W. A split written by hand (the zero-bubble paper's) keeps
    only the inputs of the weighted layers, about 0.4 of a transformer block's.
    """

    f: tuple[float, ...] = (1.0,)
    b: tuple[float, ...] = (1.0,)
    i: tuple[float, ...] = ()
    w: tuple[float, ...] = ()
    p2p_time: float = 0.0
    p2p: Link = field(default_factory=Link)
    allreduce: Link = field(default_factory=Link)
    allreduce_time: float = 0.0  # fixed extra time per allreduce
    act_bytes: tuple[float, ...] = (0.0,)  # activation sent per micro-batch per stage boundary
    weight_bytes: tuple[float, ...] = (0.0,)  # gradient bytes per stage
    overlap_allreduce: bool = True
    data_parallel: int = 1
    optimizer: tuple[float, ...] = (0.0,)
    shard_optimizer: bool = False
    reduce: tuple[float, ...] = (0.0,)
    w_keeps: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.w_keeps, (int, float)) and 0.0 <= self.w_keeps <= 1.0):
            raise ScheduleError(f"cost w_keeps must be a share in [0, 1], got {self.w_keeps!r}")
        for name in ("f", "b", "i", "w", "act_bytes", "weight_bytes", "optimizer", "reduce"):
            values = getattr(self, name)
            if any((not isinstance(v, (int, float))) or v < 0 or math.isnan(v) for v in values):
                raise ScheduleError(f"cost {name} must be non-negative numbers, got {values}")
        if not self.i and not self.w:
            object.__setattr__(self, "i", tuple(x / 2 for x in self.b))
            object.__setattr__(self, "w", tuple(x / 2 for x in self.b))

    @classmethod
    def unit(cls, f: float = 1.0, b: float = 1.0, i: float | None = None, w: float | None = None,
             **kw) -> "CostModel":
        if i is not None and w is not None:
            return cls(f=(f,), b=(i + w,), i=(i,), w=(w,), **kw)
        return cls(f=(f,), b=(b,), **kw)

    @classmethod
    def parse(cls, text: str, **kw) -> "CostModel":
        """``"F:B"`` (e.g. ``1:2``) or ``"F:I:W"`` (e.g. ``1:1:1``)."""
        f, i, w = parse_times(text)
        return cls.unit(f, i=i, w=w, **kw)

    def _at(self, values: tuple[float, ...], stage: int, stages: int) -> float:
        if len(values) == 1:
            return values[0]
        if len(values) != stages:
            raise ScheduleError(f"cost model has {len(values)} per-stage values for {stages} stages")
        return values[stage]

    def compute(self, op: Op, stage: int, stages: int, ranks: int, scale: float = 1.0) -> float:
        table = {Op.F: self.f, Op.B: self.b, Op.I: self.i, Op.W: self.w}[op]
        # one entry = unit time for a D-th of the model; S > D stages are proportionally smaller
        size = ranks / stages if len(table) == 1 else 1.0
        return self._at(table, stage, stages) * size * scale

    def op_times(self, stages: int, ranks: int, scale: float = 1.0) -> OpTimes:
        """This model priced for a placement of ``stages`` stages on ``ranks`` ranks."""
        def per(op: Op) -> tuple[float, ...]:
            return tuple(self.compute(op, s, stages, ranks, scale) for s in range(stages))
        return OpTimes(per(Op.F), per(Op.B), per(Op.I), per(Op.W),
                       tuple(self.hop(s, stages, scale) for s in range(stages)))

    def hop(self, stage: int, stages: int, scale: float = 1.0) -> float:
        nbytes = self._at(self.act_bytes, stage, stages) * scale
        return self.p2p_time + (self.p2p.time(nbytes) if nbytes or self.p2p.alpha else 0.0)

    def _sized(self, values: tuple[float, ...], stage: int, stages: int, ranks: int) -> float:
        """A per-stage value where one entry is for a D-th of the model (scaled to the stage)."""
        size = ranks / stages if len(values) == 1 else 1.0
        return self._at(values, stage, stages) * size

    def step_time(self, stage: int, stages: int, ranks: int, group: int) -> float:
        """One replica's optimizer step of ``stage`` (a slice of it when sharded)."""
        t = self._sized(self.optimizer, stage, stages, ranks)
        return t / group if self.shard_optimizer and group > 1 else t

    def gather(self, stage: int, stages: int, group: int, ranks: int | None = None) -> float:
        """The parameter all-gather of a sharded stage after the step (0 unsharded)."""
        share = _shares(group, self.shard_optimizer)[1]
        return share * self._allreduce(stage, stages, group, ranks) if share else 0.0

    def sync(self, stage: int, stages: int, group: int, ranks: int | None = None) -> float:
        """The gradient reduction of ``stage`` over ``group`` ranks (``ranks``: the
        placement's, which sizes a one-entry ``reduce``; None: as many as stages)."""
        share = _shares(group, self.shard_optimizer)[0]
        return share * self._allreduce(stage, stages, group, ranks) if share else 0.0

    def _allreduce(self, stage: int, stages: int, group: int, ranks: int | None) -> float:
        """A ring allreduce of ``stage``'s gradients over ``group`` ranks."""
        nbytes = self._at(self.weight_bytes, stage, stages)
        by_size = self._sized(self.reduce, stage, stages, stages if ranks is None else ranks)
        return self.allreduce_time + by_size + self.allreduce.allreduce(nbytes, group)


@functools.lru_cache(maxsize=None)
def _shares(group: int, sharded: bool) -> tuple[float, float]:
    """What one replica of a stage issues over its ``group`` (:mod:`chimera.collectives`, the
    runtime's definition, on the device path; the simulator times a replica's reduction from
    its SYNC, so unbucketed), in shares of one ring allreduce of the stage's gradients: (its
    reduction, its all-gather after the step). An allreduce counts whole, a reduce-scatter or
    an all-gather half (each moves half the bytes). Cached: the planner prices thousands of
    runs."""
    reduce = gather = 0.0
    for c in replica_collectives((1,), group, Choices(0, True), early=False, sharded=sharded):
        share = c.size if c.kind == ALL_REDUCE else c.size / 2
        if c.when == AFTER_STEP:
            gather += share
        else:
            reduce += share
    return reduce, gather
