"""Moved to ``chimera.sim.trace``; this path works for one release."""

from chimera._moved import alias

alias(__name__, "chimera.sim.trace")
