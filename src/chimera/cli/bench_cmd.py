"""`chimera bench`: our runtime against torch.distributed.pipelining on this machine."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from chimera.bench import prices
from chimera.bench.rows import BenchConfig, select_rows
from chimera.cli.common import UsageError, check_output, positive_int

# out/ of the current folder: from the repo root, benchmarks/results holds the committed
# figures the README quotes, regenerated only on purpose (--out benchmarks/results)
DEFAULT_OUT = "out"


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "bench", help="time every schedule, ours and torch.distributed.pipelining's, side by side",
        description="Train the same model on the same mini-batches with one process (1 and 2 "
                    "threads), with our runtime under every runnable schedule, and with "
                    "torch.distributed.pipelining's schedules on the same stage modules; rows run "
                    "interleaved in time (one step of each per round) so machine noise hits all "
                    "alike. Prints a table (or --json) and writes JSON, markdown and a PNG chart.")
    p.add_argument("--quick", action="store_true", help="1 warm-up round and the median of 5 "
                   "(about 10 minutes on 2 cores)")
    p.add_argument("--json", action="store_true", help="print one JSON object {config, results}")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"folder for bench.json / bench.md / bench.png (default: {DEFAULT_OUT})")
    p.add_argument("--model", default="gpt2-bench", help="model preset (default: gpt2-bench)")
    p.add_argument("--stages", "-D", type=positive_int, default=2, help="ranks D (default: 2)")
    p.add_argument("--micro-batches", "-N", type=positive_int, default=8, help="N (default: 8)")
    p.add_argument("--micro-batch-size", "-B", type=positive_int, default=2, help="B (default: 2)")
    p.add_argument("--steps", type=positive_int, help="measured rounds (default: 9, --quick: 5)")
    p.add_argument("--warmup", type=int, help="warm-up rounds (default: 2, --quick: 1)")
    p.add_argument("--rows", metavar="IDS", help="comma-separated rows or prefixes to run, e.g. "
                   "single,chimera:chimera,torch (default: all)")
    p.add_argument("--no-memory", action="store_true",
                   help="skip the peak-RSS pass (one fresh process group per row)")
    p.add_argument("--emulate", metavar="F:I:W",
                   help="accelerator-like stages instead of the model: each D-th of the model "
                        "waits F, I and W milliseconds per micro-batch (or F:B, B split evenly) "
                        "as a host waits for a GPU, and carries small real tensors; every row is "
                        "printed beside its simulated step time, and floor rows (each of our "
                        "programs through the same runtime on null-compute stages, one wait per "
                        "action: what the machine and the executor cost, without the model or "
                        "the API's step) beside ours. Writes bench-emulated-D*-N*.* "
                        "and one Perfetto trace per row. Measures the schedule and the runtime "
                        "around it, not kernels or memory bandwidth")
    p.add_argument("--activation-mb", type=float, default=1.0, metavar="MB",
                   help="--emulate: activation each stage keeps per micro-batch until its "
                        "backward (MiB; peak activations are reported per rank) (default: 1)")
    p.add_argument("--spin", action="store_true",
                   help="--emulate: busy-wait instead of sleeping, so each rank's host stays "
                        "warm as a spinning device synchronize keeps it (a host woken from a "
                        "sleep runs its next code cold, see benchmarks/wake_cost.py); needs a "
                        "core per rank (-D at most the machine's cores). Writes "
                        "bench-emulated-D*-N*-spin.*")
    g = p.add_argument_group("--emulate: what the placement costs and saves, priced alike on "
                             "every row (ours and torch's) and in every simulated column")
    g.add_argument("--head", type=float, default=1.0, metavar="X",
                   help="the last D-th of the model costs X D-ths: its last layer stands for "
                        "the LM head (default: 1)")
    g.add_argument("--embed", type=float, default=1.0, metavar="X",
                   help="the first D-th likewise: its first layer stands for the embedding "
                        "(default: 1)")
    g.add_argument("--head-params", type=float, default=1.0, metavar="X",
                   help="the last D-th's gradients are X D-ths of the model's (the LM head's "
                        "parameters, carried by its last layer): its allreduce takes X times "
                        "--allreduce-ms (default: 1)")
    g.add_argument("--embed-params", type=float, default=1.0, metavar="X",
                   help="the first D-th's gradients likewise (the embedding's) (default: 1)")
    g.add_argument("--layers-per-stage", type=positive_int, default=2, metavar="K",
                   help="layers per D-th of the model (default: 2; a cut by cost needs a few)")
    g.add_argument("--partition", choices=("layers", "cost"), default="layers",
                   help="layers: the same layer count on every stage of each placement; cost: "
                        "each placement cut for its own ranks, the busiest rank doing least "
                        "(default: layers)")
    g.add_argument("--link-ms", type=float, default=0.0, metavar="MS",
                   help="each p2p hop is delivered MS later (default: 0)")
    g.add_argument("--allreduce-ms", type=float, default=0.0, metavar="MS",
                   help="the gradient allreduce of a D-th of the model takes MS (its bytes "
                        "over the link): Chimera's replica allreduce, and with --data-parallel "
                        "every schedule's (default: 0)")
    g.add_argument("--shard-optimizer", action="store_true",
                   help="also run our rows with the optimizer sharded over each stage's group "
                        "(ZeRO-1: a reduce-scatter after the stage's last backward, an "
                        "all-gather before its first forward of the next step, each priced at "
                        "half of --allreduce-ms, as a GPU run issues them), where a stage has "
                        "a group: Chimera's placement, or any with --data-parallel, where "
                        "torch's rows get their FSDP-like counterpart too")
    g.add_argument("--data-parallel", "-W", type=positive_int, default=1, metavar="W",
                   help="W copies of every row's pipeline on W*D ranks, each on its own "
                        "mini-batch share: every schedule reduces its gradients over the "
                        "copies (ours over each stage's replica group, 2W ranks for Chimera's; "
                        "torch's at its REDUCE_GRAD, after a stage's last backward, over the "
                        "copies of its pipeline rank), priced by --allreduce-ms (default: 1)")
    p.set_defaults(func=cmd_bench)


PRICE_FLAGS = prices.FLAGS


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    kw = dict(model=args.model, stages=args.stages, micro_batches=args.micro_batches,
              micro_batch_size=args.micro_batch_size, memory=not (args.no_memory or args.emulate),
              emulate=args.emulate, activation_mb=args.activation_mb, spin=args.spin,
              rows=tuple(r.strip() for r in args.rows.split(",") if r.strip()) if args.rows else None,
              extra={"command": _command(args)}, shard_optimizer=args.shard_optimizer,
              **{key: getattr(args, key) for _, key, _ in PRICE_FLAGS})
    if args.steps is not None:
        kw["steps"] = args.steps
    if args.warmup is not None:
        kw["warmup"] = args.warmup
    return BenchConfig.quick_config(**kw) if args.quick else BenchConfig(**kw)


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run (options left at their default omitted)."""
    words = ["chimera", "bench"] + (["--quick"] if args.quick else [])
    for flag, value, default in (("--model", args.model, "gpt2-bench"), ("-D", args.stages, 2),
                                 ("-N", args.micro_batches, 8), ("-B", args.micro_batch_size, 2),
                                 ("--steps", args.steps, None), ("--warmup", args.warmup, None),
                                 ("--rows", args.rows, None), ("--emulate", args.emulate, None),
                                 ("--activation-mb", args.activation_mb, 1.0),
                                 *((flag, getattr(args, key), d) for flag, key, d in PRICE_FLAGS)):
        if value != default:
            words += [flag, str(value)]
    return " ".join(words + (["--no-memory"] if args.no_memory else [])
                    + (["--spin"] if args.spin else [])
                    + (["--shard-optimizer"] if args.shard_optimizer else []))


