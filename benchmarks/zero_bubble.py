"""Zero-bubble schedules side by side, each against the lower bound of its placement.

Usage: python benchmarks/zero_bubble.py [--quick]
Writes out/zero_bubble.{md,png,json} (--out DIR).

1. The main table: 1F1B, ZB-H1, ZB-V, DualPipeV, DualPipe, classic Chimera and chimera-zb at
   D=8, N=16 and D=16, N=64, simulated with F = I = W = 1 (B = 2) and no communication.
2. The priority rules of chimera-zb's list scheduler, each alone, over a grid of shapes and
   costs: the mean and worst excess of the makespan over the lower bound.
3. Robustness: the same schemes under other costs and with a p2p time.
4. (If OR-Tools is installed) what CP-SAT makes of the list schedule on small shapes.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

from chimera.theory.bounds import placement_bound, schedule_bound
from chimera.ir import Placement
from chimera.passes import lower
from chimera.schedules import build
from chimera.schedules.chimera_zb import AUTO, RESERVES, RULES, op_times, play
from chimera.sim import CostModel, simulate
from chimera.check.validate import validate

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from outdir import out_dir  # noqa: E402  (--out DIR, default out/)

OUT = os.path.join(out_dir(), "zero_bubble")
UNIT = CostModel.unit(1, i=1, w=1)  # F = I = W = 1, so B = 2 for schemes that do not split it
ROWS = [("1f1b", "1f1b", {}), ("zb-h1", "zb-h1", {}), ("zb-v", "zb-v", {}),
        ("dualpipev", "dualpipev", {}), ("dualpipe", "dualpipe", {}),
        ("chimera (direct)", "chimera", {}), ("chimera-zb", "chimera-zb", {}),
        ("chimera-zb cap D+1", "chimera-zb", {"cap": +1})]
COSTS = {"F=I=W": UNIT, "B=F (I=W=F/2)": CostModel.unit(1, 1),
         "I=2F, W=F": CostModel.unit(1, i=2, w=1), "I=1.5F, W=F/2": CostModel.unit(1, i=1.5, w=0.5),
         "F=I=W, p2p 0.2": CostModel.unit(1, i=1, w=1, p2p_time=0.2)}


def measure(name: str, d: int, n: int, opts: dict, cost: CostModel) -> dict:
    opts = {k: (d + v if k == "cap" else v) for k, v in opts.items()}
    if name == "chimera-zb":
        opts["cost"] = cost
    schedule = validate(lower(build(name, d, n, **opts)))
    timeline = simulate(schedule, cost)
    bound = schedule_bound(schedule, cost)
    acts = [r.peak_activations for r in timeline.ranks]
    return {"scheme": name, "D": d, "N": n, "options": {k: v for k, v in opts.items() if k != "cost"},
            "makespan": timeline.makespan, "bubble": timeline.bubble_ratio,
            "bound_makespan": bound.makespan, "bound_bubble": bound.bubble,
            "act_min": min(acts), "act_max": max(acts),
            "weights": max(r.weights for r in timeline.ranks),
            "rule": schedule.params.get("rule"), "timeline": timeline}


def main_table(shapes) -> tuple[list[dict], str]:
    rows, lines = [], ["| scheme | D, N | bubble | lower bound (its placement) | makespan "
                       "| activations / rank (Ma) | max/min | weights / rank (Mθ) |",
                       "|---|---|---|---|---|---|---|---|"]
    for d, n in shapes:
        for label, name, opts in ROWS:
            r = measure(name, d, n, opts, UNIT)
            r["label"] = label
            rows.append(r)
            lines.append(f"| {label} | {d}, {n} | {r['bubble']:.1%} | {r['bound_bubble']:.1%} | "
                         f"{r['makespan']:g} | {r['act_min']:g} .. {r['act_max']:g} | "
                         f"{r['act_max'] / r['act_min']:.2f} | {r['weights']:g} |")
    return rows, "\n".join(lines)


def rule_table(quick: bool) -> tuple[dict, str]:
    """Each variant alone over shapes x costs: excess of the makespan over the bound."""
    shapes = [(d, n) for d in (4, 8, 16) for n in sorted({2, 3, d + 1, 2 * d, 2 * d + 3, 4 * d})]
    if quick:
        shapes = [s for s in shapes if s[0] <= 8]
    variants = [f"{r}/{v}" for r in RULES for v in RESERVES]
    gaps: dict[str, list[float]] = {v: [] for v in variants + ["auto"]}
    for cost in COSTS.values():
        for d, n in shapes:
            placement, micro_pipe = Placement.chimera(d, 2), tuple(m % 2 for m in range(n))
            times = op_times(cost, d, d)
            bound = placement_bound(placement, micro_pipe, cost).makespan
            spans = {v: play(placement, micro_pipe, times, d, v)[1] for v in variants}
            for v, span in spans.items():
                gaps[v].append(span / bound - 1)
            gaps["auto"].append(min(spans[v] for v in AUTO) / bound - 1)
    lines = [f"{len(shapes)} shapes (D in {sorted({d for d, _ in shapes})}, N from 2 to 4D, odd ones "
             f"included) x {len(COSTS)} costs ({', '.join(COSTS)}); cap D; gap = makespan / lower "
             f"bound - 1.", "",
             "| rule / reserve | mean gap | worst gap | at the bound |", "|---|---|---|---|"]
    for v, g in sorted(gaps.items(), key=lambda kv: statistics.mean(kv[1])):
        name = f"**auto** = {' + '.join(AUTO)}" if v == "auto" else v
        lines.append(f"| {name} | {statistics.mean(g):.2%} | {max(g):.1%} | "
                     f"{sum(x < 1e-9 for x in g)}/{len(g)} |")
    return {v: statistics.mean(g) for v, g in gaps.items()}, "\n".join(lines)


def cost_table(shapes) -> tuple[list[dict], str]:
    schemes = [("zb-v", "zb-v", {}), ("dualpipev", "dualpipev", {}), ("dualpipe", "dualpipe", {}),
               ("chimera-zb", "chimera-zb", {}), ("chimera-zb cap D+1", "chimera-zb", {"cap": +1})]
    lines = ["| costs | D, N | " + " | ".join(label for label, _, _ in schemes)
             + " | lower bound (Chimera placement) |", "|---|---|" + "---|" * (len(schemes) + 1)]
    out = []
    for label, cost in COSTS.items():
        for d, n in shapes:
            cells = []
            for scheme, name, opts in schemes:
                r = measure(name, d, n, opts, cost)
                cells.append(f"{r['bubble']:.1%} ({r['act_max']:g} Ma)")
                out.append({"costs": label, "label": scheme,
                            **{k: v for k, v in r.items() if k != "timeline"}})
            bound = out[-1]["bound_bubble"]
            lines.append(f"| {label} | {d}, {n} | " + " | ".join(cells) + f" | {bound:.1%} |")
    return out, "\n".join(lines)


def exact_table() -> str:
    from chimera.schedules import exact

    if not exact.available():
        return "OR-Tools is not installed here (`pip install 'chimera-pipeline[exact]'`): skipped."
    lines = ["| costs | D, N | lower bound | list scheduler | CP-SAT (5 s) | proven optimal |",
             "|---|---|---|---|---|---|"]
    for label, cost in COSTS.items():
        for d, n in [(4, 5), (4, 8), (8, 16)]:
            placement, micro_pipe = Placement.chimera(d, 2), tuple(m % 2 for m in range(n))
            times = op_times(cost, d, d)
            hint, span = min((play(placement, micro_pipe, times, d, v) for v in AUTO),
                             key=lambda x: x[1])
            _, exact_span, optimal = exact.refine(placement, micro_pipe, times, d, hint,
                                                  seconds=5, workers=2)
            bound = placement_bound(placement, micro_pipe, cost).makespan
            lines.append(f"| {label} | {d}, {n} | {bound:g} | {span:g} | {exact_span:g} | {optimal} |")
    return "\n".join(lines)


def picture(rows: list[dict], path: str, width_px: int = 1800) -> None:
    """One Gantt chart per scheme (chimera.viz.save_gantt_png), stacked into one PNG: every
    chart at the same height per rank, so half-size stages (V placements) come out wider."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.image import imread
    from PIL import Image  # matplotlib's own dependency

    from chimera.viz import save_gantt_png

    with tempfile.TemporaryDirectory() as tmp:
        images = [imread(save_gantt_png(r["timeline"], os.path.join(tmp, f"{i}.png"),
                                        title=f"{r['label']}: lower bound {r['bound_bubble']:.1%}"))
                  for i, r in enumerate(rows)]
        width = max(im.shape[1] for im in images)
        height = sum(im.shape[0] for im in images)
        fig = Figure(figsize=(width / 100, height / 100), dpi=100)
        FigureCanvasAgg(fig)
        top = height
        for im in images:
            top -= im.shape[0]
            ax = fig.add_axes((0, top / height, im.shape[1] / width, im.shape[0] / height))
            ax.imshow(im)
            ax.axis("off")
        big = os.path.join(tmp, "all.png")
        fig.savefig(big, facecolor="white")
        with Image.open(big) as img:
            small = img.convert("RGB").resize((width_px, round(height * width_px / width)), Image.LANCZOS)
            small.quantize(colors=96).save(path, optimize=True)


