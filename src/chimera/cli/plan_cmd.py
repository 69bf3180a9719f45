"""`chimera plan`: pick W, D, T, B, recomputation and scheme for a model on a machine."""

from __future__ import annotations

import argparse
import json

from chimera.cli.common import positive_float, positive_int
from chimera.ir import ScheduleError
from chimera.modelcfg import PRESETS, SIZED_PRESETS, get_sized_config
from chimera.plan import Planner, PlanError, Workload, get_hardware, load_profile
from chimera.plan.hardware import PRESETS as HARDWARE
from chimera.plan.tensor import tensor_sizes
from chimera.plan.report import explain, table, to_json
from chimera.plan.search import gc_paused


def add_parsers(sub) -> None:
    p = sub.add_parser(
        "plan", help="choose W, D, T, B, recomputation and scheme for a model on P devices",
        description="Enumerate every data-parallel width W and depth D with W*D = P (W*D*T = P "
                    "with tensor parallelism: --gpus-per-node), micro-batch size B (N = G / (W*B) "
                    "micro-batches), recomputation on/off and every registered scheme with its "
                    "options; simulate what may win (exact branch and bound), drop what does not "
                    "fit in memory, and print the fastest.")
    p.add_argument("--model", "-m", required=True, metavar="NAME",
                   help=f"model preset: {', '.join(PRESETS)}; planner only: {', '.join(SIZED_PRESETS)}")
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
                   help="comma-separated schemes to consider (default: all registered, and "
                        "torch's; torch names them all, torch:NAME one of them)")
    p.add_argument("--recompute", choices=("both", "on", "off"), default="both",
                   help="activation recomputation: try both (default), always, never")
    p.add_argument("--shard-optimizer", choices=("off", "on", "both"), default="off",
                   help="AdamW state split over each stage's replicas (chimera train "
                        "--shard-optimizer): off (default), on, or try both")
    p.add_argument("--gpus-per-node", type=positive_int, metavar="N",
                   help="GPUs per node: search tensor parallelism T too (T divides N, P and the "
                        "model's heads, key/value heads and MLP width; TP stays inside a node; not "
                        "with --profile, measured at T = 1). Default: T = 1 only, nodes as the "
                        "hardware preset has them")
    p.add_argument("--tensor-parallel", "-T", metavar="LIST",
                   help="comma-separated T values to search instead (e.g. 4 or 1,2,4)")
    p.add_argument("--vocab-size", type=positive_int, help="override the preset's vocabulary")
    p.add_argument("--dropout", type=float, help="override the preset's dropout (memory model)")
    p.add_argument("--top", "-k", type=positive_int, default=10, help="configurations to list")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--explain", action="store_true", help="say why the winner wins")
    p.add_argument("--no-torch", action="store_true",
                   help="leave out torch.distributed.pipelining's schedules (ranked beside ours "
                        "by default, each in its own order, as torch:NAME: references you could "
                        "run instead; needs torch)")
    p.set_defaults(func=cmd_plan)


def workload_from_args(args: argparse.Namespace):
    overrides = {k: v for k, v in (("vocab_size", args.vocab_size), ("dropout", args.dropout))
                 if v is not None}
    cfg = get_sized_config(args.model, **overrides)
    profile = load_profile(args.profile) if args.profile else None
    hw, node = get_hardware(args.hardware), args.gpus_per_node
    return Workload(cfg, args.gpus, args.global_batch, hw, memory_gib=args.memory, profile=profile,
                    name=args.model, tensor_parallel=_tensor_sizes(args, cfg, node or hw.devices_per_node),
                    gpus_per_node=node)


def _tensor_sizes(args: argparse.Namespace, cfg, node: int) -> tuple[int, ...]:
    """--tensor-parallel as given; else every T the model and node allow with --gpus-per-node
    (none with a profile: it was measured at T = 1); else T = 1."""
    if args.tensor_parallel:
        try:
            return tuple(int(x) for x in args.tensor_parallel.split(",") if x.strip())
        except ValueError:
            raise PlanError(f"--tensor-parallel must be comma-separated integers, got "
                            f"{args.tensor_parallel!r}") from None
    if args.gpus_per_node and not args.profile:
        return tensor_sizes(cfg, args.gpus, node)
    return (1,)


def cmd_plan(args: argparse.Namespace) -> int:
    with gc_paused():  # the planner is gone when it resumes (see gc_paused)
        return _plan(args)


def _plan(args: argparse.Namespace) -> int:
    work = workload_from_args(args)
    names = [s.strip() for s in args.schemes.split(",") if s.strip()] if args.schemes else None
    refs = _references(args, names)
    names = [n for n in names if not n.startswith("torch")] if names else None
    recompute = {"both": (False, True), "on": (True,), "off": (False,)}[args.recompute]
    shard = {"both": (False, True), "on": (True,), "off": (False,)}[args.shard_optimizer]
    planner = Planner(work, names, recompute, shard=shard, references=refs)
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


def _references(args: argparse.Namespace, names: list[str] | None) -> dict:
    """torch's schedules to rank beside ours: all of them by default; with --schemes only
    those it names (``torch`` for all, ``torch:NAME`` for one); none with --no-torch."""
    if args.no_torch:
        return {}
    refs = torch_references()
    if names is None or "torch" in names:
        return refs
    unknown = [n for n in names if n.startswith("torch:") and n not in refs]
    if unknown:
        raise PlanError(f"unknown torch schedule(s) {', '.join(unknown)}; known: "
                        f"{', '.join(refs) or 'none (torch is not installed)'}")
    return {n: refs[n] for n in names if n in refs}


def torch_references() -> dict:
    """``torch:NAME`` -> factory(D, N) of torch's schedule's own order (empty without torch:
    importing it is what this costs, once)."""
    try:  # torch, imported only here: every other plan and command starts without it
        from chimera.bench.rows import TORCH_SCHEDULES  # noqa: I001 (with torch_order's)
        from chimera.bench.torch_orders import torch_order  # imports torch
    except ImportError:
        return {}

    def factory(name: str):
        def make(depth: int, n: int):
            try:
                return torch_order(name, depth, n)
            except (ValueError, RuntimeError, AssertionError) as exc:  # torch refuses (D, N)
                raise ScheduleError(f"torch's {name} at D={depth} N={n}: {exc}") from exc
        return make
    return {f"torch:{name}": factory(name) for name in TORCH_SCHEDULES}
