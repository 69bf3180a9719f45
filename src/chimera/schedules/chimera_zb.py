"""chimera-zb: split backward on Chimera's bidirectional placement, ordered by time under a cap.

Chimera's merge of two 1F1B pipelines was designed for slots of equal length. Splitting each
backward into I (the input gradient the previous stage waits for) and W (the weight
gradient, which nothing waits for) gives every rank a pile of movable work; a list scheduler
driven by the cost model then fills the bubbles with it:

- Time-aware: each task has its own duration (per stage and op), a cross-rank input arrives
  one p2p hop after its producer ends, and an idle rank starts the best *ready* task.
- Activation cap: a rank holds at most ``cap`` Ma (default D, 1F1B's peak). F takes one
  micro-batch's activations, W frees them (I does not: W still needs them).
- Deadlock freedom under the cap: a rank keeps room for the reserve (at least one
  micro-batch) of every replica it holds that still has forwards to do, and the reserves of
  a rank fit under its cap. Then the oldest unfinished micro-batch of every pipe can always
  advance (its replica is empty when it arrives, since forwards of one replica run in
  micro-batch order, and room for one is always kept), so the greedy play never gets stuck.
- Priority (``rule``), measured in ``benchmarks/zero_bubble.py`` against the lower bound of
  :mod:`chimera.theory.bounds`: forwards before input gradients before weight gradients, oldest
  micro-batch first (micro-batches are dealt to the pipes in turn, ``m mod Q``, so both
  directions fill the pipeline together), except that while an arrived forward waits for
  memory a W goes first, as it frees that memory (``fiw-unblock``). Reserving room per replica
  for what 1F1B keeps in flight at its stage (``/1f1b``) keeps the far pipe flowing when p2p
  is slow. ``auto`` plays a few such variants and keeps the shortest.

The result is an order per rank; the simulator replays it (and can only be as fast or
faster than the list scheduler's own timing, since it starts every action as soon as it can).
The task graph and the play itself are in :mod:`chimera.schedules.list_play`.
"""

from __future__ import annotations

from functools import partial

from chimera.ir import Action, Op, OpTimes, Placement, Schedule, ScheduleError
from chimera.schedules.exact import refine
from chimera.schedules.bidirectional import PIPES
from chimera.schedules.list_play import EPS, Cap, Dag, Play, Rule, build_dag, first_hop, priorities
from chimera.schedules.registry import Option, register


# -- costs ----------------------------------------------------------------------------------
def op_times(cost, stages: int, ranks: int) -> OpTimes:
    """``cost``: None (F=I=W=1), ``"F:B"`` (I = W = B/2), ``"F:I:W"``, or any object with the
    :class:`chimera.sim.CostModel` method ``op_times(stages, ranks)`` (per-stage times and p2p,
    from Python). Times are per D-th of the model."""
    if cost is None:
        cost = "1:1:1"
    if isinstance(cost, str):
        parts = _parse_cost(cost)
        f, i, w = (parts[0], parts[1] / 2, parts[1] / 2) if len(parts) == 2 else parts
        size = ranks / stages
        return OpTimes.uniform(stages, f * size, (i + w) * size, i * size, w * size)
    return cost.op_times(stages, ranks)


def _parse_cost(text: str) -> tuple[float, ...]:
    try:
        parts = tuple(float(x) for x in text.split(":"))
    except ValueError:
        parts = ()
    if len(parts) not in (2, 3) or not all(0 < p < float("inf") for p in parts):
        raise ScheduleError(f"cost must be F:B or F:I:W with positive numbers, got {text!r}")
    return parts


# -- priority rules -------------------------------------------------------------------------
_OP_ORDER = {"ifw": {Op.I: 0, Op.F: 1, Op.W: 2}, "fiw": {Op.F: 0, Op.I: 1, Op.W: 2}}


def _tail(dag: Dag) -> list[float]:
    """Longest path from the start of each task to the end of the iteration (its 'bottom level')."""
    out = [0.0] * len(dag)
    for t in reversed(range(len(dag))):  # successors always have larger ids
        out[t] = dag.dur[t] + max((out[u] for u in dag.succs[t]), default=0.0)
    return out


def _by_op(order: dict, unblock: bool, d: Dag, blocked: bool, drain: int = 0) -> list[tuple]:
    """By op, then oldest micro-batch first. ``unblock``: while a forward that has arrived
    waits for memory, W (which frees it) goes first. ``drain`` (1 or -1): a rank's W's go
    by stage (shallowest or deepest first), so one of its stages has all its weight
    gradients early and its replica allreduce overlaps the rest of the work."""
    rank = {**order, Op.W: -1} if unblock and blocked else order
    return [(rank[op], drain * s, m) if drain and op is Op.W else (rank[op], m, s)
            for op, m, s in zip(d.op, d.micro, d.stage)]


