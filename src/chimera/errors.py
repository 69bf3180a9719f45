"""The package's error for user mistakes (no imports: every layer may raise it).

:class:`UserError` is bad input: a flag, a file, a config value, a schedule argument. Its
message names the problem; ``chimera`` prints it as one line and exits with code 2. Every
error type the package raises for bad input derives from it (``ScheduleError``,
``ConfigError``, ``CheckpointError``, ``ProfileError``, ``PlanError``, the CLI's
``UsageError``). It is a ``ValueError``, so callers that catch ``ValueError`` still catch it.

Any other exception is a bug in the library (or a failure the caller must see whole): the
command line shows its traceback and exits with code 1.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input from the user; the message says what is wrong and, where it can, what to do."""
