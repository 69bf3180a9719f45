"""`chimera schedules | show | simulate | demo`: look at schedules without running them."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os

from chimera.cli.common import (add_schedule_options, check_output, nonneg_float, positive_int,
                                schedule_from_args, scheme_options_from_args)
from chimera.cli.measured import add_measured_options, cmd_replay, profile_cost
from chimera.theory.bounds import schedule_bound
from chimera.errors import UserError
from chimera.theory.formulas import closed_form
from chimera.schedules import schemes
from chimera.sim import CostModel, Timeline, simulate
from chimera.theory.tables import scheme_table
from chimera.viz import render_grid, save_gantt_png, save_trace


def add_parsers(sub) -> None:
    p = sub.add_parser("schedules", help="list the schemes with one-line descriptions",
                       description="List every registered schedule generator.")
    p.set_defaults(func=cmd_schedules)

    p = sub.add_parser("show", help="draw a schedule as a rank-by-time grid (and PNG / trace)",
                       description="Simulate a schedule in unit time and draw it like the paper's "
                                   "figures: one row per rank, one column per time unit.")
    add_schedule_options(p)
    p.add_argument("--tensor-parallel", "-T", type=positive_int, default=1, metavar="T",
                   help="tensor-parallel ranks per pipeline rank: the NCCL rendezvous check "
                        "replays the order with their layers' collectives inside every F, B "
                        "and I (default: 1)")
    add_cost_options(p)
    p.add_argument("--png", metavar="FILE", help="also write a Gantt chart PNG")
    p.add_argument("--trace", metavar="FILE", help="also write a Chrome/Perfetto trace JSON")
    p.add_argument("--programs", action="store_true",
                   help="print each rank's lowered program (actions in order) as text")
    p.add_argument("--color", action="store_true", help="ANSI colours per pipe")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("simulate", help="simulate a schedule: makespan, bubbles, memory per rank",
                       description="Run a schedule through the event simulator with a cost model.")
    add_schedule_options(p)
    add_cost_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--bound", action="store_true",
                   help="also report the lower bound of makespan and bubble for this placement and "
                        "these costs (no schedule on the placement can beat it)")
    add_measured_options(p)
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("demo", help="the main job on a built-in default (what `make demo` runs)",
                       description="Show Chimera's D=4 schedule and compare every scheme in simulation.")
    p.add_argument("--out", default="out", help="folder for pictures (default: out)")
    p.set_defaults(func=cmd_demo)


def add_cost_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cost model")
    g.add_argument("--cost", default="1:1", metavar="F:B|F:I:W",
                   help="unit times per micro-batch and D-th of the model, e.g. 1:1, 1:2, 1:1:1 "
                        "(default: 1:1)")
    g.add_argument("--p2p", type=nonneg_float, default=0.0, metavar="T",
                   help="time of one p2p hop (default: 0)")
    g.add_argument("--allreduce", type=nonneg_float, default=0.0, metavar="T",
                   help="time of the gradient allreduce of a D-th of the model (a stage of an "
                        "S > D cut pays D/S of it; a rank once per D-th it holds; default: 0)")
    g.add_argument("--no-overlap", action="store_true",
                   help="allreduce blocks compute instead of overlapping it")
    g.add_argument("--data-parallel", "-W", type=positive_int, default=1,
                   help="data-parallel width W: replicas in each stage's allreduce (default: 1)")
    g.add_argument("--optimizer", type=nonneg_float, default=0.0, metavar="T",
                   help="time of one replica's optimizer step for a D-th of the model; a rank "
                        "runs one per replica it holds, after its allreduces (default: 0; with "
                        "--profile, its measured optimizer_s_per_byte)")
    g.add_argument("--w-keeps", type=_share, default=1.0, metavar="SHARE",
                   help="share of a micro-batch's activations W still needs after I (I frees the "
                        "rest; default: 1, what our runtime and torch's keep for W)")
    g.add_argument("--shard-optimizer", action="store_true",
                   help="ZeRO-1: each replica updates 1/(its stage's replicas x W) of the stage")


def _share(text: str) -> float:
    value = nonneg_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a share in [0, 1], got {text!r}")
    return value


def cost_from_args(args: argparse.Namespace) -> CostModel:
    base = CostModel.parse(args.cost)
    return CostModel(f=base.f, b=base.b, i=base.i, w=base.w, p2p_time=args.p2p,
                     reduce=(args.allreduce,), overlap_allreduce=not args.no_overlap,
                     data_parallel=args.data_parallel, optimizer=(args.optimizer,),
                     shard_optimizer=args.shard_optimizer, w_keeps=args.w_keeps)


def cmd_schedules(args: argparse.Namespace) -> int:
    width = max(len(s.name) for s in schemes())
    for s in schemes():
        opts = f"  [options: {', '.join(s.options)}]" if s.options else ""
        print(f"{s.name:<{width}}  {s.description}{opts}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    check_output(args.png, "--png")
    check_output(args.trace, "--trace")
    schedule = schedule_from_args(args)
    timeline = simulate(schedule, cost_from_args(args))
    print(_headline(timeline))
    print(render_grid(timeline, color=args.color))
    if args.programs:
        print(schedule.to_text())
    _write_pictures(timeline, args.png, args.trace)
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    if args.from_trace:
        return cmd_replay(args)
    if args.profile and args.optimizer:
        raise UserError("--optimizer with --profile: the profile's measured optimizer_s_per_byte "
                        "prices the step; give one of them")
    schedule = schedule_from_args(args)
    cost = profile_cost(args, schedule) if args.profile else cost_from_args(args)
    timeline = simulate(schedule, cost)
    if not math.isfinite(timeline.makespan):  # each cost finite, their sum not: never a result
        raise UserError(f"the simulated makespan is {timeline.makespan}: the costs given add up "
                        "beyond a float; give times in seconds of a real run")
    result = timeline_summary(timeline)
    if args.bound:
        result["bound"] = _bound_summary(schedule, cost)
    if args.json:
        print(json.dumps(result))
        return 0
    print(_headline(timeline))
    print(f"{'rank':>4}  {'busy':>8}  {'peak act (Ma)':>13}  {'weights (Mθ)':>12}")
    for r in result["ranks"]:
        print(f"{r['rank']:>4}  {r['busy']:>8.2f}  {r['peak_activations']:>13.2f}  {r['weights']:>12.2f}")
    n = schedule.params.get("micro_batches", len(schedule.micro_pipe))  # halving runs 2N halves
    form = closed_form(schedule.name, schedule.ranks, n, **scheme_options_from_args(args, args.schedule))
    if form and form.bubble is not None and args.cost == form.cost:
        print(f"closed form: bubble {form.bubble_text} = {form.bubble:.4f}")
    if args.bound:
        b = result["bound"]
        print(f"lower bound: makespan {b['makespan']:g}, bubble {b['bubble']:.1%} (rank {b['rank']}: "
              f"first input at {b['head']:g}, {b['work']:g} of work, tail {b['tail']:g})")
    return 0


def _bound_summary(schedule, cost: CostModel) -> dict:
    return dataclasses.asdict(schedule_bound(schedule, cost))


def timeline_summary(timeline: Timeline) -> dict:
    s = timeline.schedule
    return {
        "schedule": s.name,
        "stages": s.ranks,
        "micro_batches": s.params.get("micro_batches", s.micro_batches),
        "params": s.params,
        "makespan": timeline.makespan,
        "bubble_ratio": timeline.bubble_ratio,
        "ranks": [{"rank": r.rank, "busy": r.busy, "peak_activations": r.peak_activations,
                   "weights": r.weights} for r in timeline.ranks],
    }


def _headline(t: Timeline) -> str:
    s = t.schedule
    opts = ", ".join(f"{k}={v}" for k, v in s.params.items() if k not in ("stages", "micro_batches"))
    acts = [r.peak_activations for r in t.ranks]
    return (f"{s.name} D={s.ranks} N={s.params.get('micro_batches', s.micro_batches)}"
            f"{' (' + opts + ')' if opts else ''}: makespan {t.makespan:g}, bubble ratio "
            f"{t.bubble_ratio:.1%}, activations {min(acts):g}..{max(acts):g} Ma, "
            f"weights {max(r.weights for r in t.ranks):g} Mθ per rank")


def _write_pictures(timeline: Timeline, png: str | None, trace: str | None,
                    quiet: bool = False) -> None:
    if png:
        os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
        save_gantt_png(timeline, png)
        if not quiet:
            print(f"wrote {png}")
    if trace:
        os.makedirs(os.path.dirname(os.path.abspath(trace)), exist_ok=True)
        save_trace(timeline, trace)
        if not quiet:
            print(f"wrote {trace}")


def cmd_demo(args: argparse.Namespace) -> int:
    png = os.path.join(args.out, "chimera-D4-N4.png")
    cmd_show(_parse(["show", "--stages", "4", "--micro-batches", "4", "--png", png]))
    print()
    print(scheme_table(8, 16))
    return 0


def _parse(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed as this module's commands parse it (defaults filled in)."""
    parser = argparse.ArgumentParser(prog="chimera")
    add_parsers(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)
