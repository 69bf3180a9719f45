"""Schedule generators, one per scheme, registered by name (no torch)."""

from chimera.schedules import (  # noqa: F401  (registers the schemes)
    asynchronous, bidirectional, chimera_zb, classic, dualpipe, zero_bubble)
from chimera.schedules.registry import (Scheme, build, default_micro_batches, get_scheme, register,
                                        require_runnable, schemes)

__all__ = ["Scheme", "build", "default_micro_batches", "get_scheme", "register", "require_runnable", "schemes"]
