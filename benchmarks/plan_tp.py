"""Tensor parallelism in the plan: the best (W, D, T) for two models on H100 nodes, predicted by
`chimera plan` (issue 35 point 7).

Usage: python benchmarks/plan_tp.py [--quick]
Writes out/plan-tp.{md,json} (``--quick``: plan-tp-quick.{md,json}; --out DIR).

Simulator predictions, not measurements: the ``h100`` preset (989 TFLOP/s bf16 at an assumed
efficiency curve, NVLink 360 GB/s inside a node of 8, 48 GB/s per GPU across) prices every
configuration, with TP priced as ``chimera.plan.tensor`` says. Models:
- the paper's GPT-2 1.3B: ``gpt2-paper`` (64 layers, d 1280, 20 heads, sequence 632) with
  the GPT-2 BPE vocabulary (50,257) and no dropout (the planner prices none under TP), mini-batch
  512 (the paper's at 512 nodes); 20 heads: T = 8 is not possible;
- a 70B Llama: ``llama-70b`` (Llama 2 70B: 80 layers, d 8192, 64 heads, 8 key/value heads,
  SwiGLU 28672, vocabulary 32,000, sequence 4096), mini-batch 1024 sequences (4M tokens).
For P in {64, 256} with 8 GPUs a node: the best plan over every runnable scheme and T, the best
at each T in {1, 2, 4, 8} (or why there is none), and whether T = 1 fits at all. ``--quick``:
P = 64 and three schemes only.
"""

from __future__ import annotations

import json
import os
import sys
import time

from chimera.modelcfg import get_sized_config
from chimera.plan import Planner, PlanError, Workload, get_hardware
from chimera.plan.report import parts
from chimera.plan.search import gc_paused
from chimera.plan.shapes import ShapeCache
from chimera.plan.tensor import placement_problem, tensor_sizes
from chimera.schedules import schemes

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outdir import out_dir  # noqa: E402  (--out DIR, default out/)

OUT = os.path.join(out_dir(), "plan-tp")
NODE, SIZES = 8, (1, 2, 4, 8)
# (label, preset, overrides, mini-batch)
MODELS = [("GPT-2 1.3B (gpt2-paper, vocab 50257)", "gpt2-paper", {"vocab_size": 50257}, 512),
          ("Llama 2 70B (llama-70b)", "llama-70b", {}, 1024)]
GIB = 2**30


def _row(planner: Planner, e) -> dict:
    c = e.candidate
    compute, idle, sync = parts(e)
    return {"T": c.tensor, "W": c.width, "D": c.depth, "scheme": c.variant, "B": c.micro_batch,
            "N": c.micro_batches, "recompute": c.recompute, "step_s": e.iteration_s,
            "seq_per_s": e.throughput, "memory_gib": e.memory_bytes / GIB, "bubble": e.bubble_ratio,
            "compute_s": compute, "tp_comm_s": planner.tp_comm(e), "idle_s": idle,
            "unhidden_allreduce_s": sync}


def run_one(label: str, preset: str, overrides: dict, batch: int, gpus: int, names: list[str],
            shapes: ShapeCache) -> dict:
    cfg = get_sized_config(preset, **overrides)
    allowed = tensor_sizes(cfg, gpus, NODE)
    work = Workload(cfg, gpus, batch, get_hardware("h100"), name=preset, tensor_parallel=allowed,
                    gpus_per_node=NODE)
    planner = Planner(work, names, shapes=shapes)
    t0 = time.perf_counter()
    result = planner.run(top_k=1, group=lambda c: c.tensor)
    seconds = time.perf_counter() - t0
    per_t = {}
    for t in SIZES:
        if t in result.best:
            per_t[t] = _row(planner, result.best[t])
        elif t in allowed:  # nothing fits at this T: the least any configuration needs
            try:
                planner.run(top_k=1, only=lambda c, t=t: c.tensor == t)
            except PlanError as exc:
                per_t[t] = {"T": t, "fits": False, "why": str(exc)}
        else:
            per_t[t] = {"T": t, "searched": False, "why": placement_problem(cfg, t, gpus, NODE)}
    return {"model": label, "preset": preset, "overrides": overrides, "gpus": gpus,
            "gpus_per_node": NODE, "global_batch": batch, "seq_len": cfg.seq_len,
            "capacity_gib": result.capacity / GIB, "best": _row(planner, result.top[0]),
            "per_t": per_t, "t1_fits": "step_s" in per_t[1], "plan_seconds": seconds,
            "searched": result.stats.candidates, "simulated": result.stats.simulated}


