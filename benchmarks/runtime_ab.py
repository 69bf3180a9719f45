"""What each runtime change bought, on accelerator-like stages: A/B in one process group.

Each variant turns one change off again (or all of them), in the same spawned group as the
current runtime, rounds interleaved (A B C, then B C A, ...) so machine noise hits all alike:

- ``now``: the runtime as it is;
- ``sync-fingerprint``: the batch fingerprint's allreduce waited for before the first action
  (as before), not read at the end of the step;
- ``plan-posts``: receives posted where the comm plan puts them (as on NCCL), not the rest of
  the iteration's at a rank's first wait (gloo);
- ``before``: both;
- ``no-fingerprint``: no batch check at all (``Pipeline(check_batch=False)``): what the
  check itself costs;
- ``views-each-time``: a receive buffer's views made again at every unpack (as before), not
  once per buffer;
- ``autograd-api``: I, W and B through ``torch.autograd.grad``/``backward`` (as before), not
  the engine call under them;
- ``dist-p2p``: messages through ``dist.isend``/``irecv`` (as before), not the default
  group's own send and receive;
- ``host-before``: those three together (the runtime's host path before 2026-12-06).

    python benchmarks/runtime_ab.py --emulate 20:20:20 -D 4 -N 8 --schedules zb-v,1f1b,chimera-zb
    python benchmarks/runtime_ab.py -D 8 -N 16 --schedules 1f1b,zb-v --variants now,no-fingerprint

Prints medians and ratios to ``now`` and writes ``benchmarks/results/runtime_ab-D{D}-N{N}.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

VARIANTS = ("now", "sync-fingerprint", "plan-posts", "before", "no-fingerprint",
            "views-each-time", "autograd-api", "dist-p2p", "host-before")
_HOST = {"views-each-time": {"views"}, "autograd-api": {"engine"}, "dist-p2p": {"p2p"},
         "host-before": {"views", "engine", "p2p"}}
_OFF: set = set()  # the host-path changes the current variant turns off


def _patch_host_path() -> None:
    """Once: make each host-path change switchable by ``_OFF``."""
    import torch.distributed as dist

    import chimera.runtime.executor as executor
    import chimera.runtime.split_backward as sb
    import chimera.runtime.transport as transport

    if getattr(executor.Executor, "_ab_received", None) is not None:
        return
    received = executor.Executor._ab_received = executor.Executor._received

    def _received(self, recv, spec, backward):
        if "views" in _OFF:
            self._views.clear()  # nothing kept: every message's views are made again
        return received(self, recv, spec, backward)
    executor.Executor._received = _received

    engine = sb._ENGINE

    class Engine:  # the engine call, or None (the public calls) while "engine" is off
        def __bool__(self):
            return "engine" not in _OFF

        def __call__(self, *args, **kwargs):
            return engine(*args, **kwargs)
    sb._ENGINE = Engine()
    isend, irecv = transport.TorchDist.isend, transport.TorchDist.irecv

    def _isend(self, tensor, dst, tag=0, group=None):
        if "p2p" in _OFF:
            return dist.isend(tensor, dst=dst, tag=tag, group=group)
        return isend(self, tensor, dst, tag, group)

    def _irecv(self, tensor, src, tag=0, group=None):
        if "p2p" in _OFF:
            return dist.irecv(tensor, src=src, tag=tag, group=group)
        return irecv(self, tensor, src, tag, group)
    transport.TorchDist.isend, transport.TorchDist.irecv = _isend, _irecv


def _variant(name: str, pipe) -> None:
    """Switch ``pipe`` (an api.Pipeline) to variant ``name``."""
    import chimera.api as api

    _patch_host_path()
    _OFF.clear()
    _OFF.update(_HOST.get(name, ()))
    sync = name in ("sync-fingerprint", "before")
    pipe.check_batch = name != "no-fingerprint"
    pipe.runtime.executor.mailbox.post_ahead = name not in ("plan-posts", "before")
    if not hasattr(api._BatchCheck, "_ab_init"):
        api._BatchCheck._ab_init = api._BatchCheck.__init__

        def init(self, tree, runtime):
            api._BatchCheck._ab_init(self, tree, runtime)
            if api._BatchCheck.sync_now:
                self.wait()
        api._BatchCheck.__init__ = init
    api._BatchCheck.sync_now = sync


def _worker(rank: int, world: int, args, out: str) -> None:
    import torch
    import torch.distributed as dist

    from chimera.bench.emulated import EmulatedOurs
    from chimera.bench.rows import BenchConfig, Row
    from chimera.bench.start import start_together
    from chimera.models.emulated import tighten_timer_slack
    from chimera.runtime.workers import gloo_group

    cfg = BenchConfig(stages=args.stages, micro_batches=args.micro_batches, emulate=args.emulate,
                      memory=False)
    tighten_timer_slack()
    with gloo_group(rank, world, args.port, 1, 300.0):
        torch.set_num_threads(1)
        runners = {s: EmulatedOurs(cfg, Row("chimera", s), rank) for s in args.schedules}
        for r in runners.values():  # the first step probes the boundaries (makes the mailbox)
            r.step(0)
        times = {(s, v): [] for s in args.schedules for v in args.variants}
        cells = list(times)
        for rnd in range(args.warmup + args.rounds):
            for j in range(len(cells)):
                s, v = cells[(rnd + j) % len(cells)]
                _variant(v, runners[s].pipe)
                t0 = start_together()
                runners[s].step(rnd)
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if rnd >= args.warmup:
                    times[(s, v)].append(float(t))
            if rank == 0:
                print(f"round {rnd + 1}/{args.warmup + args.rounds}", file=sys.stderr, flush=True)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({f"{s}|{v}": ts for (s, v), ts in times.items()}, f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--emulate", default="20:20:20", help="F:I:W milliseconds (default 20:20:20)")
    p.add_argument("-D", "--stages", type=int, default=4)
    p.add_argument("-N", "--micro-batches", type=int, default=8)
    p.add_argument("--schedules", default="zb-v,1f1b,chimera-zb,chimera")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, 'now' first (default: all of {', '.join(VARIANTS)})")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = p.parse_args()
    args.schedules = [s for s in args.schedules.split(",") if s]
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or "now" not in args.variants:
        p.error(f"--variants: {', '.join(unknown) or 'now is missing'} (known: {', '.join(VARIANTS)})")
    from chimera.runtime import workers

    args.port = workers.free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ab.json")
        codes = workers.run(_worker, (args.stages, args, out), args.stages, grace=10.0)
        if workers.first_failure(codes) is not None:
            print("runtime_ab: a rank failed (its message is above)", file=sys.stderr)
            return 1
        with open(out) as f:
            raw = json.load(f)
    rows = []
    for s in args.schedules:
        now = statistics.median(raw[f"{s}|now"])
        for v in args.variants:
            med = statistics.median(raw[f"{s}|{v}"])
            rows.append({"schedule": s, "variant": v, "median_step_s": med, "vs_now": med / now,
                         "steps_s": raw[f"{s}|{v}"]})
    command = "python benchmarks/runtime_ab.py " + " ".join(sys.argv[1:])
    lines = [f"{command} ({time.strftime('%Y-%m-%d %H:%M')}, load average at the end: "
             f"{os.getloadavg()[0]:.1f}; min..max of the rounds in the JSON)", "",
             "| schedule | variant | median step (s) | / now |", "|---|---|---|---|"]
    lines += [f"| {r['schedule']} | {r['variant']} | {r['median_step_s']:.3f} | {r['vs_now']:.3f} |"
              for r in rows]
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"runtime_ab-D{args.stages}-N{args.micro_batches}")
    with open(stem + ".json", "w") as f:
        json.dump({"command": command, "emulate": args.emulate, "rows": rows}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
