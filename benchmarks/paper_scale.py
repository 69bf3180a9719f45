"""The paper's scale experiments, predicted by `chimera plan` (Li & Hoefler SC'21, Sec. 5).

Usage: python benchmarks/paper_scale.py [--quick]
Writes out/paper_scale.{md,json} (--out DIR).

Workloads on Piz Daint (``--hardware p100``: one P100 per node, Aries, fp32 over gloo):
- GPT-2 (64 layers, d 1280, seq 632) weak scaling on 512, 1024 and 2048 nodes, mini-batch
  512 at 512 nodes growing with the node count;
- BERT-48 (48 layers, d 1024, seq 128) on 32 nodes, mini-batch 512.
The models are the presets ``gpt2-paper`` and ``bert-48`` with the paper's vocabularies
(GPT-2 BPE 50,257, BERT uncased WordPiece 30,522) and dropout 0.1, as the paper's models
had; ``--quick`` (and a second table) uses the presets as they are (bytes, no dropout).

For each: the configuration plan picks, the paper's own configuration priced by the same
model (GPT-2: D=32, B=1, W=P/32; BERT-48: W=4, D=8, B=16, Chimera with two pipes), the best
configuration of every scheme, and Chimera's predicted speed-up over GPipe, DAPPLE (1F1B),
GEMS, PipeDream and PipeDream-2BW (the paper: 1.16x to 2.34x at 2,048 nodes).
"""

from __future__ import annotations

import json
import os
import sys
import time

from chimera.modelcfg import get_config
from chimera.plan import Planner, Workload, get_hardware
from chimera.plan.report import parts
from chimera.plan.search import gc_paused
from chimera.plan.shapes import ShapeCache

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outdir import out_dir  # noqa: E402  (--out DIR, default out/)

OUT = os.path.join(out_dir(), "paper_scale")
PAPER_MODEL = {"gpt2-paper": {"vocab_size": 50257, "dropout": 0.1},
               "bert-48": {"vocab_size": 30522, "dropout": 0.1}}
# (model, nodes, mini-batch, the paper's Chimera configuration (W, D, B))
WORKLOADS = [("gpt2-paper", 512, 512, (16, 32, 1)), ("gpt2-paper", 1024, 1024, (32, 32, 1)),
             ("gpt2-paper", 2048, 2048, (64, 32, 1)), ("bert-48", 32, 512, (4, 8, 16))]
BASELINES = [("gpipe", "GPipe"), ("1f1b", "DAPPLE (1F1B)"), ("gems", "GEMS"),
             ("pipedream", "PipeDream"), ("pipedream-2bw", "PipeDream-2BW")]


def _ev(e) -> dict:
    c = e.candidate
    compute, idle, sync = parts(e)
    return {"variant": c.variant, "W": c.width, "D": c.depth, "B": c.micro_batch,
            "N": c.micro_batches, "recompute": c.recompute, "iteration_s": e.iteration_s,
            "throughput_seq_per_s": e.throughput, "bubble_ratio": e.bubble_ratio,
            "memory_gib": e.memory_bytes / 2**30, "allreduce_share": e.allreduce_share,
            "compute_s": compute, "idle_s": idle, "unhidden_allreduce_s": sync,
            "asynchronous": e.asynchronous}


def run_one(model: str, nodes: int, batch: int, paper: tuple, faithful: bool, shapes: ShapeCache) -> dict:
    cfg = get_config(model, **(PAPER_MODEL[model] if faithful else {}))
    work = Workload(cfg, nodes, batch, get_hardware("p100"), name=model)
    planner = Planner(work, shapes=shapes)
    t0 = time.perf_counter()
    result = planner.run(top_k=5)
    seconds = time.perf_counter() - t0
    w, d, b = paper
    try:  # the paper's configuration: Chimera, two pipes, any strategy and recompute
        mine = planner.run(top_k=1, only=lambda c: c.scheme == "chimera" and dict(c.options).get("pipes") == 2
                           and (c.width, c.depth, c.micro_batch) == (w, d, b)).top[0]
    except ValueError:
        mine = None
    best = {k: e for k, e in result.best.items()}
    chimera = best["chimera"]
    two = planner.run(top_k=1, only=lambda c: c.scheme == "chimera"
                      and dict(c.options).get("pipes") == 2).top[0]  # the paper's Chimera: Q=2
    return {"model": model, "nodes": nodes, "mini_batch": batch, "faithful_model": faithful,
            "plan_seconds": seconds, "plan_pick": _ev(result.top[0]),
            "paper_config": {"W": w, "D": d, "B": b},
            "paper_config_predicted": _ev(mine) if mine else None,
            "best_per_scheme": {k: _ev(e) for k, e in sorted(best.items(), key=lambda kv: kv[1].iteration_s)},
            "chimera_speedup": {k: best[k].iteration_s / chimera.iteration_s for k, _ in BASELINES if k in best},
            "chimera_q2": _ev(two),
            "chimera_q2_speedup": {k: best[k].iteration_s / two.iteration_s for k, _ in BASELINES if k in best},
            "search": {"candidates": result.stats.candidates, "simulated": result.stats.simulated}}


