"""Moved to ``chimera.check.validation_error``; this path works for one release."""

from chimera._moved import alias

alias(__name__, "chimera.check.validation_error")
