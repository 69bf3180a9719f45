"""`chimera plan`: pick W, D, B, recomputation and scheme for a model on a machine."""

from __future__ import annotations

import argparse
import json

from chimera.cli.common import positive_float, positive_int
from chimera.modelcfg import PRESETS, get_config
from chimera.plan import Planner, Workload, get_hardware, load_profile
from chimera.plan.hardware import PRESETS as HARDWARE
from chimera.plan.report import explain, table, to_json
from chimera.plan.search import gc_paused


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "plan", help="choose W, D, B, recomputation and scheme for a model on P devices",
        description="Enumerate every data-parallel width W and depth D with W*D = P, micro-batch "
                    "size B (N = G / (W*B) micro-batches), recomputation on/off and every "
                    "registered scheme with its options; simulate what may win (exact branch and "
                    "bound), drop what does not fit in memory, and print the fastest.")
    p.add_argument("--model", "-m", required=True, metavar="NAME",
                   help=f"model preset: {', '.join(PRESETS)}")
    p.add_argument("--gpus", "-P", required=True, type=positive_int, help="number of devices P")
    p.add_argument("--global-batch", "-G", required=True, type=positive_int,
                   help="sequences per iteration (the mini-batch), G = W * N * B")
    p.add_argument("--hardware", required=True, metavar="NAME",
                   help=f"machine preset: {', '.join(HARDWARE)} (p100 is the paper's Piz Daint)")
    p.add_argument("--memory", type=positive_float, metavar="GIB",
                   help="usable memory per device in GiB (default: the preset's, less a reserve)")
    p.add_argument("--profile", metavar="FILE",
                   help="measured per-layer costs and links (chimera.profile/1 JSON, as written "
                        "by `chimera profile`) instead of the preset's FLOP model")
    p.add_argument("--schemes", metavar="LIST",
                   help="comma-separated schemes to consider (default: all registered)")
    p.add_argument("--recompute", choices=("both", "on", "off"), default="both",
                   help="activation recomputation: try both (default), always, never")
    p.add_argument("--shard-optimizer", choices=("off", "on", "both"), default="off",
                   help="AdamW state split over each stage's replicas (chimera train "
                        "--shard-optimizer): off (default), on, or try both")
    p.add_argument("--vocab-size", type=positive_int, help="override the preset's vocabulary")
    p.add_argument("--dropout", type=float, help="override the preset's dropout (memory model)")
    p.add_argument("--top", "-k", type=positive_int, default=10, help="configurations to list")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--explain", action="store_true", help="say why the winner wins")
    p.set_defaults(func=cmd_plan)


def workload_from_args(args: argparse.Namespace):
    overrides = {k: v for k, v in (("vocab_size", args.vocab_size), ("dropout", args.dropout))
                 if v is not None}
    cfg = get_config(args.model, **overrides)
    profile = load_profile(args.profile) if args.profile else None
    return Workload(cfg, args.gpus, args.global_batch, get_hardware(args.hardware),
                    memory_gib=args.memory, profile=profile, name=args.model)


def cmd_plan(args: argparse.Namespace) -> int:
    with gc_paused():  # the planner is gone when it resumes (see gc_paused)
        return _plan(args)


def _plan(args: argparse.Namespace) -> int:
    work = workload_from_args(args)
    names = [s.strip() for s in args.schemes.split(",") if s.strip()] if args.schemes else None
    recompute = {"both": (False, True), "on": (True,), "off": (False,)}[args.recompute]
    shard = {"both": (False, True), "on": (True,), "off": (False,)}[args.shard_optimizer]
    planner = Planner(work, names, recompute, shard=shard)
    result = planner.run(args.top)
    if args.json:
        data = to_json(result)
        if args.explain:
            data["explain"] = explain(planner, result).splitlines()
        print(json.dumps(data, indent=1))
        return 0
    print(table(result))
    if args.explain:
        print()
        print(explain(planner, result))
    return 0