def _cfg(e: dict) -> str:
    return f"{e['variant']}, W={e['W']} D={e['D']} B={e['B']}" + (", recompute" if e["recompute"] else "")


def markdown(rows: list[dict], title: str) -> list[str]:
    lines = [f"### {title}", "",
             "| workload | plan's pick | seq/s | paper's config (W, D, B) priced here | seq/s | "
             + " | ".join(f"Chimera vs {label}" for _, label in BASELINES) + " | plan time |",
             "|---" * (6 + len(BASELINES)) + "|"]
    for r in rows:
        pick, paper = r["plan_pick"], r["paper_config_predicted"]
        p = r["paper_config"]
        paper_txt = f"W={p['W']} D={p['D']} B={p['B']}: " + (_cfg(paper) if paper else "does not fit")
        speed = " | ".join(f"{r['chimera_speedup'][k]:.2f}x ({r['chimera_q2_speedup'][k]:.2f}x)"
                           if k in r["chimera_speedup"] else "-" for k, _ in BASELINES)
        lines.append(f"| {r['model']} P={r['nodes']} G={r['mini_batch']} | {_cfg(pick)} | "
                     f"{pick['throughput_seq_per_s']:.1f} | {paper_txt} | "
                     f"{paper['throughput_seq_per_s'] if paper else 0:.1f} | {speed} | {r['plan_seconds']:.1f} s |")
    lines += ["", "Chimera vs X: the best Chimera over the best X (in brackets: Chimera with two pipes, "
              "as the paper ran it). Paper, 2,048 nodes: 1.16x to 2.34x.", "",
              "Best configuration of every scheme (iteration seconds; bubble; GiB per rank):", "",
              "| workload | " + " | ".join(_schemes(rows)) + " |", "|---" * (1 + len(_schemes(rows))) + "|"]
    for r in rows:
        cells = []
        for k in _schemes(rows):
            e = r["best_per_scheme"].get(k)
            cells.append(f"{e['iteration_s']:.2f} s; {e['bubble_ratio']:.0%}; {e['memory_gib']:.1f}; "
                         f"W={e['W']} D={e['D']} B={e['B']}{' rc' if e['recompute'] else ''}" if e else "-")
        lines.append(f"| {r['model']} P={r['nodes']} | " + " | ".join(cells) + " |")
    return lines + [""]


def _schemes(rows: list[dict]) -> list[str]:
    names: list[str] = []
    for r in rows:
        names += [k for k in r["best_per_scheme"] if k not in names]
    return names


def main() -> None:
    with gc_paused():  # as `chimera plan` does: the collector only slows the search down
        _main()


def _main() -> None:
    quick = "--quick" in sys.argv
    shapes = ShapeCache()  # shapes do not depend on the model: shared by every plan
    variants = [False] if quick else [True, False]
    results = {}
    for faithful in variants:
        rows = []
        for model, nodes, batch, paper in WORKLOADS:
            r = run_one(model, nodes, batch, paper, faithful, shapes)
            rows.append(r)
            print(f"{model} P={nodes}: pick {_cfg(r['plan_pick'])}; chimera speed-up "
                  + ", ".join(f"{k} {v:.2f}x" for k, v in r["chimera_speedup"].items())
                  + f" ({r['plan_seconds']:.1f} s)")
        results["paper_models" if faithful else "presets"] = rows
    md = ["# The paper's scale experiments, predicted by `chimera plan`", "",
          "Reproduce: `python benchmarks/paper_scale.py` (Piz Daint preset `p100`; "
          "see the script's docstring).", ""]
    if "paper_models" in results:
        md += markdown(results["paper_models"], "The paper's models (BPE/WordPiece vocabularies, dropout 0.1)")
    md += markdown(results["presets"], "The presets as they are (byte vocabulary, no dropout)")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT + ".md", "w") as f:
        f.write("\n".join(md))
    with open(OUT + ".json", "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {OUT}.md and {OUT}.json")


if __name__ == "__main__":
    main()
