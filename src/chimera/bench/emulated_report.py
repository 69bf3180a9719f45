"""Results of ``chimera bench --emulate``: each row beside its simulated step time.

Per row: the median measured step, the simulated step at the same costs with the p2p and
allreduce times the run measured, the schedule's own makespan with free communication, and
realized / simulated (the runtime's own cost: what to drive down); peak activations per rank,
measured (bytes the layers kept, in Ma) and simulated. The targets are issue 22's.
"""

from __future__ import annotations

import json
import os
import re
import statistics

from chimera.bench import report
from chimera.bench.emulated import is_sharded, ratio, simulated, stretch_of, trace_events
from chimera.bench.rows import BenchConfig, Row
from chimera.ir import Schedule
from chimera.schedules import get_scheme

# torch's row -> our schedule of the same name (the ones both implement)
SAME = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved", "zbv": "zb-v",
        "dualpipev": "dualpipev"}


def result_rows(cfg: BenchConfig, rows: list[Row], raw: dict) -> list[dict]:
    out, lat, act = [], raw.get("latency"), max(cfg.activation_mb * 2**20, 1)
    for k, row in enumerate(rows):
        if row.id in raw["failed"]:
            continue
        steps = raw["times"][k][cfg.warmup:]
        median = statistics.median(steps)
        order = raw["orders"][k]
        stretch = stretch_of(raw["wait_totals"][k])
        sim = simulated(Schedule.from_json(order), cfg, lat, stretch, is_sharded(row)) if order else {}
        peaks = raw["activation_bytes"][k]
        out.append({
            "impl": row.impl, "schedule": row.schedule, "name": _name(row),
            "stages": cfg.stages, "micro_batches": cfg.micro_batches,
            "options": dict(row.options), "median_step_s": median, "min_step_s": min(steps),
            "max_step_s": max(steps), "steps_s": steps,
            "simulated_step_s": sim.get("simulated_step_s"),
            "simulated_free_s": sim.get("simulated_free_s"),
            "realized_vs_simulated": ratio(median, sim.get("simulated_step_s")),
            "wait_stretch": stretch,
            "simulated_measured_waits_s": sim.get("simulated_measured_waits_s"),
            "realized_vs_measured_waits": ratio(median, sim.get("simulated_measured_waits_s")),
            "peak_activations": None if peaks is None else [round(p / act, 2) for p in peaks],
            "simulated_peak_activations": sim.get("simulated_peak_activations"),
            "first_loss": raw["first_loss"][k],
            "_timeline": sim.get("timeline"),
        })
    floors = {r["schedule"]: r for r in out if r["impl"] == "floor"}
    for r in out:
        floor = floors.get(r["schedule"]) if r["impl"] == "chimera" and _default(r) else None
        r["floor_step_s"] = floor and floor["median_step_s"]
        r["realized_vs_floor"] = ratio(r["median_step_s"], r["floor_step_s"])
    return out


def assemble(cfg: BenchConfig, rows: list[Row], raw: dict, started: float, load: tuple) -> dict:
    results = result_rows(cfg, rows, raw)
    return report.assemble(cfg, rows, raw, started, load, results, targets(results),
                           latency=raw.get("latency"))



def _name(row: Row) -> str:
    return report.row_name({"impl": row.impl, "schedule": row.schedule, "options": row.opts})


def floor_summary(results: list[dict]) -> dict | None:
    """The floor rows' realized / simulated and our rows' step over their floor (ranges)."""
    floors = [r["realized_vs_simulated"] for r in results
              if r["impl"] == "floor" and r["realized_vs_simulated"] is not None]
    over = [r["realized_vs_floor"] for r in results if r.get("realized_vs_floor") is not None]
    if not floors:
        return None
    return {"floor_vs_simulated": [min(floors), max(floors)],
            "ours_vs_floor": [min(over), max(over)] if over else None}


def _default(row: dict) -> bool:
    """Our row at the scheme's defaults (interleaved's chunks=2 is one)."""
    scheme = get_scheme(row["schedule"])
    return all(scheme.is_default(k, v) for k, v in row["options"].items())


def _best(results: list[dict], impl: str) -> dict | None:
    pick = [r for r in results if r["impl"] == impl]
    return min(pick, key=lambda r: r["median_step_s"]) if pick else None


