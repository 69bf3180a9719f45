"""Cost model and event simulator (no torch)."""

from chimera.sim.cost import CostModel, Link
from chimera.sim.engine import Deadlock, simulate
from chimera.sim.timeline import Event, RankStats, Timeline

__all__ = ["CostModel", "Deadlock", "Event", "Link", "RankStats", "Timeline", "simulate"]
