"""Moved to ``chimera.models.source``; this path works for one release."""

from chimera._moved import alias

alias(__name__, "chimera.models.source")
