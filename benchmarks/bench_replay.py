"""Trace replay against measurement: `python benchmarks/bench_replay.py [D ...] [--schedule S,...]`.

For each schedule (default chimera and chimera-zb) and D (default 2 4 8): train gpt2-bench on D local
processes (16 sequences per step, N=8 micro-batches of 2, one thread per rank) for a few
steps, record the last step's trace, and replay it through the simulator with the costs
measured in it: on the wall clock (what this machine did) and on thread CPU time (what one
dedicated core per rank would do, which is the point at D > cores), the latter also with
the p2p and allreduce links of a measured profile. Also the pure prediction from the profile
alone (`chimera simulate --profile`). Writes out/bench_replay.{json,md} (--out DIR) and
the traces next to them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from chimera.sim.replay import replay
from chimera.sim import simulate
from chimera.sim.profile import Profile, cost_from_profile, load_profile
from chimera.train import TrainConfig
from chimera.train.launch import launch
from chimera.train.report import measured_timeline
from chimera.viz import save_trace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outdir import out_dir  # noqa: E402  (--out DIR, default out/)

OUT = out_dir()


def profile(path: str) -> Profile:
    if not os.path.exists(path):
        from chimera.bench.profiler import build_profile

        with open(path, "w") as f:
            json.dump(build_profile("gpt2-bench", 2), f, indent=1)
    return load_profile(path)


def one(schedule: str, stages: int, prof: Profile, steps: int) -> dict:
    cfg = TrainConfig(model="gpt2-bench", schedule=schedule, stages=stages, micro_batches=8,
                      micro_batch_size=2, steps=steps, progress=False)
    result = launch(cfg)
    trace = os.path.join(OUT, f"trace-{schedule}-D{stages}.json")
    save_trace(measured_timeline(cfg.build_schedule(), result), trace)
    row = {"schedule": schedule, "stages": stages, "trace": os.path.relpath(trace, os.path.dirname(OUT))}
    for name, clock, p in (("wall", "wall", None), ("cpu", "cpu", None), ("cpu+profile links", "cpu", prof)):
        r = replay(trace, clock, p)
        row[name] = {"predicted_step_s": r.predicted_step_s, "predicted_makespan_s": r.predicted.makespan,
                     "sources": r.sources}
        row["measured_step_s"], row["measured_makespan_s"] = r.measured_step_s, r.measured_makespan
        row["outside_schedule_s"] = r.outside_s
    schedule_obj = cfg.build_schedule()
    row["profile_only_makespan_s"] = simulate(schedule_obj, cost_from_profile(prof, schedule_obj)).makespan
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| schedule | D | processes / cores | measured step (s) | replay, wall clock (s) | "
             "replay, CPU time (s) | replay, CPU time + profile links (s) | profile only (s) |",
             "|---|---|---|---|---|---|---|---|"]
    cores = os.cpu_count()
    for r in rows:
        def cell(key):
            v = r[key]["predicted_step_s"]
            return f"{v:.3f} ({(v - r['measured_step_s']) / r['measured_step_s']:+.0%})"
        prof = r["profile_only_makespan_s"] + r["outside_schedule_s"]
        lines.append(f"| {r['schedule']} | {r['stages']} | {r['stages']} / {cores} | {r['measured_step_s']:.3f} | "
                     f"{cell('wall')} | {cell('cpu')} | {cell('cpu+profile links')} | {prof:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stages", nargs="*", type=int, default=[2, 4, 8])
    ap.add_argument("--schedule", default="chimera,chimera-zb", help="comma-separated schedules")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    prof = profile(os.path.join(OUT, "profile-gpt2-bench.json"))
    rows = [one(s.strip(), d, prof, args.steps) for s in args.schedule.split(",") if s.strip()
            for d in args.stages]
    data = {"date": time.strftime("%Y-%m-%d %H:%M"), "load_average": os.getloadavg(), "rows": rows}
    with open(os.path.join(OUT, "bench_replay.json"), "w") as f:
        json.dump(data, f, indent=1)
    text = markdown(rows)
    with open(os.path.join(OUT, "bench_replay.md"), "w") as f:
        f.write(f"`python benchmarks/bench_replay.py` ({data['date']})\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
