"""Moved to ``chimera.theory.formulas``; this path works for one release."""

from chimera._moved import alias

alias(__name__, "chimera.theory.formulas")
