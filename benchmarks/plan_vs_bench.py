"""Does `chimera plan` rank schedules as real runs do? `python benchmarks/plan_vs_bench.py`

For the layouts that run here, the planner's prediction (the simulator on the measured cost
profile, `--profile`) of every runnable scheme is put beside a measurement:

- D=2, W=1 (2 processes on 2 cores): `chimera bench` of our rows (gpt2-bench, 16 sequences
  per step in N=8 micro-batches of 2), interleaved rounds, medians;
- D=2, W=2 (4 processes on 2 cores, so the wall clock mostly measures the sharing): each
  scheme trains a few steps with N=4 micro-batches of 2 per copy, and the traced step is
  replayed on thread CPU time (what one dedicated core per rank would give) with the p2p and
  allreduce links of the profile (measured with one core per process: the allreduce waited
  for in a 4-process run on 2 cores measures the sharing, not the link). The schedule's
  replayed makespan is compared, as the planner prices it: the optimizer step measured
  outside it on shared cores is mostly noise.

Reported: both times per scheme, the two rankings, Kendall's tau, and how many of the pairs
the measurement separates by more than its noise (3%) the planner orders the same way.
Writes out/plan_vs_bench.{md,json} (--out DIR). About 10 minutes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import tempfile
import time

from chimera.bench.rows import BenchConfig, select_rows
from chimera.modelcfg import get_config
from chimera.plan import Planner
from chimera.plan.hardware import get_hardware
from chimera.plan.search import Candidate, variants
from chimera.plan.workload import Workload
from chimera.schedules import build
from chimera.sim.profile import load_profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outdir import out_dir  # noqa: E402  (--out DIR, default out/)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")  # the committed profile
OUT = out_dir()
MODEL, D, B, G = "gpt2-bench", 2, 2, 16
NOISE = 0.03  # step-time differences below this are within run-to-run noise here


def _options(schedule: str, opts: dict, layers: int) -> tuple:
    """The planner's variant of the schedule a bench row runs (its options, defaults filled in
    by the generator)."""
    params = build(schedule, D, G // B, **opts).params
    return next(v for v in variants(schedule, D, layers) if all(params.get(k) == x for k, x in v))


def _label(schedule: str, opts: dict) -> str:
    return f"{schedule} ({opts['strategy']})" if "strategy" in opts else schedule


def predict(profile_path: str, width: int, rows: list[tuple[str, dict]]) -> dict[str, float]:
    work = Workload(get_config(MODEL), D * width, G, get_hardware("cpu"),
                    profile=load_profile(profile_path), name=MODEL)
    planner = Planner(work, sorted({s for s, _ in rows}), recompute=(False,))
    out = {}
    for schedule, opts in rows:
        c = Candidate(schedule, _options(schedule, opts, work.model.n_layers_total), D, width, B,
                      G // (width * B), False)
        ev = planner.evaluate(c)
        out[_label(schedule, opts)] = ev.iteration_s if ev else float("nan")
    return out


def measure_w1(steps: int, bench_json: str | None) -> tuple[list[tuple[str, dict]], dict[str, float]]:
    """Our rows of a bench run: a new one, or those of ``bench_json`` (`chimera bench` output)."""
    from chimera.bench.harness import measure
    from chimera.bench.report import result_rows

    if bench_json:
        with open(bench_json) as f:
            results = [r for r in json.load(f)["results"] if r["impl"] == "chimera"]
    else:
        cfg = BenchConfig(rows=("chimera",), memory=False, steps=steps)
        rows = select_rows(cfg)
        results = result_rows(cfg, rows, measure(cfg, rows))
    # the sharded-optimizer rows (a bench option, not a schedule's) have no planner variant and
    # would take the plain rows' labels
    results = [r for r in results if "shard" not in r["options"]]
    pairs = [(r["schedule"], r["options"]) for r in results]
    return pairs, {_label(s, o): r["median_step_s"] for (s, o), r in zip(pairs, results)}


def measure_w2(rows: list[tuple[str, dict]], steps: int, profile_path: str) -> dict[str, dict]:
    from chimera.sim.replay import replay
    from chimera.train import TrainConfig
    from chimera.train.launch import launch
    from chimera.train.report import measured_timeline
    from chimera.viz import save_trace

    out, links = {}, load_profile(profile_path)
    with tempfile.TemporaryDirectory() as tmp:
        for schedule, opts in rows:
            label = _label(schedule, opts)
            print(f"plan_vs_bench: W=2 {label}", flush=True)
            cfg = TrainConfig(model=MODEL, schedule=schedule, stages=D, data_parallel=2,
                              micro_batches=G // (2 * B), micro_batch_size=B, steps=steps,
                              progress=False, **opts)
            trace = os.path.join(tmp, "t.json")
            save_trace(measured_timeline(cfg.build_schedule(), launch(cfg)), trace)
            r = replay(trace, "cpu", links)
            out[label] = {"wall_step_s": r.measured_step_s, "replay_cpu_profile_links_step_s": r.predicted_step_s,
                          "replay_cpu_profile_links_makespan_s": r.predicted.makespan}
    return out


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-b of two paired lists."""
    conc = disc = ties_a = ties_b = 0
    for i, j in itertools.combinations(range(len(a)), 2):
        da, db = a[i] - a[j], b[i] - b[j]
        if da == 0 and db == 0:
            continue
        if da == 0:
            ties_a += 1
        elif db == 0:
            ties_b += 1
        elif (da > 0) == (db > 0):
            conc += 1
        else:
            disc += 1
    denom = ((conc + disc + ties_a) * (conc + disc + ties_b)) ** 0.5
    return (conc - disc) / denom if denom else float("nan")  # every pair tied: undefined


