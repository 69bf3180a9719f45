"""How fast is the simulator? Generate + lower + validate + simulate chimera D=32 N=128.

Usage: python benchmarks/sim_speed.py   (writes out/sim_speed.json; --out DIR)
"""

import json
import os
import statistics
import sys
import time

from chimera.passes import lower
from chimera.schedules import build
from chimera.sim import CostModel, simulate
from chimera.check.validate import validate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outdir import out_dir  # noqa: E402  (--out DIR, default out/)

CASES = [("chimera", 32, 128, {}), ("chimera", 16, 64, {"strategy": "doubling"}), ("1f1b", 32, 128, {})]


def measure(name, d, n, opts, reps=5):
    gen, sim = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        schedule = lower(build(name, d, n, **opts))
        t1 = time.perf_counter()
        simulate(schedule, CostModel.unit(1, 2))
        t2 = time.perf_counter()
        gen.append(t1 - t0)
        sim.append(t2 - t1)
    t0 = time.perf_counter()
    validate(schedule)
    val = time.perf_counter() - t0
    actions = sum(len(p) for p in schedule.programs)
    return {"schedule": name, "stages": d, "micro_batches": n, "options": opts, "actions": actions,
            "generate_lower_s": statistics.median(gen), "simulate_s": statistics.median(sim),
            "validate_s": val}


def main():
    rows = [measure(*case) for case in CASES]
    for r in rows:
        print(f"{r['schedule']:<8} D={r['stages']:<3} N={r['micro_batches']:<4} {r['actions']:>6} actions: "
              f"generate+lower {r['generate_lower_s']:.3f} s, simulate {r['simulate_s']:.3f} s, "
              f"validate {r['validate_s']:.3f} s (median of 5)")
    folder = out_dir()
    os.makedirs(folder, exist_ok=True)
    out = os.path.join(folder, "sim_speed.json")
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
