"""Moved to ``chimera.data.bpe``; this path works for one release."""

from chimera._moved import alias

alias(__name__, "chimera.data.bpe")
