"""CPU time per optimizer step of bench rows, per rank: a measure that load moves less than
wall time. `python benchmarks/step_cpu.py chimera:1f1b torch:1f1b [--steps 20] [--profile ROW]`

Every row is built in one spawned gloo group (as `chimera bench`), then each round runs one
step of every row (rotating the order). Per step and rank: wall seconds, the main thread's
CPU seconds and the whole process's (gloo's threads too). Medians over the measured rounds.
``--profile ROW --rank R`` also runs cProfile over rank R's steps of ROW and prints the top
functions by internal time. ``--out FILE`` also writes the table there (and the medians as
JSON beside it, ``FILE.json``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile as op_profile

from chimera.bench.harness import _build, _group
from chimera.bench.rows import BenchConfig, select_rows
from chimera.runtime import workers
from chimera.runtime.workers import free_port


def _op_table(cfg, rows, runners, rank, prank, out, top):
    """Per row, aten ops of rank ``prank`` over 3 steps: calls and self CPU ms per step."""
    tables = {}
    for k, row in enumerate(rows):
        dist.barrier()
        if rank != prank:
            for i in range(3):
                runners[k].step(cfg.rounds + i)
            continue
        with op_profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(3):
                runners[k].step(cfg.rounds + i)
        tables[row.id] = {e.key: (e.count / 3, e.self_cpu_time_total / 3e3)
                          for e in prof.key_averages()}
    if rank == prank:
        with open(f"{out}.ops", "w") as f:
            json.dump(tables, f)


def _worker(rank, world, cfg, rows, port, out, profile, prank, top, ops=False):
    with _group(rank, world, port, cfg):
        runners, failed = _build(cfg, rows, rank)
        if failed:
            raise RuntimeError(failed)
        prof = cProfile.Profile() if profile is not None and rank == prank else None
        res = {r.id: [] for r in rows}
        for rnd in range(cfg.rounds):
            for j in range(len(rows)):
                k = (rnd + j) % len(rows)
                dist.barrier()
                w, c, t = time.perf_counter(), time.process_time(), time.thread_time()
                on = prof is not None and rows[k].id == profile and rnd >= cfg.warmup
                if on:
                    prof.enable()
                runners[k].step(rnd)
                if on:
                    prof.disable()
                if rnd >= cfg.warmup:
                    res[rows[k].id].append((time.perf_counter() - w, time.process_time() - c,
                                            time.thread_time() - t))
        with open(f"{out}.{rank}", "w") as f:
            json.dump(res, f)
        if ops:
            _op_table(cfg, rows, runners, rank, prank, out, top)
        if prof is not None:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
            with open(f"{out}.prof", "w") as f:
                f.write(s.getvalue())
            prof.dump_stats(f"{out}.pstats")


def _print_ops(tables: dict, top: int) -> None:
    ids = list(tables)
    keys = set().union(*tables.values())
    order = sorted(keys, key=lambda k: -max(t.get(k, (0, 0))[1] for t in tables.values()))
    print(f"{'op (per step: calls, self CPU ms)':44s}" + "".join(f"{i[:24]:>26s}" for i in ids))
    for key in order[:top]:
        cells = "".join(f"{tables[i].get(key, (0, 0))[0]:10.0f} {tables[i].get(key, (0, 0))[1]:14.2f} "
                        for i in ids)
        print(f"{key[:44]:44s}{cells}")
    print(f"{'total':44s}" + "".join(f"{'':10s} {sum(v[1] for v in tables[i].values()):14.2f} " for i in ids))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows", nargs="+")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--profile")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--ops", action="store_true", help="torch.profiler op table of --rank")
    ap.add_argument("--save", help="copy the cProfile stats file here")
    ap.add_argument("--out", help="also write the table to this file (and FILE.json)")
    a = ap.parse_args(argv)
    cfg = BenchConfig(rows=tuple(a.rows), steps=a.steps, warmup=a.warmup, memory=False)
    rows = select_rows(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res")
        codes = workers.run(_worker, (cfg.stages, cfg, rows, free_port(), out, a.profile, a.rank,
                                      a.top, a.ops), cfg.stages, grace=10.0)
        if any(codes):
            sys.exit(f"failed: {codes}")
        per_rank = [json.load(open(f"{out}.{r}")) for r in range(cfg.stages)]
        lines = [f"{'row':40s} rank  wall ms  proc-cpu ms  main-cpu ms  (medians of {a.steps})"]
        medians = {}
        for row in rows:
            for r, res in enumerate(per_rank):
                cols = [statistics.median(x[i] for x in res[row.id]) * 1e3 for i in range(3)]
                medians.setdefault(row.id, []).append(dict(zip(("wall_ms", "proc_cpu_ms",
                                                                "main_cpu_ms"), cols)))
                lines.append(f"{row.id:40s} {r:4d} {cols[0]:8.1f} {cols[1]:12.1f} {cols[2]:12.1f}")
        print("\n".join(lines))
        if a.out:
            head = (f"python benchmarks/step_cpu.py {' '.join(a.rows)} --steps {a.steps} "
                    f"({time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f})")
            with open(a.out, "w") as f:
                f.write(head + "\n" + "\n".join(lines) + "\n")
            with open(a.out + ".json", "w") as f:
                json.dump({"command": head, "steps": a.steps, "per_rank": medians}, f, indent=1)
        if a.ops:
            _print_ops(json.load(open(f"{out}.ops")), a.top)
        if a.profile:
            print(open(f"{out}.prof").read())
            if a.save:
                os.replace(f"{out}.pstats", a.save)


if __name__ == "__main__":
    main()
