"""What a host pays to run code right after it slept: the emulated bench's hidden per-action cost.

    python benchmarks/wake_cost.py          # -> out/wake_cost.{json,md} (--out DIR)

An emulated stage (``chimera bench --emulate``) sleeps through its compute, as a host blocked
on a GPU would, and then runs the runtime's code for the next action. This script times a
fixed piece of that code (a message's views, a detach, a tiny autograd op: what a stage input
goes through) and one gloo ``isend`` to a rank blocked in its receive, each first thing after
a sleep of 0 .. 10 ms, then the same piece again right after (warm), medians of many
repetitions, in one process pinned to nothing (as the bench's ranks are). Where the first
call after a sleep costs many times the second, the machine evicts or deschedules the idle
process's working set, and every action of an emulated run pays that once per distinct piece
of code it runs after each wait: the floor rows (a wait and a message per action) pay it on
little code, a full runtime on more.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SLEEPS_MS = (0.0, 0.1, 1.0, 3.0, 10.0, 20.0)


def _piece(buf: torch.Tensor) -> torch.Tensor:
    """What a received activation goes through before a stage runs: views, a cast, a detach
    that starts a graph, one op."""
    x = buf[0:128].view(torch.float32).view(2, 16).to(torch.float32)
    x = x.detach().requires_grad_()
    return (x * 2).sum()


def _after_sleep(seconds: float, fn, reps: int) -> tuple[float, float]:
    """Median seconds of ``fn()`` first thing after sleeping ``seconds``, and of a second call."""
    first, second = [], []
    for _ in range(reps):
        if seconds:
            time.sleep(seconds)
        a = time.perf_counter()
        fn()
        b = time.perf_counter()
        fn()
        second.append(time.perf_counter() - b)
        first.append(b - a)
    return statistics.median(first), statistics.median(second)


def _isend_worker(rank: int, port: int, reps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    msg = torch.zeros(128, dtype=torch.uint8)
    rows = []
    for ms in SLEEPS_MS:
        calls = []
        for i in range(reps):
            dist.barrier()
            if rank == 0:
                if ms:
                    time.sleep(ms / 1e3)
                a = time.perf_counter()
                work = dist.isend(msg, 1, tag=i)
                calls.append(time.perf_counter() - a)
                work.wait()
            else:
                dist.irecv(msg, 0, tag=i).wait()
        if rank == 0:
            rows.append({"sleep_ms": ms, "isend_us": 1e6 * statistics.median(calls)})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--out", default="out")
    p.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    args = p.parse_args()
    torch.set_num_threads(1)
    buf = torch.zeros(128, dtype=torch.uint8)
    pieces = []
    for ms in SLEEPS_MS:
        first, second = _after_sleep(ms / 1e3, lambda: _piece(buf), args.reps)
        pieces.append({"sleep_ms": ms, "first_us": 1e6 * first, "second_us": 1e6 * second})
        print(f"after {ms:4g} ms asleep: stage-input piece {1e6 * first:7.1f} us first, "
              f"{1e6 * second:6.1f} us right after", flush=True)
    tmp = os.path.join(args.out, ".wake_cost_isend.json")
    os.makedirs(args.out, exist_ok=True)
    from chimera.runtime import workers

    port = args.port if args.port is not None else workers.free_port()
    mp.spawn(_isend_worker, args=(port, args.reps, tmp), nprocs=2)
    with open(tmp) as f:
        sends = json.load(f)
    os.remove(tmp)
    for row in sends:
        print(f"after {row['sleep_ms']:4g} ms asleep: gloo isend to a waiting rank "
              f"{row['isend_us']:7.1f} us", flush=True)
    data = {"reps": args.reps, "cpu": _cpu(), "piece": pieces, "isend": sends}
    with open(os.path.join(args.out, "wake_cost.json"), "w") as f:
        json.dump(data, f, indent=1)
    lines = ["| asleep before (ms) | stage-input piece, first call (us) | the same, right after (us) "
             "| gloo isend to a waiting rank (us) |", "|---|---|---|---|"]
    for a, b in zip(pieces, sends):
        lines.append(f"| {a['sleep_ms']:g} | {a['first_us']:.1f} | {a['second_us']:.1f} | "
                     f"{b['isend_us']:.1f} |")
    with open(os.path.join(args.out, "wake_cost.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {os.path.join(args.out, 'wake_cost.json')}, {os.path.join(args.out, 'wake_cost.md')}")
    return 0


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{len(names)} x {names[0]}" if names else "unknown"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
