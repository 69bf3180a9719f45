"""Moved to ``chimera.theory.bounds``; this path works for one release."""

from chimera._moved import alias

alias(__name__, "chimera.theory.bounds")
