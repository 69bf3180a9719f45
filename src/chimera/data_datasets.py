"""Moved to ``chimera.data.datasets``; this path works for one release."""

from chimera._moved import alias

alias(__name__, "chimera.data.datasets")