def targets(results: list[dict]) -> dict:
    ours = [r for r in results if r["impl"] == "chimera"]
    over = {r["name"]: r["realized_vs_simulated"] for r in ours
            if r["realized_vs_simulated"] is None or r["realized_vs_simulated"] > 1.05}
    pairs = {}
    for r in results:
        if r["impl"] == "torch" and r["schedule"] in SAME:
            mine = next((o for o in ours if o["schedule"] == SAME[r["schedule"]] and _default(o)), None)
            if mine is not None:
                pairs[SAME[r["schedule"]]] = ratio(r["median_step_s"], mine["median_step_s"])
    best, torch_best = _best(results, "chimera"), _best(results, "torch")
    vs = ratio(torch_best and torch_best["median_step_s"], best and best["median_step_s"])
    return {
        "ours_over_1.05x_simulated": over,
        "ours_vs_torch_same_schedule": pairs,
        "ours_best": best and best["name"], "torch_best": torch_best and torch_best["schedule"],
        "ours_best_vs_torch_best": vs,
        "floor": floor_summary(results),
        "met": {"every schedule of ours <= 1.05x simulated": not over,
                "ours >= torch on each shared schedule": all(v is not None and v >= 1.0
                                                             for v in pairs.values()) if pairs else None,
                "our best >= 1.15x torch's best": None if vs is None else vs >= 1.15},
    }


def _fmt(v, digits: int = 3, unit: str = "") -> str:
    return "-" if v is None else f"{v:.{digits}f}{unit}"


def _acts(values) -> str:
    return "-" if not values else f"{min(values):g} .. {max(values):g}"


def _stretch(values) -> str:
    return "-" if not values else "/".join(f"{values[k]:.3f}" for k in "FIW" if k in values)


def _prices_text(c: dict) -> str:
    """The bench's prices beyond uniform stages (``chimera.bench.prices``), one sentence."""
    words = [f"the last D-th costs {c['head']:g} D-ths (head)" if c.get("head", 1) != 1 else "",
             f"the first {c['embed']:g} (embedding)" if c.get("embed", 1) != 1 else "",
             f"the last D-th's gradients {c['head_params']:g} D-ths" if c.get("head_params", 1) != 1 else "",
             f"the first D-th's gradients {c['embed_params']:g} D-ths" if c.get("embed_params", 1) != 1 else "",
             f"{c['layers_per_stage']} layers per D-th" if c.get("layers_per_stage", 2) != 2 else "",
             "each placement cut for its own ranks" if c.get("partition") == "cost" else "",
             f"each hop {c['link_ms']:g} ms later" if c.get("link_ms") else "",
             f"a D-th's gradient allreduce {c['allreduce_ms']:g} ms" if c.get("allreduce_ms") else "",
             f"{c['data_parallel']} pipeline copies, every schedule's gradients reduced over them"
             if c.get("data_parallel", 1) != 1 else ""]
    words = [w for w in words if w]
    return (" Priced alike on every row and in every simulated column: " + "; ".join(words) + "."
            if words else "")