def compare(predicted: dict[str, float], measured: dict[str, float | None]) -> dict:
    """Rankings of the schemes that have both a finite prediction and a measurement."""
    finite = lambda v: v is not None and math.isfinite(v)
    names = [n for n in measured if finite(measured[n]) and finite(predicted.get(n))]
    p, m = [predicted[n] for n in names], [measured[n] for n in names]
    separated = agree = 0
    wrong = []
    for i, j in itertools.combinations(range(len(names)), 2):
        if abs(m[i] - m[j]) > NOISE * min(m[i], m[j]):
            separated += 1
            if (p[i] - p[j]) * (m[i] - m[j]) > 0:
                agree += 1
            else:
                wrong.append(f"{names[i]} vs {names[j]}")
    by = lambda xs: {n: r + 1 for r, n in enumerate(sorted(names, key=lambda n: xs[names.index(n)]))}
    return {"names": names, "predicted_s": p, "measured_s": m, "predicted_rank": by(p),
            "measured_rank": by(m), "kendall_tau": kendall_tau(p, m), "separated_pairs": separated,
            "agreeing_pairs": agree, "disagreeing": wrong}


def markdown(title: str, cmp: dict, measured_what: str) -> str:
    lines = [f"**{title}**: Kendall's tau {cmp['kendall_tau']:.2f}; of the "
             f"{cmp['separated_pairs']} pairs the measurement separates by more than "
             f"{NOISE:.0%}, the planner orders {cmp['agreeing_pairs']} the same way"
             + (f" (not: {'; '.join(cmp['disagreeing'])})" if cmp["disagreeing"] else "") + ".", "",
             f"| scheme | plan (s) | rank | {measured_what} (s) | rank |", "|---|---|---|---|---|"]
    order = sorted(cmp["names"], key=lambda n: cmp["measured_rank"][n])
    for n in order:
        i = cmp["names"].index(n)
        lines.append(f"| {n} | {cmp['predicted_s'][i]:.3f} | {cmp['predicted_rank'][n]} | "
                     f"{cmp['measured_s'][i]:.3f} | {cmp['measured_rank'][n]} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=os.path.join(RESULTS, "profile-gpt2-bench.json"),
                    help="cost profile (measured first if missing: `chimera profile`)")
    ap.add_argument("--steps", type=int, default=7, help="bench rounds (W=1)")
    ap.add_argument("--train-steps", type=int, default=3, help="steps of each W=2 run")
    ap.add_argument("--bench", metavar="FILE", help="take the W=1 measurements from this `chimera "
                    "bench` JSON (e.g. benchmarks/results/bench.json) instead of running them")
    args = ap.parse_args()
    if not os.path.exists(args.profile):
        from chimera.bench.profiler import build_profile

        with open(args.profile, "w") as f:
            json.dump(build_profile(MODEL, B), f, indent=1)
    os.makedirs(OUT, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M")
    rows, w1 = measure_w1(args.steps, args.bench)
    w2 = measure_w2(rows, args.train_steps, args.profile)
    one = compare(predict(args.profile, 1, rows), w1)
    two = compare(predict(args.profile, 2, rows), {k: v["replay_cpu_profile_links_makespan_s"] for k, v in w2.items()})
    data = {"date": started, "load_average": os.getloadavg(), "profile": os.path.relpath(args.profile, OUT),
            "w1_source": args.bench or f"chimera bench --rows chimera --steps {args.steps} --no-memory",
            "w1": one, "w2": two, "w2_runs": w2}
    with open(os.path.join(OUT, "plan_vs_bench.json"), "w") as f:
        json.dump(data, f, indent=1)
    text = "\n\n".join([markdown("D=2, W=1 (2 processes)", one, "measured median step"),
                        markdown("D=2, W=2 (4 processes; the schedule replayed on CPU time with the "
                                 "profile's links)", two, "replayed schedule")])
    with open(os.path.join(OUT, "plan_vs_bench.md"), "w") as f:
        how = f" --bench {args.bench}" if args.bench else ""
        f.write(f"`python benchmarks/plan_vs_bench.py{how}` ({started})\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
