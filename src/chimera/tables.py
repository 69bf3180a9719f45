"""Moved to ``chimera.theory.tables``; this path works for one release."""

from chimera._moved import alias

alias(__name__, "chimera.theory.tables")
