"""One-directional synchronous schedules: GPipe, 1F1B, interleaved 1F1B, ZB-H1."""

from __future__ import annotations

from chimera.ir import Action, Op, Placement, Schedule, ScheduleError
from chimera.schedules.registry import Option, register


def _check(stages: int, micro_batches: int) -> None:
    if stages < 1 or micro_batches < 1:
        raise ScheduleError(f"need stages >= 1 and micro-batches >= 1, got {stages}, {micro_batches}")


def _linear(name: str, stages: int, micro_batches: int, programs, **params) -> Schedule:
    return Schedule(name, Placement.linear(stages), (0,) * micro_batches,
                    tuple(tuple(p) for p in programs),
                    params={"stages": stages, "micro_batches": micro_batches, **params})


@register("gpipe", "GPipe: all forwards, then all backwards; N micro-batches of activations")
def gpipe(stages: int, micro_batches: int) -> Schedule:
    """Bubble ratio (D-1)/(N+D-1) with equal F and B; every rank holds N activations."""
    _check(stages, micro_batches)
    progs = [[Action(Op.F, 0, r, m) for m in range(micro_batches)]
             + [Action(Op.B, 0, r, m) for m in range(micro_batches)] for r in range(stages)]
    return _linear("gpipe", stages, micro_batches, progs)


@register("1f1b", "1F1B (DAPPLE / PipeDream-Flush): GPipe's bubbles, rank r holds D-r activations")
def one_f_one_b(stages: int, micro_batches: int) -> Schedule:
    _check(stages, micro_batches)
    progs = []
    for r in range(stages):
        warm = min(stages - r - 1, micro_batches)
        prog = [Action(Op.F, 0, r, m) for m in range(warm)]
        for k in range(micro_batches - warm):  # steady state: one forward, one backward
            prog += [Action(Op.F, 0, r, warm + k), Action(Op.B, 0, r, k)]
        prog += [Action(Op.B, 0, r, m) for m in range(micro_batches - warm, micro_batches)]
        progs.append(prog)
    return _linear("1f1b", stages, micro_batches, progs)


@register("interleaved", "Megatron interleaved 1F1B: `chunks` virtual stages per rank, "
                         "bubble (D-1)/(vN+D-1); needs N a multiple of D",
          options=(Option("chunks", int, "virtual stages per rank v", short="-v", symbol="v",
                          cells=True, bench=(2,),
                          search=lambda depth, layers: [v for v in (2, 4) if depth * v <= layers]),))
def interleaved(stages: int, micro_batches: int, chunks: int = 2) -> Schedule:
    """Rank r holds virtual stages r, r+D, ..., r+(v-1)D (loop placement)."""
    _check(stages, micro_batches)
    if chunks < 2:
        raise ScheduleError(f"interleaved needs chunks >= 2 (chunks=1 is 1f1b), got {chunks}")
    if micro_batches % stages:
        raise ScheduleError(f"interleaved needs micro-batches ({micro_batches}) to be a multiple "
                            f"of stages ({stages})")
    d, v, n = stages, chunks, micro_batches
    total = v * n

    def unit(k: int, backward: bool) -> tuple[int, int]:
        """(chunk, micro) of the k-th forward (or backward) slot of a rank."""
        chunk = (k // d) % v
        micro = (k // (d * v)) * d + k % d
        return (v - 1 - chunk if backward else chunk), micro

    progs = []
    for r in range(d):
        warm = min((d - r - 1) * 2 + (v - 1) * d, total)
        prog = []
        for k in range(warm):
            c, m = unit(k, False)
            prog.append(Action(Op.F, 0, c * d + r, m))
        for k in range(total - warm):
            c, m = unit(warm + k, False)
            prog.append(Action(Op.F, 0, c * d + r, m))
            c, m = unit(k, True)
            prog.append(Action(Op.B, 0, c * d + r, m))
        for k in range(total - warm, total):
            c, m = unit(k, True)
            prog.append(Action(Op.B, 0, c * d + r, m))
        progs.append(prog)
    return Schedule("interleaved", Placement.loop(d, v), (0,) * n, tuple(map(tuple, progs)),
                    params={"stages": d, "micro_batches": n, "chunks": v})


@register("zb-h1", "Zero Bubble H1: 1F1B with B split into I and W, W deferred to fill the "
                   "bubbles; D-1 bubbles with F=I=W, peak D activations on every rank")
def zb_h1(stages: int, micro_batches: int) -> Schedule:
    """Rank r runs 1F1B with I in place of B and defers its W's by r micro-batches.

    The deferred W's fill the cool-down, which 1F1B spends waiting for backwards; every rank
    then holds at most (D - r) + r = D activations (1F1B's peak, on all ranks).
    """
    _check(stages, micro_batches)
    d, n = stages, micro_batches
    progs = []
    for r in range(d):
        warm = min(d - r - 1, n)
        prog = [Action(Op.F, 0, r, m) for m in range(warm)]
        done_w = 0
        for k in range(n):
            if warm + k < n:
                prog.append(Action(Op.F, 0, r, warm + k))
            prog.append(Action(Op.I, 0, r, k))
            if k >= r:
                prog.append(Action(Op.W, 0, r, done_w))
                done_w += 1
        prog += [Action(Op.W, 0, r, m) for m in range(done_w, n)]
        progs.append(prog)
    return _linear("zb-h1", d, n, progs)
