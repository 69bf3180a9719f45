"""When does the bidirectional placement pay? Each regime's best of ours against torch's best.

A regime is a set of the bench's prices (:mod:`chimera.bench.prices`): balanced stages, a
heavier LM head (under both cuts), a slow link (with and without a memory cap of D
micro-batches), Chimera's replica allreduce (W=1) and every schedule's data-parallel one
(W=2), the large ones also with the optimizer sharded, and a head heavy in gradients too.
Per regime, every row of the bench, ours and torch's (:func:`chimera.bench.rows.all_rows`;
torch's each in its own ``pipeline_order``, :mod:`chimera.bench.torch_orders`) is simulated at the same prices as the bench's simulated
column; the table gives the best of each side, its schedule, and best torch / best ours.
Realized columns come from ``chimera bench --emulate`` runs of the same prices
(:func:`realize`; W=2: ``--data-parallel 2``, two copies of every row's pipeline).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass

from chimera.bench import prices
from chimera.bench.emulated import is_sharded, our_schedule, simulated
from chimera.bench.report import row_name
from chimera.bench.rows import BenchConfig, all_rows
from chimera.bench.torch_orders import torch_order

NOT_MEASURED = "not measured yet"
_NO_LINK = {"p2p_s": 0.0, "allreduce_s": 0.0}


@dataclass(frozen=True)
class Regime:
    label: str
    prices: tuple[tuple[str, object], ...] = ()  # BenchConfig fields
    cap: bool = False  # only schedules that keep at most D micro-batches' activations a rank

    def config(self, base: BenchConfig) -> BenchConfig:
        return dataclasses.replace(base, **dict(self.prices))


def regimes(f_ms: float, stages: int, micro_batches: int) -> list[Regime]:
    """The issue's rows: F is the forward of a micro-batch on a D-th (``f_ms``), an allreduce
    of 0.5 and 2 F*N/D per D-th of the gradients."""
    out = [Regime("balanced")]
    for head in (1.5, 2.0):
        for part in ("layers", "cost"):
            out.append(Regime(f"head {head:g}x, {'same layers per stage' if part == 'layers' else 'cut by cost'}",
                              (("head", head), ("partition", part))))
    for hop in (0.2, 1.0):
        for cap in (False, True):
            out.append(Regime(f"link {hop:g} F{', memory cap D' if cap else ''}",
                              (("link_ms", hop * f_ms),), cap))
    unit = f_ms * micro_batches / stages
    for w, what in ((1, "replica"), (2, "data-parallel W=2")):
        for k in (0.5, 2.0):
            out.append(Regime(f"{what} allreduce {k:g} F*N/D",
                              (("allreduce_ms", k * unit), ("data_parallel", w))))
    # the same large gradients with the optimizer sharded over each stage's group (ours:
    # ZeRO-1; torch's at W=2: its FSDP-like counterpart), both sides also unsharded
    for w, what in ((1, "replica"), (2, "data-parallel W=2")):
        out.append(Regime(f"{what} allreduce 2 F*N/D, sharded optimizer",
                          (("allreduce_ms", 2.0 * unit), ("data_parallel", w),
                           ("shard_optimizer", True))))
    # an LM head heavy in compute and in gradients: its bytes land on the ranks that hold
    # the last stage (Chimera's two, V's rank 0 beside the embedding)
    out.append(Regime("head 1.5x with its gradients, data-parallel W=2 allreduce 0.5 F*N/D",
                      (("head", 1.5), ("head_params", 1.5), ("allreduce_ms", 0.5 * unit),
                       ("data_parallel", 2))))
    return out


def simulate_regime(regime: Regime, base: BenchConfig) -> dict:
    """Every schedule of both sides at the regime's prices, the bench's rows
    (:func:`chimera.bench.rows.all_rows`: with ``shard_optimizer``, the sharded variants
    too): {side: {name: (step s, peak Ma)}}; side ``bidirectional``: ours on two weight
    copies (Chimera's placement: chimera, chimera-zb, DualPipe), the placement the table is
    about."""
    cfg = regime.config(base)
    sides: dict[str, dict[str, tuple[float, float]]] = {"ours": {}, "bidirectional": {}, "torch": {}}
    for row in all_rows(cfg):
        if row.impl not in ("chimera", "torch"):
            continue
        try:
            schedule = (our_schedule(cfg, row) if row.impl == "chimera"
                        else torch_order(row.schedule, cfg.stages, cfg.micro_batches))
        except Exception:  # noqa: BLE001 -- a scheme that does not run at this (D, N)
            continue
        name = row_name({"impl": row.impl, "schedule": row.schedule, "options": row.opts})
        side = sides["ours" if row.impl == "chimera" else "torch"]
        side[name] = _priced(schedule, cfg, is_sharded(row))
        if row.impl == "chimera" and len(schedule.placement.replicas(0)) > 1:
            sides["bidirectional"][name] = side[name]  # two weight copies: bidirectional
    return sides


def _priced(schedule, cfg: BenchConfig, sharded: bool = False) -> tuple[float, float]:
    sim = simulated(schedule, cfg, _NO_LINK, sharded=sharded)
    return sim["simulated_step_s"], max(sim["simulated_peak_activations"])


def best(side: dict[str, tuple[float, float]], cap: float | None) -> tuple[str, float] | None:
    """The fastest schedule of a side (under an activation cap in Ma per rank, if any)."""
    eligible = [(t, name) for name, (t, peak) in side.items() if cap is None or peak <= cap + 1e-9]
    if not eligible:
        return None
    t, name = min(eligible)
    return name, t


def table(base: BenchConfig) -> list[dict]:
    """One dict per regime: simulated best of each side, their ratio (torch / ours)."""
    rows = []
    for regime in regimes(base_forward_ms(base), base.stages, base.micro_batches):
        sides = simulate_regime(regime, base)
        cap = float(base.stages) if regime.cap else None
        ours, theirs = best(sides["ours"], cap), best(sides["torch"], cap)
        bidi = best(sides["bidirectional"], cap)
        rows.append({"regime": regime.label, "prices": dict(regime.prices), "cap": regime.cap,
                     "ours": ours, "bidirectional": bidi,
                     "torch": theirs,
                     "simulated_ratio": theirs[1] / ours[1] if ours and theirs else None,
                     "bidirectional_ratio": theirs[1] / bidi[1] if bidi and theirs else None,
                     "all": sides, "realized": None})
    return rows


def base_forward_ms(cfg: BenchConfig) -> float:
    return float(cfg.emulate.split(":")[0])


def bench_command(base: BenchConfig, regime: Regime, quick: bool) -> list[str]:
    """The ``chimera bench`` command that realizes ``regime``."""
    cfg = regime.config(base)
    words = ["chimera", "bench", "--emulate", cfg.emulate, "-D", str(cfg.stages), "-N",
             str(cfg.micro_batches), "--rows", "chimera,torch"]
    for flag, key, default in prices.FLAGS:
        if getattr(cfg, key) != default:
            value = getattr(cfg, key)
            words += [flag, f"{value:g}" if isinstance(default, float) else str(value)]
    words += ["--shard-optimizer"] if cfg.shard_optimizer else []
    return words + (["--quick"] if quick else [])


def realize(rows: list[dict], base: BenchConfig, quick: bool, out: str) -> None:
    """Run the bench for every regime (one after another: a quiet machine) and fill each
    row's realized best of each side from the run's medians."""
    runs: dict[tuple, dict] = {}
    for row, regime in zip(rows, regimes(base_forward_ms(base), base.stages, base.micro_batches)):
        words = bench_command(base, regime, quick)
        key = tuple(words)
        if key not in runs:  # the capped rows reuse the uncapped run
            done = subprocess.run([sys.executable, "-m", "chimera", *words[1:], "--json", "--out", out],
                                  capture_output=True, text=True, check=True)
            runs[key] = json.loads(done.stdout)
        results = runs[key]["results"]
        cap = float(base.stages) if regime.cap else None
        sides = {}
        for side, impl in (("ours", "chimera"), ("torch", "torch")):
            measured = {r["name"]: (r["median_step_s"], max(r["simulated_peak_activations"] or [0]))
                        for r in results if r["impl"] == impl}
            sides[side] = best(measured, cap)
        ours, theirs = sides["ours"], sides["torch"]
        row["realized"] = {"ours": ours, "torch": theirs,
                           "ratio": theirs[1] / ours[1] if ours and theirs else None,
                           "command": " ".join(words)}


def markdown(rows: list[dict], base: BenchConfig, short: bool = False) -> str:
    """The regime table; ``short``: the README's (simulated ratios and the realized one)."""
    if short:
        lines = ["| regime | best bidirectional (ours) | best torch | torch / bidirectional "
                 "| best of ours | torch / ours | realized torch / ours |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            real = r["realized"]
            lines.append(f"| {r['regime']} | {_cell(r['bidirectional'])} | {_cell(r['torch'])} | "
                         f"{_ratio(r['bidirectional_ratio'])} | {_cell(r['ours'])} | "
                         f"{_ratio(r['simulated_ratio'])} | {(real and _ratio(real['ratio'])) or NOT_MEASURED} |")
        return "\n".join(lines)
    lines = ["| regime | simulated: best bidirectional (ours) | best of ours | best torch "
             "| torch / bidirectional | torch / ours | realized: best ours | best torch "
             "| torch / ours |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        real = r["realized"]
        cells = ([_cell(real["ours"]), _cell(real["torch"]), _ratio(real["ratio"])] if real
                 else [NOT_MEASURED, "", ""])
        lines.append(f"| {r['regime']} | {_cell(r['bidirectional'])} | {_cell(r['ours'])} | "
                     f"{_cell(r['torch'])} | {_ratio(r['bidirectional_ratio'])} | "
                     f"{_ratio(r['simulated_ratio'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(best_of: tuple[str, float] | None) -> str:
    return "-" if best_of is None else f"{best_of[0]} {best_of[1]:.3f} s"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def write(rows: list[dict], base: BenchConfig, out: str) -> list[str]:
    stem = os.path.join(out, f"regimes-D{base.stages}-N{base.micro_batches}")
    data = {"config": base.to_dict(), "rows": rows}
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1, default=list)
    with open(stem + ".md", "w") as f:
        f.write(markdown(rows, base) + "\n")
    return [stem + ".json", stem + ".md"]