def _by_stage(sign: int, d: Dag, blocked: bool) -> list[tuple]:
    """I > F > W; among forwards the shallowest (sign 1) or deepest (sign -1) stage first."""
    order = _OP_ORDER["ifw"]
    return [(order[op], sign * s if op is Op.F else 0, m) for op, m, s in zip(d.op, d.micro, d.stage)]


def _by_tail(tail: list[float], d: Dag, blocked: bool) -> list[tuple]:
    return [(-x, m) for x, m in zip(tail, d.micro)]


def make_rule(name: str, dag: Dag) -> Rule:
    """Priority keys of all tasks (least first on a rank), given whether a forward is blocked.
    ``RULE+drain`` / ``RULE+rdrain`` (RULE by op): W's by stage, shallowest / deepest first."""
    base, _, drain = name.partition("+")
    if drain in ("drain", "rdrain") and base in ("ifw", "fiw", "ifw-unblock", "fiw-unblock"):
        return partial(_by_op, _OP_ORDER[base[:3]], base.endswith("-unblock"),
                       drain=1 if drain == "drain" else -1)
    if name in ("ifw", "fiw", "ifw-unblock", "fiw-unblock"):
        return partial(_by_op, _OP_ORDER[name[:3]], name.endswith("-unblock"))
    if name in ("ifw-shallow", "ifw-deep"):
        return partial(_by_stage, 1 if name == "ifw-shallow" else -1)
    if name == "critical-path":  # HLFET: longest remaining path first
        return partial(_by_tail, _tail(dag))
    raise ScheduleError(f"unknown chimera-zb rule {name!r}; choose one of {', '.join(RULES)}")


RULES = ("ifw", "fiw", "ifw-shallow", "ifw-deep", "critical-path", "ifw-unblock", "fiw-unblock")
RESERVES = ("one", "1f1b")
# the variants `auto` plays, keeping the shortest (chosen by benchmarks/zero_bubble.py)
AUTO = ("fiw-unblock/one", "fiw-unblock/1f1b", "ifw/1f1b")
# and, where the cost model prices the stages' allreduces, these too (each drains one stage's
# W's first, so its allreduce overlaps the other stage's work)
AUTO_SYNC = ("fiw-unblock+drain/one", "fiw-unblock+rdrain/one", "fiw-unblock+drain/1f1b",
             "fiw-unblock+rdrain/1f1b")


def play(placement: Placement, micro_pipe, times: OpTimes, cap: float, variant: str = "fiw-unblock/one"
         ) -> tuple[list[list[Action]], float]:
    """List-schedule F, I, W of every micro-batch; return per-rank actions and the makespan.

    ``variant``: ``RULE`` or ``RULE/RESERVE`` with RULE in :data:`RULES` and RESERVE in
    :data:`RESERVES`: ``one`` micro-batch of room per replica, or ``1f1b``: as many as 1F1B
    keeps in flight at that stage (S - s).
    """
    _check(placement, cap, (variant,))
    dag = build_dag(placement, micro_pipe, times)
    game = _play_dag(dag, placement, first_hop(times), cap, variant)
    return dag.programs(game.order), game.makespan


def _check(placement: Placement, cap: float, variants) -> None:
    for variant in variants:
        reserve = variant.partition("/")[2]
        if reserve not in ("",) + RESERVES:
            raise ScheduleError(f"unknown chimera-zb reserve {reserve!r}; "
                                f"choose one of {', '.join(RESERVES)}")
    size = placement.ranks / placement.stages
    need = max(len(placement.held(r)) for r in range(placement.ranks)) * size
    if cap + EPS < need:
        raise ScheduleError(f"activation cap {cap:g} Ma is below {need:g} Ma, one micro-batch for "
                            f"each replica a rank holds")


def _play_dag(dag: Dag, placement: Placement, hop: float, cap: float, variant: str,
              ranked: dict | None = None) -> Play:
    """One variant's play; ``ranked`` keeps each rule's priorities for the next variants."""
    rule, _, reserve = variant.partition("/")
    ranked = {} if ranked is None else ranked
    if rule not in ranked:
        ranked[rule] = priorities(make_rule(rule, dag), dag)
    size = placement.ranks / placement.stages
    admit = (Cap(dag, cap, size, lambda pipe, stage: placement.stages - stage) if reserve == "1f1b"
             else Cap(dag, cap, size))
    return Play(dag, placement.ranks, ranked[rule], admit, hop).run()


def _best_play(dag: Dag, placement: Placement, hop: float, cap: float, variants,
               sync=None) -> tuple[float, list[list[int]], str]:
    """(makespan at ``hop``, order, variant) of the shortest play. With a hop, each variant is
    also played blind to it and priced with it: a greedy play that sees a message coming
    late fills the wait with a W and delays the input gradient that arrives during it, which
    a blind play does not (D=8 N=16 F:I:W 1:2:1, hop 0.05 F: 76.5 told against 70.8 blind;
    with a hop of a whole F the told play wins). ``sync(stage)``: the time of the stage's
    replica allreduce, when priced: each play is then timed with its allreduces after it
    (:func:`_with_syncs`)."""
    ranked: dict = {}
    timed = []
    for v in variants:
        game = _play_dag(dag, placement, hop, cap, v, ranked)  # its own timing is exact
        span = game.makespan if sync is None else _with_syncs(dag, placement, game.order, hop, sync)
        timed.append((span, game.order, v))
        if hop > 0:
            blind = _play_dag(dag, placement, 0.0, cap, v, ranked).order
            timed.append((_with_syncs(dag, placement, blind, hop, sync), blind, f"{v}/blind"))
    return min(timed, key=lambda x: x[0])


