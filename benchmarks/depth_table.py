"""The README's depth table and picture, from the results of `chimera bench --emulate`.

    chimera bench --emulate 20:20:20 -D 4 -N 8 --quick
    chimera bench --emulate 20:20:20 -D 8 -N 16 --quick
    python benchmarks/depth_table.py          # -> out/depth.{md,png}

(all three with --out/--results benchmarks/results rewrite the committed figures).

One row per schedule: its simulated step (the row's own order at 20 ms per F, I and W and
the measured p2p latency), the floor (our program with only its waits and messages) over
simulated, ours and torch's measured medians, and realized / simulated for each, at D=4 N=8
and D=8 N=16.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# schedule label -> (our row, torch's row); None where one side has no such schedule
ROWS = {
    "GPipe": ("gpipe", "gpipe"), "1F1B": ("1f1b", "1f1b"),
    "Interleaved 1F1B (v=2)": ("interleaved", "interleaved"),
    "Interleaved zero bubble": (None, "interleaved-zb"), "ZB-H1": ("zb-h1", None),
    "ZB-V": ("zb-v", "zbv"), "DualPipeV": ("dualpipev", "dualpipev"), "DualPipe": ("dualpipe", None),
    "Chimera (direct)": ("chimera", None), "Chimera (forward doubling)": ("chimera:doubling", None),
    "chimera-zb": ("chimera-zb", None),
}


def _find(results: list[dict], impl: str, name: str | None) -> dict | None:
    if name is None:
        return None
    schedule, _, option = name.partition(":")
    for r in results:
        opts = r["options"]
        if r["impl"] == impl and r["schedule"] == schedule and \
                (option in opts.values() if option else not any(v == "doubling" for v in opts.values())):
            return r
    return None


def _cell(r: dict | None, key: str, fmt: str) -> str:
    return "-" if r is None or r.get(key) is None else format(r[key], fmt)


def table(runs: dict[str, dict]) -> tuple[str, list]:
    head = "| schedule |" + "".join(
        f" {k}: simulated (s) | floor / simulated | ours (s) | ours / simulated | torch (s) "
        "| torch / simulated |" for k in runs)
    lines = [head, "|---|" + "---|" * 6 * len(runs)]
    points = []
    for label, (ours, theirs) in ROWS.items():
        cells = []
        for key, data in runs.items():
            o, t = _find(data["results"], "chimera", ours), _find(data["results"], "torch", theirs)
            floor = _find(data["results"], "floor", ours)
            sim = (o or t or {}).get("simulated_step_s")
            cells += [_cell(o or t, "simulated_step_s", ".3f"),
                      _cell(floor, "realized_vs_simulated", ".2f"), _cell(o, "median_step_s", ".3f"),
                      _cell(o, "realized_vs_simulated", ".2f"), _cell(t, "median_step_s", ".3f"),
                      _cell(t, "realized_vs_simulated", ".2f")]
            points.append((key, label, sim, o and o["median_step_s"], t and t["median_step_s"],
                           floor and floor["median_step_s"]))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines), points


def picture(points: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys(p[0] for p in points))
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4.6), sharey=True)
    for ax, key in zip(axes if len(keys) > 1 else [axes], keys):
        rows = [p for p in points if p[0] == key and p[2]]
        y = range(len(rows))
        ax.barh([k + 0.2 for k in y], [p[3] or 0 for p in rows], height=0.38, color="#1f77b4",
                label="ours (measured)")
        ax.barh([k - 0.2 for k in y], [p[4] or 0 for p in rows], height=0.38, color="#ff7f0e",
                label="torch.distributed.pipelining (measured)")
        ax.scatter([p[2] for p in rows], list(y), marker="|", s=500, color="black", zorder=3,
                   label="simulated")
        floors = [(k, p[5]) for k, p in enumerate(rows) if p[5]]
        ax.scatter([f for _, f in floors], [k + 0.2 for k, _ in floors], marker="x", s=40,
                   color="#555555", zorder=4, label="floor: our program, waits and messages only")
        ax.set_yticks(list(y), [p[1] for p in rows], fontsize=9)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("seconds per step (20 ms per F, I, W per D-th of the model)")
    handles, labels = (axes[0] if len(keys) > 1 else axes).get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Emulated accelerators: realized vs simulated step, ours and torch's", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default="out", help="where chimera bench --emulate wrote "
                   "(its --out; default out) and where depth.{md,png} go")
    p.add_argument("--runs", default="D4-N8,D8-N16")
    args = p.parse_args()
    runs = {}
    for run in args.runs.split(","):
        path = os.path.join(args.results, f"bench-emulated-{run}.json")
        if not os.path.exists(path):
            print(f"depth_table: {path} is missing: run `chimera bench --emulate 20:20:20 "
                  f"-{run.replace('-', ' -').replace('D', 'D ').replace('N', 'N ')} --quick` first",
                  file=sys.stderr)
            return 1
        with open(path) as f:
            runs[run.replace("-", " ")] = json.load(f)
    text, points = table(runs)
    print(text)
    with open(os.path.join(args.results, "depth.md"), "w") as f:
        f.write(text + "\n")
    picture(points, os.path.join(args.results, "depth.png"))
    print(f"wrote {os.path.join(args.results, 'depth.md')}, {os.path.join(args.results, 'depth.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
