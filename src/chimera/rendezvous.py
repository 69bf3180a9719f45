"""Moved to ``chimera.check.rendezvous``; this path works for one release."""

from chimera._moved import alias

alias(__name__, "chimera.check.rendezvous")
