"""Moved to ``chimera.check.comm_plan``; this path works for one release."""

from chimera._moved import alias

alias(__name__, "chimera.check.comm_plan")
