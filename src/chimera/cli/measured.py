"""`chimera simulate --profile FILE` and `--from-trace FILE`: the simulator on measured costs."""

from __future__ import annotations

import argparse
import json

from chimera.sim.replay import CLOCKS, replay
from chimera.sim import CostModel
from chimera.sim.profile import cost_from_profile, load_profile


def add_measured_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("measured costs")
    g.add_argument("--profile", metavar="FILE",
                   help="price the schedule with a cost profile of this machine (`chimera profile`; "
                        "the chimera.profile/1 JSON `chimera plan` reads) instead of --cost, --p2p "
                        "and --allreduce; times are seconds per micro-batch of the profile's size")
    g.add_argument("--from-trace", metavar="FILE",
                   help="replay the step recorded in a trace of a real run (`chimera train "
                        "--trace FILE`) with the costs measured in it, and compare; the schedule "
                        "comes from the trace, so the schedule options are ignored")
    g.add_argument("--clock", choices=CLOCKS, default="wall",
                   help="--from-trace: price compute by wall time (default) or by thread CPU time: "
                        "what dedicated cores would give when the run had more ranks than cores")


def profile_cost(args: argparse.Namespace, schedule) -> CostModel:
    return cost_from_profile(load_profile(args.profile), schedule, data_parallel=args.data_parallel,
                             overlap=not args.no_overlap, shard_optimizer=args.shard_optimizer)


def cmd_replay(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile) if args.profile else None
    r = replay(args.from_trace, args.clock, profile)
    if args.json:
        print(json.dumps(r.to_json()))
        return 0
    s, c = r.schedule, r.cost
    print(f"replay of {args.from_trace}: {s.name} D={s.ranks} N={s.params.get('micro_batches', s.micro_batches)}, "
          f"costs measured in the trace ({r.clock} clock)")
    present = {a.op.value for prog in s.programs for a in prog}
    for name, values in (("F", c.f), ("B", c.b), ("I", c.i), ("W", c.w)):
        if name in present:
            print(f"  {name} per stage (ms): " + " ".join(f"{v * 1e3:.1f}" for v in values))
    print(f"  p2p {c.p2p_time * 1e3:.2f} ms ({r.sources['p2p']})")
    print(f"  allreduce {c.allreduce_time * 1e3:.2f} ms ({r.sources['allreduce']})")
    print(f"  predicted makespan {r.predicted.makespan:.4f} s, measured {r.measured_makespan:.4f} s "
          f"({_diff(r.predicted.makespan, r.measured_makespan)}); bubble ratio {r.predicted.bubble_ratio:.1%}")
    if r.predicted_step_s is not None:
        print(f"  predicted step {r.predicted_step_s:.4f} s, measured {r.measured_step_s:.4f} s "
              f"({_diff(r.predicted_step_s, r.measured_step_s)}); {r.outside_s:.4f} s of it measured "
              "outside the schedule (optimizer, clipping, loss)")
    return 0


def _diff(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.1%}" if measured > 0 else "n/a"
