"""Pictures of schedules and timelines: text grid, PNG Gantt chart, Chrome/Perfetto trace.

No torch; matplotlib is imported only inside :func:`save_gantt_png`.
"""

from chimera.viz.gantt import save_gantt_png
from chimera.viz.grid import cell_label, render_grid, render_programs
from chimera.sim.trace import chrome_trace, load_trace_events, save_trace

__all__ = [
    "cell_label", "chrome_trace", "load_trace_events", "render_grid", "render_programs",
    "save_gantt_png", "save_trace",
]
