"""Schedule generators, one per scheme, registered by name (no torch)."""

from chimera.schedules import bidirectional, classic  # noqa: F401  (registers the schemes)
from chimera.schedules.registry import Scheme, build, get_scheme, register, schemes

__all__ = ["Scheme", "build", "get_scheme", "register", "schemes"]