def _cells(r: dict, best: float) -> str:
    return (f"{r['T']} | {r['W']} | {r['D']} | {r['scheme']} | {r['B']} | "
            f"{'yes' if r['recompute'] else 'no'} | {r['step_s']:.2f} | {r['step_s'] / best:.2f}x | "
            f"{r['memory_gib']:.1f} | {r['compute_s']:.2f} | {r['tp_comm_s']:.2f} | {r['bubble']:.0%}")


def markdown(rows: list[dict]) -> list[str]:
    lines = []
    head = ("| | T | W | D | scheme | B | recompute | step s | vs best | GiB/rank | compute s | "
            "of it TP s | bubble |")
    for r in rows:
        best = r["best"]["step_s"]
        fits = ("yes" if r["t1_fits"] else "**no**")
        lines += [f"### {r['model']}, P = {r['gpus']} ({r['gpus'] // NODE} nodes of {NODE}), "
                  f"mini-batch {r['global_batch']} x {r['seq_len']} tokens", "",
                  f"T = 1 fits: {fits}; {r['capacity_gib']:.0f} GiB usable per GPU; searched "
                  f"{r['searched']} configurations, simulated {r['simulated']}, in {r['plan_seconds']:.0f} s.",
                  "", head, "|---" * 13 + "|", f"| **best** | {_cells(r['best'], best)} |"]
        for t in SIZES:
            e = r["per_t"][t]
            if "step_s" in e:
                lines.append(f"| T={t} | {_cells(e, best)} |")
            else:
                why = e["why"] if e.get("searched", True) else f"not possible: {e['why']}"
                lines.append(f"| T={t} | {t} | {why} |" + " |" * 10)
        lines.append("")
    return lines


def run_all(names: list[str], sizes: tuple[int, ...]) -> list[dict]:
    shapes, rows = ShapeCache(), []  # shapes do not depend on the model: shared by every plan
    for gpus in sizes:
        for label, preset, overrides, batch in MODELS:
            r = run_one(label, preset, overrides, batch, gpus, names, shapes)
            rows.append(r)
            b = r["best"]
            print(f"{label} P={gpus}: best {b['scheme']} W={b['W']} D={b['D']} T={b['T']} B={b['B']}"
                  f"{' rc' if b['recompute'] else ''}: {b['step_s']:.2f} s, {b['memory_gib']:.1f} GiB; "
                  + "; ".join(f"T={t} {e['step_s']:.2f} s" if "step_s" in e else f"T={t} -"
                              for t, e in r["per_t"].items()) + f" ({r['plan_seconds']:.0f} s)")
    return rows


def main() -> None:
    quick = "--quick" in sys.argv
    names = ["1f1b", "chimera", "zb-v"] if quick else [s.name for s in schemes(runnable=True)]
    with gc_paused():  # as `chimera plan` does: the collector only slows the search down
        rows = run_all(names, (64,) if quick else (64, 256))
    md = ["# Tensor parallelism in the plan: predicted, not measured", "",
          "**These are simulator predictions, not measurements.** `chimera plan` prices every "
          "(W, D, T, B, recompute, scheme) with the `h100` preset (DGX H100: 989 TFLOP/s bf16 at an "
          "assumed efficiency curve, NVLink 360 GB/s inside a node of 8, 48 GB/s per GPU across "
          "nodes, mixed precision, flash attention, AdamW without a sharded optimizer) and TP as "
          "`chimera.plan.tensor` models it (docs/ARCHITECTURE.md, Planner). No GPU ran any of it.", "",
          f"Reproduce: `python benchmarks/plan_tp.py{' --quick' if quick else ''}`; one row: e.g. "
          "`chimera plan --model llama-70b --gpus 256 --global-batch 1024 --hardware h100 "
          "--gpus-per-node 8 --explain`.", "",
          "Schemes: " + ", ".join(names) + " (the runnable ones; PipeDream's asynchronous schemes "
          "are left out). step s: one iteration (the mini-batch); vs best: step time over the best "
          "plan's; GiB/rank: the fullest rank; compute s: the busiest rank's compute, TP "
          "collectives included (of it TP s); bubble: the idle share of compute.", ""]
    md += markdown(rows)
    out = OUT + ("-quick" if quick else "")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".md", "w") as f:
        f.write("\n".join(md))
    with open(out + ".json", "w") as f:
        json.dump({"predicted": True, "hardware": "h100", "schemes": names, "rows": rows}, f, indent=1)
    print(f"wrote {out}.md and {out}.json")


if __name__ == "__main__":
    main()
