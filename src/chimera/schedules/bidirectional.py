"""Bidirectional schedules on the Chimera placement: Chimera itself and GEMS."""

from __future__ import annotations

from typing import Callable

from chimera.ir import Op, OpTimes, Placement, Schedule, ScheduleError
from chimera.schedules.chimera_slots import slot_programs
from chimera.schedules.list_play import Dag, Play, Window, build_dag
from chimera.schedules.registry import Option, register

STRATEGIES = ("direct", "doubling", "halving")
# Q: chimera-zb takes the same option (one flag, --pipes, serves both)
PIPES = Option("pipes", int, "number of pipelines Q = 2k", short="-Q", symbol="Q", cells=True,
               search=lambda depth, layers: [q for q in range(2, depth + 1, 2) if depth % q == 0])
STRATEGY = Option("strategy", str, "the order with N > D: direct concatenation, forward doubling, or "
                  "backward halving", choices=STRATEGIES, search=lambda depth, layers: list(STRATEGIES),
                  bench=("doubling",))  # the paper's forward doubling, as its own code orders it


def chimera_micro_pipes(stages: int, micro_batches: int, pipes: int) -> tuple[int, ...]:
    """Pipe of each micro-batch: each unit of D micro-batches is cut into Q equal runs.

    In the paper's D=4 figure micro-batches 0, 1 go down and 2, 3 go up. When N is not a
    multiple of D the last, partial unit is cut the same way (as evenly as possible).
    """
    out = []
    for start in range(0, micro_batches, stages):
        size = min(stages, micro_batches - start)
        out += [j * pipes // size for j in range(size)]
    return tuple(out)


@register("chimera", "Chimera (Li & Hoefler SC'21): Q=2k pipelines in opposite directions over the "
                     "same ranks; D-2 bubbles per unit of N=D; strategy direct|doubling|halving",
          options=(PIPES, STRATEGY))
def chimera(stages: int, micro_batches: int, pipes: int = 2, strategy: str = "direct") -> Schedule:
    """Chimera on D ranks with N micro-batches.

    With two pipes the order is the official slot rule (:mod:`chimera.schedules.chimera_slots`,
    the loop of the paper's own code); with Q > 2, for which that code has no loop, a greedy
    play merges the pipes' 1F1B orders (:func:`_more_pipes`).

    - ``direct``: units of D micro-batches concatenated; the next unit's first forwards fill
      the previous unit's tail. With F = B this keeps D-2 bubbles for any N = k*D. N that is
      not a multiple of D gets a partial last unit (more bubbles; the simulator says how many).
    - ``doubling``: two micro-batches share each forward slot, so with B = 2F a forward slot
      is as long as a backward slot; holds twice the activations (pair it with recompute).
      Units of 2D micro-batches chain with no gap. Needs N a multiple of 2Q.
    - ``halving``: each micro-batch is split in two halves (``micro_scale = 0.5``, 2N schedule
      micro-batches) run in the doubling shape: the same balance without recomputation.
    """
    if strategy not in STRATEGIES:
        raise ScheduleError(f"unknown chimera strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    placement = Placement.chimera(stages, pipes)  # validates D even, Q even, Q | D
    scale, n = (0.5, micro_batches * 2) if strategy == "halving" else (1.0, micro_batches)
    doubled = strategy != "direct"
    if n % (pipes * (2 if doubled else 1)):
        raise ScheduleError(f"chimera {strategy} with {pipes} pipes needs micro-batches to be a "
                            f"multiple of {pipes * (2 if doubled and scale == 1 else 1)}, got {micro_batches}")
    group = 2 if doubled else 1  # micro-batches per forward slot
    micro_pipe = chimera_micro_pipes(stages, n // group, pipes)
    micro_pipe = tuple(p for p in micro_pipe for _ in range(group))  # a slot's micro-batches share a pipe
    if pipes == 2:
        progs = slot_programs(stages, micro_pipe, group)
    else:
        progs = _more_pipes(placement, micro_pipe, group)
    return Schedule("chimera", placement, micro_pipe, tuple(map(tuple, progs)), scale,
                    params={"stages": stages, "micro_batches": micro_batches, "pipes": pipes,
                            "strategy": strategy})


def _more_pipes(placement: Placement, micro_pipe: tuple[int, ...], group: int) -> list[list]:
    """Q > 2 pipes (no slot rule in the paper's code): each pipe runs 1F1B with a window of its
    unit's micro-batches, the pipes merged per rank by a greedy play of equal-length slots."""
    stages, per_unit = placement.stages, group * placement.stages // placement.pipes
    groups = [tuple(range(m, m + group)) for m in range(0, len(micro_pipe), group)]
    dag = build_dag(placement, micro_pipe, OpTimes.uniform(stages, 1, group), split_backward=False,
                    groups=groups)
    return _merge(dag, stages, lambda p, s: min(group * (stages - s), per_unit))


def _merge(dag: Dag, ranks: int, window: Callable[[int, int], int]) -> list[list]:
    """Play the 1F1B pipes with ``window(pipe, stage)`` micro-batches in flight per replica.
    1F1B on each pipe: backwards first (they free memory and unblock the previous stage), then
    the forward nearest to its turn (highest stage), which keeps the merge conflict-free."""
    prio = [(0 if op is Op.B else 1, -stage, micro) for op, stage, micro in zip(dag.op, dag.stage, dag.micro)]
    return dag.programs(Play(dag, ranks, (prio, prio), Window(dag, window)).run().order)


@register("gems", "GEMS: two model replicas in opposite directions, one micro-batch in flight "
                  "per replica; little memory, many bubbles")
def gems(stages: int, micro_batches: int) -> Schedule:
    placement = Placement.chimera(stages, 2)
    micro_pipe = tuple(m % 2 for m in range(micro_batches))
    dag = build_dag(placement, micro_pipe, OpTimes.uniform(stages, 1, 1), split_backward=False)
    progs = _merge(dag, stages, lambda p, s: 1)
    return Schedule("gems", placement, micro_pipe, tuple(map(tuple, progs)),
                    params={"stages": stages, "micro_batches": micro_batches})