def markdown(data: dict) -> str:
    c, res = data["config"], data["results"]
    lat = data.get("latency") or {}
    lines = [f"Emulated stages {c['emulate_ms']} ms (F:I:W per micro-batch per D-th of the model; "
             f"waits {'spinning' if c.get('waits') == 'spin' else 'sleeping'}), "
             f"D={c['stages']}, N={c['micro_batches']}"
             + (f", W={c['data_parallel']} ({c['stages'] * c['data_parallel']} ranks)"
                if c.get("data_parallel", 1) != 1 else "") + f"; measured p2p {1e3 * lat.get('p2p_s', 0):.2f} ms, "
             f"allreduce {1e3 * lat.get('allreduce_s', 0):.2f} ms ({lat.get('how', '')})."
             + _prices_text(c), "",
             "| impl | schedule | median step (s) | min .. max (s) | simulated (s) | free p2p (s) "
             "| realized / simulated | waits took (F/I/W) | realized / simulated at those "
             "| ours / floor | peak activations / rank, measured (Ma) | simulated (Ma) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res:
        lines.append(f"| {r['impl']} | {r['name']} | {r['median_step_s']:.3f} | "
                     f"{r['min_step_s']:.3f} .. {r['max_step_s']:.3f} | {_fmt(r['simulated_step_s'])} | "
                     f"{_fmt(r['simulated_free_s'])} | {_fmt(r['realized_vs_simulated'], 2, 'x')} | "
                     f"{_stretch(r['wait_stretch'])} | {_fmt(r['realized_vs_measured_waits'], 2, 'x')} | "
                     f"{_fmt(r.get('realized_vs_floor'), 2, 'x')} | {_acts(r['peak_activations'])} | {_acts(r['simulated_peak_activations'])} |")
    lines += ["", "Simulated: the row's own order (ours: the lowered schedule the runtime ran; "
              "torch's: the order its schedule object runs) at the nominal waits and the measured "
              "p2p and allreduce times; free p2p: the same with free communication. Waits took: "
              "how much longer each kind of wait ran than asked (sleep overshoot, an artifact of "
              "the emulation, larger on a loaded machine; over all of the row's steps); realized / simulated at those: the "
              "simulation redone with those wait times, so what is left is the runtime's own cost. "
              "Floor rows: our row's schedule through the same runtime (executor, mailbox, "
              "gradient sync) on null-compute stages: one wait per action, exactly its "
              "simulated cost, the same message and gradient bytes, no activation kept, the "
              "runtime's iteration without the API's step. Floor over simulated is what this "
              "machine charges for sleeping, waking and messaging (D ranks on its cores) plus "
              "the executor's own host code per action; ours / floor is the model-side host "
              "work around it (the API's step, the model's layers and autograd nodes, the "
              "activations kept)."]
    s = data["summary"]
    met = {k: "met" if v else "missed" if v is not None else "n/a" for k, v in s["met"].items()}
    over = ", ".join(f"{k} {_fmt(v, 2, 'x')}" for k, v in s["ours_over_1.05x_simulated"].items())
    pairs = ", ".join(f"{k} {_fmt(v, 2, 'x')}" for k, v in s["ours_vs_torch_same_schedule"].items())
    keys = list(met)
    lines += ["", f"- every schedule of ours within 1.05x of its simulated step: {met[keys[0]]}"
                  + (f" (over: {over})" if over else ""),
              f"- ours vs torch's on the same schedule (torch / ours): {pairs or 'n/a'} "
              f"({met[keys[1]]})",
              f"- our best ({s['ours_best']}) vs torch's best ({s['torch_best']}): "
              f"{_fmt(s['ours_best_vs_torch_best'], 2, 'x')} (target >= 1.15x: {met[keys[2]]})"]
    floor = s.get("floor")
    if floor:
        lo, hi = floor["floor_vs_simulated"]
        lines.append(f"- the floor (the same programs through the runtime on null-compute "
                     f"stages) realizes "
                     f"{lo:.2f}x .. {hi:.2f}x of simulated"
                     + (f"; ours is {floor['ours_vs_floor'][0]:.2f}x .. "
                        f"{floor['ours_vs_floor'][1]:.2f}x its floor" if floor["ours_vs_floor"] else ""))
    return "\n".join(lines)


def save(data: dict, raw: dict, rows: list[Row], out_dir: str, name: str) -> list[str]:
    """``name.json/.md/.png`` and one Perfetto trace per row under ``name-traces/``."""
    timelines = {r["impl"] + ":" + r["name"]: r.pop("_timeline") for r in data["results"]}
    paths = report.save(data, out_dir, name, markdown, chart)
    folder = os.path.join(out_dir, f"{name}-traces")
    os.makedirs(folder, exist_ok=True)
    for k, row in enumerate(rows):
        traced = raw["traces"][k] if k < len(raw.get("traces", [])) else None
        if not traced:
            continue
        waits, starts = [t[0] for t in traced], [t[1] for t in traced]
        timeline = timelines.get(row.impl + ":" + _name(row))
        path = os.path.join(folder, re.sub(r"[^A-Za-z0-9_.=-]+", "_", row.id) + ".json")
        with open(path, "w") as f:
            json.dump(trace_events(waits, timeline, starts), f)
        paths.append(path)
    return paths


def chart(data: dict, path: str) -> None:
    """Per row: the measured median (bar, whiskers min..max) over the simulated step (tick)."""
    import matplotlib  # the optional extra chimera-pipeline[plot], imported when a chart is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # (after matplotlib.use)

    res = data["results"][::-1]
    colors = {"chimera": "#1f77b4", "torch": "#ff7f0e", "floor": "#9a9a9a"}
    fig, ax = plt.subplots(figsize=(8, 0.38 * len(res) + 1.6))
    y = list(range(len(res)))
    med = [r["median_step_s"] for r in res]
    err = [[m - r["min_step_s"] for m, r in zip(med, res)], [r["max_step_s"] - m for m, r in zip(med, res)]]
    ax.barh(y, med, xerr=err, color=[colors[r["impl"]] for r in res], capsize=2, height=0.6,
            label="measured (median)")
    sims = [(k, r["simulated_step_s"]) for k, r in enumerate(res) if r["simulated_step_s"]]
    ax.scatter([s for _, s in sims], [k for k, _ in sims], marker="|", s=300, color="black",
               zorder=3, label="simulated (measured p2p)")
    ax.set_yticks(y, [f"{r['impl']}: {r['name']}" + (f"  {r['realized_vs_simulated']:.2f}x"
                                                    if r["realized_vs_simulated"] else "")
                      for r in res], fontsize=8)
    ax.set_xlabel("seconds per step (forward, backward, gradient sync)")
    c = data["config"]
    ax.set_title(f"emulated stages {c['emulate_ms']} ms"
                 + (" (spinning waits)" if c.get("waits") == "spin" else "")
                 + f", D={c['stages']}, N={c['micro_batches']}: "
                 "realized vs simulated", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
