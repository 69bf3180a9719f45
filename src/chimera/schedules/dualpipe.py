"""DeepSeek's DualPipe and DualPipeV, as published (github.com/deepseek-ai/DualPipe).

Both run the same eight phases on every rank; only the placement differs:

- **DualPipe** is bidirectional on Chimera's placement with two weight copies: rank r holds
  stage r of the down pipe and stage D-1-r of the up pipe; N/2 micro-batches enter at each
  end. On each rank the *near* replica (the one whose stage is in the first half of the
  model: the down pipe on ranks 0 .. D/2-1, the up pipe beyond) plays phase 0, the other
  phase 1; ``h = min(r, D-1-r)`` and there are H = D/2 "half ranks".
- **DualPipeV** cuts it in half on one weight copy: the V placement, rank r holding stage r
  (phase 0) and stage 2D-1-r (phase 1), every micro-batch going down and back; h = r, H = D.

With C micro-batches per phase, the phases of one rank are (B = I then W at once; "zb"
defers the W to a FIFO queue that later W slots pop):

1. 2(H-h-1) x F0                       warm-up of the near replica
2. (h+1) x F0 F1
3. (H-h-1) x B1(zb) W F1               zero-bubble start of the far replica
4. (C-2H+h+1) x F0 B1 F1 B0            the main step; DualPipe overlaps each F&B pair
5. (H-h-1) x B1 F1 B0
6. (h+1) x B1 B0                       the second half of these defer their W (zb)
7. (H-h-1) x W B0(zb)
8. (h+1) x W

An overlapped F&B pair is written as two consecutive actions (F, then I and W). The
published code needs N >= 2D (and N even for DualPipe); smaller or odd N run the order for
the smallest valid N with the missing micro-batches dropped, which keeps it valid.
"""

from __future__ import annotations

from collections import deque

from chimera.ir import Action, Op, Placement, Schedule, ScheduleError
from chimera.schedules.registry import register


class _Rank:
    """One rank's program under construction: per-phase counters and the deferred-W queue."""

    def __init__(self, replicas: tuple[tuple[int, int], tuple[int, int]], micros):
        self.replicas = replicas  # (pipe, stage) of phase 0 and phase 1
        self.micros = micros  # micros[phase]: the micro-batches of that phase, in order
        self.next_f, self.next_b = [0, 0], [0, 0]
        self.deferred: deque[Action] = deque()
        self.out: list[Action] = []

    def _action(self, op: Op, phase: int, k: int) -> Action:
        pipe, stage = self.replicas[phase]
        return Action(op, pipe, stage, self.micros[phase][k])

    def f(self, phase: int) -> None:
        self.out.append(self._action(Op.F, phase, self.next_f[phase]))
        self.next_f[phase] += 1

    def b(self, phase: int, zb: bool = False) -> None:
        k = self.next_b[phase]
        self.next_b[phase] += 1
        self.out.append(self._action(Op.I, phase, k))
        w = self._action(Op.W, phase, k)
        if zb:
            self.deferred.append(w)
        else:
            self.out.append(w)

    def w(self) -> None:
        self.out.append(self.deferred.popleft())


def _phases(rank: _Rank, h: int, half: int, chunks: int) -> list[Action]:
    """The eight published phases for one rank (see the module docstring)."""
    rest = half - h - 1
    for _ in range(2 * rest):
        rank.f(0)
    for _ in range(h + 1):
        rank.f(0), rank.f(1)
    for _ in range(rest):
        rank.b(1, zb=True), rank.w(), rank.f(1)
    for _ in range(chunks - 2 * half + h + 1):
        rank.f(0), rank.b(1), rank.f(1), rank.b(0)
    for _ in range(rest):
        rank.b(1), rank.f(1), rank.b(0)
    for i in range(h + 1):  # W deferred from the middle on; odd h switches one action earlier
        switch = i > (h + 1) // 2 or (i == (h + 1) // 2 and h % 2 == 1)
        rank.b(1, zb=switch)
        rank.b(0, zb=switch or i == (h + 1) // 2)
    for _ in range(rest):
        rank.w(), rank.b(0, zb=True)
    for _ in range(h + 1):
        rank.w()
    if rank.deferred:  # pragma: no cover - the counts above always drain the queue
        raise ScheduleError("dualpipe: deferred weight gradients left over")
    return rank.out


def _keep(programs: list[list[Action]], micro_batches: int) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(a for a in prog if a.micro < micro_batches) for prog in programs)


def _check(stages: int, micro_batches: int, even: bool) -> None:
    if stages < 2 or (even and stages % 2):
        raise ScheduleError(f"needs {'an even number of ' if even else ''}stages >= 2, got {stages}")
    if micro_batches < 1:
        raise ScheduleError(f"needs micro-batches >= 1, got {micro_batches}")


@register("dualpipe", "DeepSeek DualPipe: bidirectional on Chimera's placement (2 weight copies), "
                      "overlapped F&B pairs, B split into I/W at the ends; published for N >= 2D")
def dualpipe(stages: int, micro_batches: int) -> Schedule:
    """Micro-batch m enters the down pipe (pipe 0) if m is even, the up pipe if odd."""
    _check(stages, micro_batches, even=True)
    d, half = stages, stages // 2
    chunks = max((micro_batches + 1) // 2, d)  # per direction, as run before dropping extras
    micros = (tuple(range(0, 2 * chunks, 2)), tuple(range(1, 2 * chunks, 2)))
    programs = []
    for r in range(d):
        down, up = (0, r), (1, d - 1 - r)
        near_is_down = r < half
        replicas = (down, up) if near_is_down else (up, down)
        phase_micros = micros if near_is_down else micros[::-1]
        programs.append(_phases(_Rank(replicas, phase_micros), min(r, d - 1 - r), half, chunks))
    return Schedule("dualpipe", Placement.chimera(d, 2), tuple(m % 2 for m in range(micro_batches)),
                    _keep(programs, micro_batches),
                    params={"stages": stages, "micro_batches": micro_batches})


@register("dualpipev", "DeepSeek DualPipeV: DualPipe cut in half on one weight copy (V placement, "
                       "2 stages per rank), B split into I/W at the ends; published for N >= 2D")
def dualpipev(stages: int, micro_batches: int) -> Schedule:
    _check(stages, micro_batches, even=False)
    d = stages
    chunks = max(micro_batches, 2 * d)
    micros = (tuple(range(chunks)),) * 2
    programs = [_phases(_Rank(((0, r), (0, 2 * d - 1 - r)), micros), r, d, chunks) for r in range(d)]
    return Schedule("dualpipev", Placement.v(d), (0,) * micro_batches, _keep(programs, micro_batches),
                    params={"stages": stages, "micro_batches": micro_batches})
