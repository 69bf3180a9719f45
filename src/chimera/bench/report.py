"""Benchmark results: the JSON object, the markdown table, the targets, and a bar chart."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time

import torch

from chimera.bench.rows import BenchConfig, Row
from chimera.schedules import get_scheme


def result_rows(cfg: BenchConfig, rows: list[Row], raw: dict) -> list[dict]:
    out = []
    for k, row in enumerate(rows):
        if row.id in raw["failed"]:
            continue
        steps = raw["times"][k][cfg.warmup:]
        median = statistics.median(steps)
        out.append({
            "impl": row.impl, "schedule": row.schedule,
            "stages": 1 if row.impl == "single" else cfg.stages,
            "threads": row.threads or cfg.threads, "options": dict(row.options),
            "median_step_s": median, "min_step_s": min(steps), "max_step_s": max(steps),
            "sequences_per_s": cfg.global_batch / median,
            "peak_rss_mb": raw["rss_mb"][k], "peak_activation_mb": raw["activation_mb"][k],
            "first_loss": raw["first_loss"][k],
            "steps_s": steps,
        })
    return out


def _best(results: list[dict], impl: str, schedule: str | None = None, threads: int | None = None):
    pick = [r for r in results if r["impl"] == impl and (schedule is None or r["schedule"] == schedule)
            and (threads is None or r["threads"] == threads)]
    return min(pick, key=lambda r: r["median_step_s"]) if pick else None


def _single(results: list[dict], accumulated: bool = False):
    """One process, one thread: the whole mini-batch at once (the issue's baseline), or the
    pipelines' micro-batches accumulated."""
    return next((r for r in results if r["impl"] == "single" and r["threads"] == 1
                 and bool(r["options"].get("micro_batches")) == accumulated), None)


def targets(results: list[dict]) -> dict:
    """The issue's three targets, as measured in this one run (None where a row is missing):
    for Chimera as run by default (direct concatenation) and for its best variant here."""
    direct = next((r for r in results if r["impl"] == "chimera" and r["schedule"] == "chimera"
                   and not r["options"]), None)
    best, single = _best(results, "chimera", "chimera"), _single(results)
    accumulated = _single(results, accumulated=True)
    torch_best, ours_1f1b = _best(results, "torch"), _best(results, "chimera", "1f1b")
    torch_1f1b = _best(results, "torch", "1f1b")

    def ratio(slow, fast):
        return None if not slow or not fast else slow["median_step_s"] / fast["median_step_s"]

    out = {"torch_best": torch_best and torch_best["schedule"],
           "chimera_best": best and row_name(best),
           "ours_1f1b_vs_torch_1f1b": ratio(torch_1f1b, ours_1f1b)}
    for key, row in (("chimera", direct), ("chimera_best", best)):
        out[f"{key}_vs_torch_best"] = ratio(torch_best, row)
        out[f"{key}_vs_linear_limit"] = None if not single or not row else \
            single["median_step_s"] / (2 * row["median_step_s"])
        out[f"{key}_vs_accumulated_linear_limit"] = None if not accumulated or not row else \
            accumulated["median_step_s"] / (2 * row["median_step_s"])
    out["met"] = {
        "chimera >= 1.15x torch's best": _ge(out["chimera_best_vs_torch_best"], 1.15),
        "our 1f1b >= torch 1f1b": _ge(out["ours_1f1b_vs_torch_1f1b"], 1.0),
        "chimera >= 0.92 of linear": _ge(out["chimera_best_vs_linear_limit"], 0.92),
    }
    return out


def _ge(value, floor):
    return None if value is None else value >= floor


def assemble(cfg: BenchConfig, rows: list[Row], raw: dict, started: float, load: tuple,
             results: list[dict] | None = None, summary: dict | None = None, **extra) -> dict:
    """The results object: the run's configuration and machine, the rows (``results``,
    default: this module's rows of a real-model run) and their ``summary`` (default: the
    real-model targets)."""
    results = result_rows(cfg, rows, raw) if results is None else results
    config = {**cfg.to_dict(), "torch": torch.__version__, "python": platform.python_version(),
              "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
              "wall_s": round(time.time() - started, 1),
              "load_average_before": load[0], "load_average_after": load[1],
              "order": "interleaved: every round runs one step of each row, starting one row later each round"}
    return {"config": config, "results": results, "skipped": raw["failed"],
            "summary": targets(results) if summary is None else summary, **extra}


def row_name(r: dict) -> str:
    if r["impl"] == "single":
        acc = r["options"].get("micro_batches")
        return f"single, {r['threads']} thread{'s' if r['threads'] > 1 else ''}" + \
            (f", {acc} micro-batches accumulated" if acc else "")
    opts = r["options"]
    extra = get_scheme(r["schedule"]).labels(opts) if r["impl"] in ("chimera", "floor") else []
    extra += ["sharded optimizer"] if opts.get("shard") else []
    return r["schedule"] + (f" ({', '.join(extra)})" if extra else "")


def _mb(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def markdown(data: dict) -> str:
    """The results table (ranked within each implementation) and the targets."""
    res = data["results"]
    single = _single(res)
    lines = ["| impl | schedule | ranks | median step (s) | min .. max (s) | sequences/s | "
             "vs 1 process, 1 thread | peak RSS / rank (MB) | peak activations / rank (MB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res:
        speed = "-" if not single else f"{single['median_step_s'] / r['median_step_s']:.2f}x"
        lines.append(f"| {r['impl']} | {row_name(r)} | {r['stages']} | {r['median_step_s']:.3f} | "
                     f"{r['min_step_s']:.3f} .. {r['max_step_s']:.3f} | {r['sequences_per_s']:.1f} | "
                     f"{speed} | {_mb(r['peak_rss_mb'])} | {_mb(r['peak_activation_mb'])} |")
    return "\n".join(lines) + "\n\n" + targets_text(data["summary"])


def targets_text(s: dict) -> str:
    def fmt(v, unit="x"):
        return "n/a" if v is None else f"{v:.2f}{unit}"

    met = {k: ("met" if v else "missed" if v is not None else "n/a") for k, v in s["met"].items()}
    keys = list(met)
    return "\n".join([
        f"- chimera vs torch's best ({s['torch_best']}): {fmt(s['chimera_best_vs_torch_best'])} "
        f"with {s['chimera_best']}, {fmt(s['chimera_vs_torch_best'])} with the default (direct) "
        f"(target >= 1.15x: {met[keys[0]]})",
        f"- our 1f1b vs torch's Schedule1F1B: {fmt(s['ours_1f1b_vs_torch_1f1b'])} "
        f"(target >= 1.00x: {met[keys[1]]})",
        f"- chimera vs the linear limit (2x one process, one thread): "
        f"{fmt(s['chimera_best_vs_linear_limit'], '')} with {s['chimera_best']}, "
        f"{fmt(s['chimera_vs_linear_limit'], '')} direct (target >= 0.92: {met[keys[2]]}); against 2x "
        f"one process accumulating the same micro-batches: {fmt(s['chimera_best_vs_accumulated_linear_limit'], '')}"
        f" and {fmt(s['chimera_vs_accumulated_linear_limit'], '')}",
    ])


def save(data: dict, out_dir: str, stem: str = "bench", table=None, picture=None) -> list[str]:
    """``stem.json``, ``stem.md`` and ``stem.png`` in ``out_dir``; returns the paths.
    ``table`` and ``picture`` draw the markdown and the PNG (default: this module's)."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{stem}.{ext}") for ext in ("json", "md", "png")]
    with open(paths[0], "w") as f:
        json.dump(data, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(f"{data['config'].get('command', 'chimera bench')} ({data['config']['date']}, "
                f"torch {data['config']['torch']}, {data['config']['cpus']} CPUs)\n\n")
        f.write((table or markdown)(data) + "\n")
    (picture or chart)(data, paths[2])
    return paths


def chart(data: dict, path: str) -> None:
    """Horizontal bars of the median step time, whiskers from min to max, one colour per impl."""
    import matplotlib  # the optional extra chimera-pipeline[plot], imported when a chart is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = data["results"][::-1]
    colors = {"single": "#999999", "chimera": "#1f77b4", "torch": "#ff7f0e"}
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(res) + 1.4))
    y = range(len(res))
    med = [r["median_step_s"] for r in res]
    err = [[m - r["min_step_s"] for m, r in zip(med, res)], [r["max_step_s"] - m for m, r in zip(med, res)]]
    ax.barh(list(y), med, xerr=err, color=[colors[r["impl"]] for r in res], capsize=2)
    ax.set_yticks(list(y), [f"{r['impl']}: {row_name(r)}" for r in res], fontsize=8)
    ax.set_xlabel("seconds per optimizer step (median; whiskers: min..max)")
    c = data["config"]
    ax.set_title(f"{c['model']}, {c['global_batch']} sequences/step, N={c['micro_batches']}, "
                 f"D={c['stages']}, {c['threads_per_rank']} thread/rank, gloo", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