def _with_syncs(dag: Dag, placement: Placement, order: list[list[int]], hop: float, sync) -> float:
    """The play's makespan with each stage's allreduce started once every replica's last W
    has ended, a rank's allreduces one after another (as the simulator times them)."""
    ends = dag.ends(order, hop)
    span = max(ends, default=0.0)
    if sync is None:
        return span
    ready: dict[int, float] = {}
    for t, e in enumerate(ends):
        if dag.op[t] is Op.W:
            ready[dag.stage[t]] = max(ready.get(dag.stage[t], 0.0), e)
    channel = [0.0] * placement.ranks
    for at, stage in sorted((at, stage) for stage, at in ready.items()):
        members = placement.replicas(stage)
        end = max([at] + [channel[r] for r in members]) + sync(stage)
        for r in members:
            channel[r] = end
        span = max(span, end)
    return span


def _syncs_of(cost, placement: Placement):
    """``stage -> allreduce time`` from a cost model that prices them, else None."""
    price = getattr(cost, "sync", None)
    if price is None or not getattr(cost, "overlap_allreduce", True):
        return None
    group = len(placement.replicas(0)) * getattr(cost, "data_parallel", 1)
    times = [price(s, placement.stages, group, placement.ranks) for s in range(placement.stages)]
    return times.__getitem__ if any(times) else None


@register("chimera-zb", "Chimera placement with B split into I and W, list-scheduled by time under "
                        "a per-rank activation cap (default D Ma); any N",
          options=(PIPES,
                   # the unit times it is ordered for: the command's --cost (or a CostModel)
                   Option("cost", object, "unit times F:B or F:I:W", flag=False),
                   Option("cap", int, "activation memory cap per rank in Ma", metavar="MA",
                          default_text="D"),
                   Option("rule", str, "the priority rule of the list scheduler, RULE or "
                          "RULE/RESERVE; auto plays each of " + ", ".join(AUTO) + " and keeps "
                          "the shortest", metavar="RULE", choices=("auto",) + RULES + tuple(
                              f"{r}/{v}" for r in RULES for v in RESERVES)),
                   Option("exact", int, "seconds of CP-SAT refinement (needs OR-Tools; small D "
                          "and N), 0 for none", low=0, metavar="S")))
def chimera_zb(stages: int, micro_batches: int, pipes: int = 2, cost: str | None = None,
               cap: int | None = None, rule: str = "auto", exact: int = 0) -> Schedule:
    """Chimera's Q pipes (micro-batch m on pipe m mod Q), ordered by ``rule`` under ``cap``.

    ``cost``: ``"F:I:W"`` or ``"F:B"`` unit times (default ``1:1:1``), or from Python a
    :class:`chimera.sim.CostModel` (per-stage times and p2p). ``cap``: activation memory per
    rank in Ma (default D). ``rule``: a :func:`play` variant, or ``auto`` to play each of
    :data:`AUTO` and keep the shortest. ``exact``: seconds of CP-SAT refinement
    (:mod:`chimera.schedules.exact`, needs OR-Tools; small D and N), 0 for none.
    """
    if micro_batches < 1:
        raise ScheduleError(f"chimera-zb needs micro-batches >= 1, got {micro_batches}")
    placement = Placement.chimera(stages, pipes)
    micro_pipe = tuple(m % pipes for m in range(micro_batches))
    times = op_times(cost, stages, stages)
    limit = stages if cap is None else cap
    variants = AUTO if rule == "auto" else (rule,)
    _check(placement, limit, variants)
    dag = build_dag(placement, micro_pipe, times)  # the same work for every variant
    ranked: dict = {}
    sync = _syncs_of(cost, placement)
    if sync is not None and rule == "auto":
        variants = AUTO + AUTO_SYNC
    span, order, chosen = _best_play(dag, placement, first_hop(times), limit, variants, sync)
    programs = dag.programs(order)
    if exact > 0:
        refined, refined_span, _ = refine(placement, micro_pipe, times, limit, programs, exact)
        if refined_span < span:
            programs, chosen = refined, f"{chosen}+cpsat"
    return Schedule("chimera-zb", placement, micro_pipe, tuple(map(tuple, programs)),
                    params={"stages": stages, "micro_batches": micro_batches, "pipes": pipes,
                            "cost": cost if isinstance(cost, str) or cost is None else "custom",
                            "cap": limit, "rule": chosen})
