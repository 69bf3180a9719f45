"""Moved to ``chimera.train.checkpoint.lease``; this path works for one release."""

from chimera._moved import alias

alias(__name__, "chimera.train.checkpoint.lease")
