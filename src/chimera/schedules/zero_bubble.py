"""ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024), as published.

The V placement cuts the model into 2D stages: rank r holds chunk 0 = stage r (on the way
down) and chunk 1 = stage 2D-1-r (on the way back), so the first and the last stage live on
rank 0 and a micro-batch's forward turns around on rank D-1 without a hop. Backward is split
into I and W. Each rank runs, with ``F0 / I0 / W0`` acting on chunk 0 and ``F1 / I1 / W1`` on
chunk 1, each on micro-batches in order:

1. 2(D-r)-1 x F0                 warm-up: fill the way down
2. r x F1 F0                     the way back starts to arrive
3. (D-r) x F1 I1 W1              chunk 1's backward starts right at the turn
4. F0 I0 W0 F1 I1 W1 ...         steady state until every forward is done
5. r x I0 I1                     cool-down: input gradients first ...
6. (D-r) x I0 W0
7. the W1 then W0 still owed     ... weight gradients fill the tail

Peak activations: 2(D-r)-1 + 2r + 1 = 2D chunks of half a stage, i.e. D Ma on every rank (1F1B's
peak). The order needs N >= 2D-1 micro-batches; smaller N runs the order for 2D-1 with the
missing micro-batches dropped, which keeps it valid.
"""

from __future__ import annotations

from chimera.ir import Action, Op, Placement, Schedule, ScheduleError
from chimera.schedules.registry import register


class _Chunks:
    """Counters of one rank's two chunks; ``emit(op, c)`` appends the next action of chunk c."""

    def __init__(self, ranks: int, rank: int):
        self.stage = (rank, 2 * ranks - 1 - rank)
        self.count = {(op, c): 0 for op in (Op.F, Op.I, Op.W) for c in (0, 1)}
        self.out: list[Action] = []

    def emit(self, op: Op, chunk: int) -> None:
        self.out.append(Action(op, 0, self.stage[chunk], self.count[(op, chunk)]))
        self.count[(op, chunk)] += 1

    def done(self, op: Op, chunk: int) -> int:
        return self.count[(op, chunk)]


def _zbv_rank(d: int, r: int, n: int) -> list[Action]:
    c = _Chunks(d, r)
    for _ in range(2 * (d - r) - 1):
        c.emit(Op.F, 0)
    for _ in range(r):
        c.emit(Op.F, 1), c.emit(Op.F, 0)
    for _ in range(d - r):
        c.emit(Op.F, 1), c.emit(Op.I, 1), c.emit(Op.W, 1)
    while c.done(Op.F, 0) < n or c.done(Op.F, 1) < c.done(Op.F, 0):
        if c.done(Op.F, 0) < n:
            c.emit(Op.F, 0)
        c.emit(Op.I, 0), c.emit(Op.W, 0)
        c.emit(Op.F, 1), c.emit(Op.I, 1), c.emit(Op.W, 1)
    for _ in range(r):
        c.emit(Op.I, 0), c.emit(Op.I, 1)
    for _ in range(d - r):
        c.emit(Op.I, 0), c.emit(Op.W, 0)
    for chunk in (1, 0):
        while c.done(Op.W, chunk) < n:
            c.emit(Op.W, chunk)
    return c.out


@register("zb-v", "ZB-V (Qi et al. 2024): V placement (2 stages per rank, one weight copy), B split "
                  "into I/W; near-zero bubbles at 1F1B's peak memory (D Ma); N >= 2D-1 as published")
def zb_v(stages: int, micro_batches: int) -> Schedule:
    if stages < 2 or micro_batches < 1:
        raise ScheduleError(f"zb-v needs stages >= 2 and micro-batches >= 1, got {stages}, {micro_batches}")
    n = max(micro_batches, 2 * stages - 1)
    programs = [tuple(a for a in _zbv_rank(stages, r, n) if a.micro < micro_batches)
                for r in range(stages)]
    return Schedule("zb-v", Placement.v(stages), (0,) * micro_batches, tuple(programs),
                    params={"stages": stages, "micro_batches": micro_batches})