def main() -> None:
    quick = "--quick" in sys.argv
    start = time.time()
    shapes = [(8, 16)] if quick else [(8, 16), (16, 64)]
    rows, table = main_table(shapes)
    rule_means, rules = rule_table(quick)
    robust, costs = cost_table(shapes)
    exact = exact_table() if not quick else "skipped (--quick)"
    text = "\n".join([
        "# Zero-bubble schedules against the lower bound", "",
        "Simulated with F = I = W = 1 (B = 2 where backward is not split), no communication. "
        "Lower bound: `chimera simulate --bound` (first input arrival on the latest-starting rank "
        "plus the mirror tail; `chimera.theory.bounds`).", "", table, "",
        "## chimera-zb priority rules", "", rules, "",
        "## Other costs (bubble, peak activations per rank)", "", costs, "",
        "## CP-SAT refinement", "",
        "`chimera.schedules.exact.refine` from the best list schedule, 5 s and 2 workers per shape "
        "(`pip install 'chimera-pipeline[exact]'`); a time-limited search, so these figures vary "
        "with the machine.", "", exact, "",
        f"Reproduce: `python benchmarks/zero_bubble.py` ({time.time() - start:.0f} s here).", ""])
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT + ".md", "w") as f:
        f.write(text)
    picture([r for r in rows if r["D"] == 8], OUT + ".png")
    with open(OUT + ".json", "w") as f:
        json.dump({"main": [{k: v for k, v in r.items() if k != "timeline"} for r in rows],
                   "rules_mean_gap": rule_means, "costs": robust}, f, indent=1)
    print(text)
    print(f"wrote {OUT}.md, {OUT}.png, {OUT}.json")


if __name__ == "__main__":
    main()
