"""PNG Gantt chart of a timeline (matplotlib, imported only when a chart is drawn).

One lane per rank, rank 0 on top. Compute boxes take the colour of their pipe (of their
chunk where one pipe puts several stages on a rank: V and interleaved placements, whose two
stages of a rank must not look alike) and a shade per op: F light, B dark, I medium, W light and hatched; the micro-batch number is written
inside when it fits. Bubbles are the light-grey lane background left showing. Allreduces
(``timeline.collectives``) are a thin dark strip under the lane, p2p events optional thin
lines at the top of the lane.
"""

from __future__ import annotations

from pathlib import Path

from chimera.ir import Op
from chimera.sim.timeline import Timeline

# tab10 minus grey/olive: distinguishable, and pipe 0 blue / pipe 1 orange as in the paper
PIPE_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728",
               "#9467bd", "#8c564b", "#e377c2", "#17becf")
_LIGHTEN = {Op.F: 0.55, Op.B: 0.0, Op.I: 0.28, Op.W: 0.55}
_BOX = (0.10, 0.62)  # (offset from lane top, height) of a compute box, in lane units
_STRIP = (0.76, 0.12)  # allreduce strip under the boxes
_LANE_BG, _STRIP_COLOR, _COMM_COLOR = "#ececec", "#444444", "#7f7f7f"
_DPI = 110


def save_gantt_png(timeline: Timeline, path, title: str | None = None,
                   comm: bool = False) -> Path:
    """Draw the timeline and write it as a PNG at ``path``; returns the path."""
    # matplotlib (the optional extra [plot]) is imported here and below, when a chart is drawn
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # no global backend switch
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=_figsize(timeline), dpi=_DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    _draw_lanes(ax, timeline)
    _draw_compute(ax, timeline, fig)
    _draw_collectives(ax, timeline)
    if comm:
        _draw_comm(ax, timeline)
    _style_axes(ax, timeline, _title(timeline, title))
    _legend(ax, timeline, comm, fig)
    fig.savefig(path, bbox_inches="tight", facecolor="white")
    return path


# -- layout -------------------------------------------------------------------------------
def _slots(timeline: Timeline) -> float:
    """Makespan in median-compute-event units: how many boxes fit side by side (the median,
    not the shortest: a measured step's few tiny events would stretch the chart)."""
    durations = sorted(e.duration for e in timeline.compute_events() if e.duration > 0)
    typical = durations[len(durations) // 2] if durations else max(timeline.makespan, 1e-12)
    return timeline.makespan / typical


def _figsize(timeline: Timeline) -> tuple[float, float]:
    """Wide enough for the boxes, at most 18 x 14 in; never flatter than 5:1, whose labels
    shrink to nothing once the PNG is shown at a page's width."""
    height = min(14.0, max(3.4, 1.4 + 0.6 * timeline.schedule.ranks))
    width = min(18.0, 5.0 * height, max(8.0, 2.0 + 0.24 * _slots(timeline)))
    return width, height


def _title(timeline: Timeline, title: str | None) -> str:
    s = timeline.schedule
    facts = (f"{s.name}   D={s.ranks}   N={s.micro_batches}   "
             f"bubble ratio {timeline.bubble_ratio * 100:.1f}%   "
             f"makespan {timeline.makespan:.4g} {_plural(timeline.unit)}")
    return f"{title}\n{facts}" if title else facts


def _plural(unit: str) -> str:
    return "units" if unit == "unit" else unit


def _lighten(color: str, amount: float) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb  # optional extra: see save_gantt_png

    return tuple(c + (1.0 - c) * amount for c in to_rgb(color))


def _pipe_color(pipe: int) -> str:
    return PIPE_COLORS[pipe % len(PIPE_COLORS)]


def _by_chunk(timeline: Timeline) -> bool:
    """One pipe holding several stages a rank (V, interleaved): colour by chunk, not pipe."""
    placement = timeline.schedule.placement
    return placement.pipes == 1 and placement.stages > timeline.schedule.ranks


def _color_key(timeline: Timeline, action) -> int:
    """What a box's colour stands for: its pipe, or its chunk (stage // ranks)."""
    return action.stage // timeline.schedule.ranks if _by_chunk(timeline) else action.pipe


# -- drawing ------------------------------------------------------------------------------
def _draw_lanes(ax, timeline: Timeline) -> None:
    for rank in range(timeline.schedule.ranks):
        ax.broken_barh([(0, timeline.makespan)], (rank + _BOX[0], _BOX[1]),
                       facecolors=_LANE_BG, edgecolors="none", zorder=0)


def _draw_compute(ax, timeline: Timeline, fig) -> None:
    pts_per_unit = _points_per_unit(timeline, fig)
    fontsize = 8 if timeline.schedule.ranks <= 8 else 7
    for event in timeline.compute_events():
        action = event.action
        base = _pipe_color(_color_key(timeline, action))
        face = _lighten(base, _LIGHTEN[action.op])
        ax.broken_barh([(event.start, event.duration)], (event.rank + _BOX[0], _BOX[1]),
                       facecolors=[face], edgecolors="white", linewidth=0.8,
                       hatch="////" if action.op is Op.W else None, zorder=2)
        label = str(action.micro)
        if event.duration * pts_per_unit >= 0.62 * fontsize * len(label) + 3:
            ink = "white" if action.op is Op.B else "#1a1a1a"
            ax.text(event.start + event.duration / 2, event.rank + _BOX[0] + _BOX[1] / 2,
                    label, ha="center", va="center", fontsize=fontsize, color=ink, zorder=3)


def _points_per_unit(timeline: Timeline, fig) -> float:
    """Approximate width in points of one time unit (axes span about 88% of the figure)."""
    return fig.get_figwidth() * 72 * 0.88 / max(timeline.makespan, 1e-12)


def _draw_collectives(ax, timeline: Timeline) -> None:
    for rank, _stage, start, end in timeline.collectives:
        ax.broken_barh([(start, end - start)], (rank + _STRIP[0], _STRIP[1]),
                       facecolors=_STRIP_COLOR, edgecolors="none", zorder=2)


def _draw_comm(ax, timeline: Timeline) -> None:
    for event in timeline.events:
        if event.action.op.is_compute or event.action.op in (Op.SYNC, Op.STEP):
            continue
        y = event.rank + 0.05
        if event.duration > 0:
            ax.hlines(y, event.start, event.end, colors=_COMM_COLOR, linewidth=1.2, zorder=1)
        else:
            ax.vlines(event.start, y - 0.03, y + 0.03, colors=_COMM_COLOR, linewidth=0.8)


def _style_axes(ax, timeline: Timeline, title: str) -> None:
    ranks = timeline.schedule.ranks
    ax.set_ylim(ranks, 0)
    ax.set_yticks([r + _BOX[0] + _BOX[1] / 2 for r in range(ranks)])
    ax.set_yticklabels([f"P{r}" for r in range(ranks)])
    ax.set_xlim(0, timeline.makespan * 1.005)
    ax.set_xlabel(f"time ({timeline.unit})")
    ax.set_title(title, fontsize=11, loc="left")
    ax.tick_params(axis="y", length=0)
    ax.grid(axis="x", color="#d0d0d0", linewidth=0.5, zorder=-1)
    ax.set_axisbelow(True)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)


