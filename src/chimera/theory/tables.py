"""The README's scheme table: simulated bubbles and memory beside the paper's formulas."""

from __future__ import annotations

from chimera.theory.formulas import closed_form
from chimera.ir import ScheduleError
from chimera.passes import lower
from chimera.schedules import build, get_scheme
from chimera.sim import CostModel, simulate

# (scheme, options) in the README's order; each row is labelled by the registry (`chimera Q=4`)
ROWS = [
    ("gpipe", {}),
    ("1f1b", {}),
    ("interleaved", {"chunks": 2}),
    ("zb-h1", {}),
    ("gems", {}),
    ("chimera", {"strategy": "direct"}),
    ("chimera", {"strategy": "doubling"}),
    ("chimera", {"strategy": "halving"}),
    ("chimera", {"pipes": 4}),
    ("zb-v", {}),
    ("dualpipev", {}),
    ("dualpipe", {}),
    ("chimera-zb", {}),
]


def scheme_rows(d: int, n: int) -> list[dict]:
    """One dict per scheme: bubble at equal F/B (or F=I=W) and at B=2F, memory, formulas."""
    out = []
    for name, opts in ROWS:
        label = get_scheme(name).label(opts)
        try:
            schedule = lower(build(name, d, n, **opts))
        except ScheduleError as exc:  # this D, N is not one the scheme takes
            out.append({"label": label, "error": str(exc)})
            continue
        split = schedule.split_backward
        equal = simulate(schedule, CostModel.unit(1, i=1, w=1) if split else CostModel.unit(1, 1))
        heavy = simulate(schedule, CostModel.unit(1, i=1, w=1) if split else CostModel.unit(1, 2))
        form = closed_form(name, d, n, **opts)
        acts = [r.peak_activations for r in equal.ranks]
        out.append({
            "label": label, "bubble_equal": equal.bubble_ratio, "bubble_b2f": heavy.bubble_ratio,
            "formula": form.bubble_text if form else "-",
            "formula_value": form.bubble if form else None,
            "act_min": min(acts), "act_max": max(acts),
            "act_formula": form.activations_text if form else "-",
            "weights": max(r.weights for r in equal.ranks),
            "equal_cost": "1:1:1" if split else "1:1",
        })
    return out


def scheme_table(d: int, n: int) -> str:
    """Markdown table for D, N."""
    lines = [
        f"Simulated at D={d}, N={n} (`chimera simulate`); bubble = 1 - busy/(D·makespan).",
        "",
        "| scheme | bubble, F=B (F=I=W) | paper formula | formula value | bubble, B=2F "
        "| activations / rank (Ma) | paper | weights / rank (Mθ) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in scheme_rows(d, n):
        if "error" in r:
            lines.append(f"| {r['label']} | n/a: {r['error']} | | | | | | |")
            continue
        value = f"{r['formula_value']:.1%}" if r["formula_value"] is not None else "-"
        lines.append(
            f"| {r['label']} | {r['bubble_equal']:.1%} | {r['formula']} | {value} | "
            f"{r['bubble_b2f']:.1%} | {r['act_min']:g} .. {r['act_max']:g} | {r['act_formula']} | "
            f"{r['weights']:g} |")
    return "\n".join(lines)
