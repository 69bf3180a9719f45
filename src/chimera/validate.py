"""Moved to ``chimera.check.validate``; this path works for one release."""

from chimera._moved import alias

alias(__name__, "chimera.check.validate")
