"""Moved to ``chimera.data.text``; this path works for one release."""

from chimera._moved import alias

alias(__name__, "chimera.data.text")
