"""Generated schedules the planner prices, built once per shape (no torch).

A shape is (scheme, options, D, N): it does not depend on the model or the machine, so one
:class:`ShapeCache` can serve several plans (``benchmarks/paper_scale.py`` shares one across
its workloads). What the planner needs of a shape is computed lazily: the replicas each rank
holds (for bounds), its activation peaks (for memory), its compiled order (for timing).
"""

from __future__ import annotations

from chimera.ir import Schedule, ScheduleError
from chimera.plan.memory import HeldActivations
from chimera.schedules import build
from chimera.sim.engine import CompiledSchedule, compile_schedule


class Shape:
    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        replicas: list[list[tuple[int, int]]] = [[] for _ in range(schedule.ranks)]
        for pipe, row in enumerate(schedule.placement.table):
            for stage, rank in enumerate(row):
                replicas[rank].append((pipe, stage))
        self.replicas = replicas  # [rank] = the (pipe, stage) replicas it holds
        self._held: HeldActivations | None = None
        self._compiled: CompiledSchedule | None = None
        self._deadlock = False

    @property
    def asynchronous(self) -> bool:
        return bool(self.schedule.params.get("asynchronous"))

    @property
    def held(self) -> HeldActivations:
        if self._held is None:
            self._held = HeldActivations.of(self.schedule)
        return self._held

    def compiled(self) -> CompiledSchedule | None:
        """The unlowered schedule compiled for timing with ``eager_sync``; None on deadlock."""
        if self._compiled is None and not self._deadlock:
            try:
                self._compiled = compile_schedule(self.schedule)
            except ScheduleError:
                self._deadlock = True
        return self._compiled


# A reference is a schedule the user could run instead of ours (torch.distributed.pipelining's,
# each in its own order): named ``torch:NAME``, built by a factory the caller gives
# (``references[name](D, N) -> Schedule``; the planner imports no torch).
REFERENCE_PREFIX = "torch:"


def is_reference(scheme: str) -> bool:
    return scheme.startswith(REFERENCE_PREFIX)


class ShapeCache:
    """Shapes by (scheme, options, D, N); None where the generator refuses the arguments.
    ``references``: factories of the reference schedules (see :data:`REFERENCE_PREFIX`)."""

    def __init__(self, references: dict | None = None) -> None:
        self.references = dict(references or {})
        self._shapes: dict[tuple, Shape | None] = {}
        self._probes: dict[tuple, Shape | None] = {}
        self.built = 0

    def get(self, scheme: str, options: tuple, depth: int, n: int) -> Shape | None:
        key = (scheme, options, depth, n)
        if key not in self._shapes:
            try:
                made = (self.references[scheme](depth, n) if is_reference(scheme)
                        else build(scheme, depth, n, **dict(options)))
                self._shapes[key] = Shape(made)
                self.built += 1
            except ScheduleError:
                self._shapes[key] = None
        return self._shapes[key]

    def probe(self, scheme: str, options: tuple, depth: int, n: int) -> Shape | None:
        """A small shape of the scheme at depth D: its placement, split and micro_scale (which
        no generator makes depend on N). Tries few micro-batches first: generators are fast
        there. None if the scheme cannot run at this depth at all."""
        key = (scheme, options, depth)
        if key not in self._probes:
            tries = sorted({2**k for k in range(2 + depth.bit_length())} | {n})
            self._probes[key] = next((s for s in (self.get(scheme, options, depth, m) for m in tries)
                                      if s is not None), None)
        return self._probes[key]
