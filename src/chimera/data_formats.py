"""Moved to ``chimera.data.formats``; this path works for one release."""

from chimera._moved import alias

alias(__name__, "chimera.data.formats")