def _stem(cfg: BenchConfig) -> str:
    if not cfg.emulate:
        return "bench"
    return (f"bench-emulated-D{cfg.stages}-N{cfg.micro_batches}" + prices.tag(cfg)
            + ("-spin" if cfg.spin else ""))


def _check_out(out: str, stem: str) -> None:
    check_output(out, "--out", directory=True)
    for ext in ("json", "md", "png"):
        check_output(os.path.join(out, f"{stem}.{ext}"), "--out")


def cmd_bench(args: argparse.Namespace) -> int:
    # torch: imported when the command runs, so that every other command starts without it
    from chimera.bench import report
    from chimera.bench.harness import measure
    from chimera.models import get_config

    cfg = config_from_args(args)
    cores = os.cpu_count() or 1
    if cfg.spin and cfg.world > cores:
        raise UsageError(f"--spin busy-waits on a core per rank: {cfg.world} ranks on {cores} "
                         "cores would starve the ranks (sleeping waits: leave out --spin)")
    if not cfg.emulate:
        get_config(cfg.model)  # unknown model: one line, exit 2, before any process starts
    rows = select_rows(cfg)
    if not rows:
        raise UsageError("no rows to run (--rows selects none); the results in "
                         f"{args.out} are left as they are")
    _check_out(args.out, _stem(cfg))
    started, load = time.time(), os.getloadavg()
    raw = measure(cfg, rows)
    if len(raw["failed"]) == len(rows):
        print(f"chimera bench: every row failed ({', '.join(raw['failed'])}); nothing written "
              f"to {args.out}", file=sys.stderr)
        return 1
    load = (load, os.getloadavg())
    if cfg.emulate:
        from chimera.bench import emulated_report

        data = emulated_report.assemble(cfg, rows, raw, started, load)
        paths = emulated_report.save(data, raw, rows, args.out, _stem(cfg))
        text = emulated_report.markdown(data)
    else:
        data = report.assemble(cfg, rows, raw, started, load)
        paths = report.save(data, args.out)
        text = report.markdown(data)
    if args.json:
        print(json.dumps(data))
    else:
        print(text)
        print("wrote " + ", ".join(paths))
    return 0
