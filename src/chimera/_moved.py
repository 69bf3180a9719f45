"""Old import paths of moved modules: each works for one release, with a DeprecationWarning,
and gives the same module object as the new path (so a monkeypatch through either reaches
the code)."""

from __future__ import annotations

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
    """Make the module being imported as ``old`` the module ``new``."""
    warnings.warn(f"{old} moved to {new}; the old path goes in the next release",
                  DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
