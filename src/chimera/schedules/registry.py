"""Name -> generator registry. A generator is a pure function of integers returning a Schedule."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

from chimera.ir import Schedule, ScheduleError

Generator = Callable[..., Schedule]

# What a schedule may hold, checked before anything is built: building, lowering and
# validating take about 25 s and 250 MB at D·N·v = 65,536 cells (v: chunks or pipes per rank)
MAX_STAGES = 1024
MAX_MICRO_BATCHES = 16384
MAX_CELLS = 65536


@dataclass(frozen=True)
class Scheme:
    """``runnable=False``: simulation only (e.g. asynchronous PipeDream); the runtime refuses it."""

    name: str
    description: str
    fn: Generator
    runnable: bool = True

    @property
    def options(self) -> tuple[str, ...]:
        """Keyword options beyond (stages, micro_batches)."""
        params = inspect.signature(self.fn).parameters
        return tuple(p for p in params if p not in ("stages", "micro_batches"))


_REGISTRY: dict[str, Scheme] = {}


def register(name: str, description: str, runnable: bool = True) -> Callable[[Generator], Generator]:
    def deco(fn: Generator) -> Generator:
        _REGISTRY[name] = Scheme(name, description, fn, runnable)
        return fn
    return deco


def schemes(runnable: bool | None = None) -> list[Scheme]:
    """Every registered scheme, or only the runnable (True) / simulation-only (False) ones."""
    return [s for s in _REGISTRY.values() if runnable is None or s.runnable == runnable]


def get_scheme(name: str) -> Scheme:
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(_REGISTRY)
        raise ScheduleError(f"unknown schedule {name!r}; known: {known}") from None


def require_runnable(name: str) -> Scheme:
    """The scheme ``name`` if the runtime can execute it; simulation-only schemes (PipeDream's
    asynchronous ones) have no synchronous runtime."""
    scheme = get_scheme(name)
    if not scheme.runnable:
        raise ScheduleError(f"schedule {name} is simulation only (asynchronous, stale weights); "
                            f"train with a synchronous scheme (see `chimera schedules`)")
    return scheme


def build(name: str, stages: int, micro_batches: int, **options) -> Schedule:
    """Build schedule ``name``. Options the scheme does not take must be None (unset)."""
    scheme = get_scheme(name)
    for arg, value in (("stages", stages), ("micro_batches", micro_batches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{arg} must be a positive integer, got {value!r}")
    _check_size(stages, micro_batches, options)
    given = {k: v for k, v in options.items() if v is not None}
    unknown = [k for k in given if k not in scheme.options]
    if unknown:
        raise ScheduleError(f"schedule {name!r} does not take option(s) {', '.join(unknown)} "
                            f"(it takes: {', '.join(scheme.options) or 'none'})")
    return scheme.fn(stages, micro_batches, **given)


def _check_size(stages: int, micro_batches: int, options: dict) -> None:
    for arg, value, limit in (("stages", stages, MAX_STAGES),
                              ("micro_batches", micro_batches, MAX_MICRO_BATCHES)):
        if value > limit:
            raise ScheduleError(f"{arg} {value} exceeds the limit of {limit}")
    per_rank = 1
    for opt in ("chunks", "pipes"):
        value = options.get(opt)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            per_rank *= value
    if stages * micro_batches * per_rank > MAX_CELLS:
        raise ScheduleError(f"stages x micro_batches x chunks/pipes = {stages * micro_batches * per_rank:,} "
                            f"exceeds the limit of {MAX_CELLS:,} schedule cells")
