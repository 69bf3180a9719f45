"""Moved to ``chimera.data.tokens``; this path works for one release."""

from chimera._moved import alias

alias(__name__, "chimera.data.tokens")
