"""Where a rank's host time between two emulated waits goes, piece by piece.

    python benchmarks/host_gaps.py                       # D=4 N=8 zb-v, 20:20:20
    python benchmarks/host_gaps.py -D 8 -N 16 --schedule chimera-zb

On accelerator-like stages (``chimera bench --emulate``) a rank either waits (its emulated
compute, or a message) or runs host code. This script runs our runtime (``chimera.api.Pipeline``
on ``chimera.models.emulated`` layers, as the bench's rows do) and, for a few measured steps,
timestamps the runtime's pieces on every rank: each action handler, the p2p calls and their
waits, a boundary's pack and a received message's unpack, a stage input's detach, the split backward's boundary
discovery. Between the end of one wait and the start of the next it then reads off the
segments (from one timestamp to the next, e.g. ``pack< pack>`` is a pack, ``W> F>`` the way
from a forward's wait back out of the stage) and reports the median and total of each kind over
all ranks and steps. Segments that contain a wait for a peer (longer than ``--peer-wait-ms``)
are left out of the medians. The timestamps cost a little themselves (a wrapper per call).

Writes ``benchmarks/results/host_gaps-D{D}-N{N}-{schedule}.{json,md}``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import sys
import tempfile
import time

_T: list = []  # (perf_counter, label) of this rank's probes


def _timed(fn, label: str):
    """``fn``, timestamped on every call (``label<`` before, ``label>`` after)."""
    clock = time.perf_counter

    def timed(*args, **kwargs):
        _T.append((clock(), label + "<"))
        out = fn(*args, **kwargs)
        _T.append((clock(), label + ">"))
        return out
    return timed


def _probe(obj, name: str, label: str) -> None:
    """Timestamp every call of ``obj.name`` (a class's method, a module's function)."""
    setattr(obj, name, _timed(getattr(obj, name), label))


def _instrument(pipe) -> None:
    import chimera.runtime.boundary as boundary
    import chimera.runtime.executor as executor
    import chimera.runtime.p2p as p2p
    import chimera.runtime.split_backward as split_backward

    ex = pipe.runtime.executor
    for op, handler in list(ex.handlers.items()):
        ex.handlers[op] = _timed(handler, op.name)
    ex._calls_of = (None, [])  # the handlers are looked up again
    _probe(ex.mailbox.transport, "isend", "isend")
    _probe(p2p, "wait_work", "wait")
    _probe(executor, "detach_input", "detach")
    _probe(split_backward, "_boundaries", "discover")
    if hasattr(executor.Executor, "_received"):  # a received message's leaves
        _probe(executor.Executor, "_received", "unpack")
    else:  # the code before 2026-12-06 (for a before/after run in a worktree)
        for name in ("unpack", "unpack_grads"):
            _probe(boundary.BoundarySpec, name, "unpack")
    for name in ("pack", "pack_grads"):
        _probe(boundary.BoundarySpec, name, name)


def _worker(rank: int, world: int, args, out: str) -> None:
    """One rank (``chimera.runtime.launch_local.spawn`` joined the group, one thread)."""
    from chimera.bench.emulated import EmulatedOurs
    from chimera.bench.rows import BenchConfig, Row
    from chimera.bench.start import start_together
    from chimera.models.emulated import tighten_timer_slack

    tighten_timer_slack()
    cfg = BenchConfig(stages=args.stages, micro_batches=args.micro_batches,
                      emulate=args.emulate, memory=False)
    row = EmulatedOurs(cfg, Row("chimera", args.schedule), rank)
    for i in range(args.warmup):
        start_together()
        row.step(i)
    _instrument(row.pipe)
    row.log.on = True
    steps = []
    for i in range(args.warmup, args.warmup + args.steps):
        row.log.events.clear()
        _T.clear()
        start_together()
        row.step(i)
        waits = [(b, "WAIT<") for _, b, _, _ in row.log.events]
        waits += [(e, "WAIT>") for _, _, e, _ in row.log.events]
        steps.append(sorted(waits + _T))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(steps, f)


def segments(steps: list[list], peer_wait_s: float) -> tuple[dict, list[float]]:
    """(segment kind -> its lengths, lengths of whole gaps) from a rank's timestamped steps:
    a gap runs from a wait's end to the next wait's start."""
    kinds: dict[str, list[float]] = collections.defaultdict(list)
    gaps = []
    for events in steps:
        gap: list = []
        for t, label in events:
            if label == "WAIT>":
                gap = [(t, label)]
            elif label == "WAIT<":
                if gap:
                    gap.append((t, label))
                    gaps.append(gap[-1][0] - gap[0][0])
                    for (t0, a), (t1, b) in zip(gap, gap[1:]):
                        if t1 - t0 <= peer_wait_s:
                            kinds[f"{a} {b}"].append(t1 - t0)
                gap = []
            elif gap:
                gap.append((t, label))
    return kinds, gaps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--emulate", default="20:20:20", help="F:I:W milliseconds (default 20:20:20)")
    p.add_argument("-D", "--stages", type=int, default=4)
    p.add_argument("-N", "--micro-batches", type=int, default=8)
    p.add_argument("--schedule", default="zb-v")
    p.add_argument("--steps", type=int, default=5, help="timestamped steps (default 5)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peer-wait-ms", type=float, default=5.0,
                   help="segments longer than this hold a wait for a peer: left out (default 5)")
    p.add_argument("--top", type=int, default=25, help="segment kinds in the table (default 25)")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = p.parse_args()
    from chimera.runtime.launch_local import SpawnError, spawn

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gaps")
        try:
            spawn(functools.partial(_worker, args=args, out=out), args.stages)
        except SpawnError as exc:
            print(f"host_gaps: {exc}", file=sys.stderr)
            return 1
        kinds: dict[str, list[float]] = collections.defaultdict(list)
        gaps: list[float] = []
        for rank in range(args.stages):
            with open(f"{out}.{rank}") as f:
                k, g = segments(json.load(f), args.peer_wait_ms / 1e3)
            for name, v in k.items():
                kinds[name] += v
            gaps += g
    rows = sorted(({"segment": name, "count": len(v), "median_us": statistics.median(v) * 1e6,
                    "total_ms": sum(v) * 1e3} for name, v in kinds.items()),
                  key=lambda r: -r["total_ms"])
    command = "python benchmarks/host_gaps.py " + " ".join(sys.argv[1:])
    lines = [f"{command} ({time.strftime('%Y-%m-%d %H:%M')}; {args.schedule}, D={args.stages}, "
             f"N={args.micro_batches}, {args.emulate} ms, {args.steps} steps, every rank)", "",
             f"Gaps between two waits: {len(gaps)}, median {statistics.median(gaps) * 1e6:.0f} us, "
             f"mean {statistics.mean(gaps) * 1e6:.0f} us (a gap may hold a wait for a peer).", "",
             "| segment (from .. to) | count | median (us) | total (ms) |", "|---|---|---|---|"]
    lines += [f"| `{r['segment']}` | {r['count']} | {r['median_us']:.0f} | {r['total_ms']:.1f} |"
              for r in rows[:args.top]]
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"host_gaps-D{args.stages}-N{args.micro_batches}-{args.schedule}")
    with open(stem + ".json", "w") as f:
        json.dump({"command": command, "gaps_us": [g * 1e6 for g in gaps], "segments": rows}, f,
                  indent=1)
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