def _pipe_name(timeline: Timeline, pipe: int) -> str:
    placement = timeline.schedule.placement
    table = placement.table
    if len(table) < 2 or len(table[pipe]) < 2:
        return f"pipe {pipe}"
    if placement.style == "chimera":  # down and up pipes alternate (shifted copies when Q > 2)
        return f"pipe {pipe} ({'down' if pipe % 2 == 0 else 'up'})"
    step = (table[pipe][1] - table[pipe][0]) % timeline.schedule.ranks
    direction = {1: " (down)", timeline.schedule.ranks - 1: " (up)"}.get(step, "")
    return f"pipe {pipe}{direction}"


def _chunk_name(timeline: Timeline, chunk: int) -> str:
    d = timeline.schedule.ranks
    direction = ""
    if timeline.schedule.placement.style == "v":
        direction = " (down)" if chunk == 0 else " (up)"
    return f"stages {chunk * d}-{chunk * d + d - 1}{direction}"


def _legend(ax, timeline: Timeline, comm: bool, fig) -> None:
    # optional extra: see save_gantt_png
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    keys = sorted({_color_key(timeline, e.action) for e in timeline.compute_events()})
    name = _chunk_name if _by_chunk(timeline) else _pipe_name
    handles = [Patch(facecolor=_pipe_color(k), label=name(timeline, k)) for k in keys]
    ops = [op for op in (Op.F, Op.B, Op.I, Op.W)
           if any(e.action.op is op for e in timeline.compute_events())]
    grey = "#555555"
    for op in ops:
        handles.append(Patch(facecolor=_lighten(grey, _LIGHTEN[op]), edgecolor=grey,
                             hatch="////" if op is Op.W else None, label=_OP_LABELS[op]))
    handles.append(Patch(facecolor=_LANE_BG, edgecolor="#bbbbbb", label="bubble"))
    if timeline.collectives:
        handles.append(Patch(facecolor=_STRIP_COLOR, label="allreduce"))
    if comm:
        handles.append(Line2D([], [], color=_COMM_COLOR, linewidth=1.2, label="p2p"))
    below_xlabel = -0.42 / (fig.get_figheight() * 0.77)  # axes fraction, ~0.42 in down
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, below_xlabel),
              ncol=min(len(handles), 8), frameon=False, fontsize=9, handlelength=1.6)


_OP_LABELS = {Op.F: "forward", Op.B: "backward", Op.I: "input grad", Op.W: "weight grad"}
