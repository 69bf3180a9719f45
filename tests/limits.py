"""The time limits of tests that wait on processes, from one place: ``limit(seconds)`` is a
limit written for an idle machine, scaled by the machine's load and by the user.

A multi-process test beside a CPU hog (or beside other test runs) gets less of each core; a
limit that holds on an idle machine then fails a correct run. ``limit`` multiplies by the
run-queue length per core (the 1-minute load average over the cores, at least 1) and by
``CHIMERA_TEST_TIME_SCALE`` (default 1; e.g. 3 on a slow or shared machine). Every timeout a
test hands to a subprocess, a launcher, a comm timeout or a hand-written deadline goes
through it. A limit is a bound on a hang, never a measurement: tests assert no timings.
"""

from __future__ import annotations

import os

SCALE_VARIABLE = "CHIMERA_TEST_TIME_SCALE"


def scale() -> float:
    """How much longer than on an idle machine a test may wait now."""
    try:
        user = float(os.environ.get(SCALE_VARIABLE, "1"))
    except ValueError:
        raise ValueError(f"{SCALE_VARIABLE} must be a number, got "
                         f"{os.environ[SCALE_VARIABLE]!r}") from None
    if not user > 0:
        raise ValueError(f"{SCALE_VARIABLE} must be > 0, got {user}")
    try:
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:  # no load average on this platform
        load = 1.0
    return max(1.0, load) * user


def limit(seconds: float) -> float:
    """``seconds`` (a limit on an idle machine) scaled by the load and CHIMERA_TEST_TIME_SCALE."""
    return seconds * scale()


def whole(seconds: float) -> int:
    """``limit(seconds)`` rounded up to whole seconds (for flags such as --comm-timeout)."""
    return int(-(-limit(seconds) // 1))
