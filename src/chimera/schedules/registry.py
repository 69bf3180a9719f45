"""Name -> generator registry. A generator is a pure function of integers returning a Schedule.

Each scheme declares its keyword options here, once (:class:`Option`): the CLI's flags, the
checks of ``build`` (and so of ``TrainConfig``), the planner's search, the benchmark's rows and
the labels of tables derive from the declaration, so adding an option touches the generator only.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Callable

from chimera.ir import Schedule, ScheduleError

Generator = Callable[..., Schedule]

# What a schedule may hold, checked before anything is built: building, lowering and
# validating take about 25 s and 250 MB at D·N·v = 65,536 cells (v: chunks or pipes per rank)
MAX_STAGES = 1024
MAX_MICRO_BATCHES = 16384
MAX_CELLS = 65536


@dataclass(frozen=True)
class Option:
    """A generator's keyword option beyond (stages, micro_batches).

    ``type``: int, str, or object (anything, checked by the generator); an int is at least
    ``low``; a str one of ``choices`` when there are any. The default is the generator's own
    (read from its signature); ``default_text`` says it where that is None (e.g. ``D``).
    ``flag=False``: the command line sets it otherwise (chimera-zb's ``cost`` is ``--cost``).
    ``search(D, layers)``: the values the planner tries (None: the default only). ``bench``:
    values the benchmark runs as rows of their own beside the default (a default among them is
    written out in the default row, so its report says ``v=2``). ``symbol``: labels write ``Q=4`` rather
    than ``4``. ``cells``: the value multiplies the schedule's cells per rank (size limit).
    """

    name: str
    type: type
    help: str
    choices: tuple = ()
    low: int = 1
    short: str | None = None
    metavar: str | None = None
    default_text: str | None = None
    flag: bool = True
    symbol: str | None = None
    search: Callable[[int, int], list] | None = None
    bench: tuple = ()
    cells: bool = False
    default: object = field(default=None, compare=False)

    @property
    def shown_default(self) -> str:
        return self.default_text if self.default is None and self.default_text else str(self.default)

    def label(self, value) -> str:
        """``Q=4`` or ``doubling``: how tables, plans and bench reports write a value."""
        return f"{self.symbol}={value}" if self.symbol else str(value)

    def check(self, value) -> None:
        """Refuse a value of the wrong type or outside the declared ones (ScheduleError)."""
        if self.type is int:
            if not isinstance(value, int) or isinstance(value, bool) or value < self.low:
                what = "a positive integer" if self.low == 1 else f"an integer >= {self.low}"
                raise ScheduleError(f"option {self.name} must be {what}, got {value!r}")
        elif self.type is str:
            if not isinstance(value, str) or (self.choices and value not in self.choices):
                valid = f"one of {', '.join(self.choices)}" if self.choices else "a string"
                raise ScheduleError(f"option {self.name} must be {valid}, got {value!r}")


@dataclass(frozen=True)
class Scheme:
    """``runnable=False``: simulation only (e.g. asynchronous PipeDream); the runtime refuses it."""

    name: str
    description: str
    fn: Generator
    runnable: bool = True
    declared: tuple[Option, ...] = ()  # in the generator's signature order

    @property
    def options(self) -> tuple[str, ...]:
        """Keyword options beyond (stages, micro_batches)."""
        return tuple(o.name for o in self.declared)

    def option(self, name: str) -> Option | None:
        return next((o for o in self.declared if o.name == name), None)

    def labels(self, options) -> list[str]:
        """The options it declares, as labels write them (``Q=4``, ``direct``); others left out."""
        declared = [(self.option(k), v) for k, v in dict(options).items()]
        return [o.label(v) for o, v in declared if o is not None]

    def label(self, options) -> str:
        """The scheme with its options, e.g. ``chimera Q=4 direct``."""
        return " ".join([self.name] + self.labels(options))

    def is_default(self, name: str, value) -> bool:
        option = self.option(name)
        return option is not None and value == option.default


_REGISTRY: dict[str, Scheme] = {}


def register(name: str, description: str, runnable: bool = True,
             options: tuple[Option, ...] = ()) -> Callable[[Generator], Generator]:
    """Register a generator; ``options`` declares each keyword option of its signature."""
    def deco(fn: Generator) -> Generator:
        _REGISTRY[name] = Scheme(name, description, fn, runnable, _declare(name, fn, options))
        return fn
    return deco


def _declare(name: str, fn: Generator, options: tuple[Option, ...]) -> tuple[Option, ...]:
    """The options in signature order with the generator's defaults; a signature option left
    undeclared, a declared one the generator lacks, or a name declared twice differently
    (one CLI flag serves every scheme that takes it) is a bug in the generator's module."""
    params = {p: v for p, v in inspect.signature(fn).parameters.items()
              if p not in ("stages", "micro_batches")}
    by_name = {o.name: o for o in options}
    if set(params) != set(by_name):
        raise TypeError(f"scheme {name}: options declared ({', '.join(by_name) or 'none'}) differ "
                        f"from the generator's keyword arguments ({', '.join(params) or 'none'})")
    declared = tuple(replace(by_name[p], default=v.default) for p, v in params.items())
    for o in declared:
        other = option_declarations().get(o.name)
        if other is not None and replace(other[0], help="", default=None) != replace(o, help="", default=None):
            raise TypeError(f"scheme {name}: option {o.name} is declared differently by "
                            f"{', '.join(other[1])}")
    return declared


def option_declarations() -> dict[str, tuple[Option, list[str]]]:
    """Every option any scheme declares (first declaration) and the schemes that take it."""
    out: dict[str, tuple[Option, list[str]]] = {}
    for scheme in _REGISTRY.values():
        for o in scheme.declared:
            out.setdefault(o.name, (o, []))[1].append(scheme.name)
    return out


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


def default_micro_batches(stages: int, schedule: str = "chimera") -> int:
    """N when none is given, the same for ``chimera train``, ``api.Pipeline``, ``show`` and
    ``simulate``: two of Chimera's basic units (2D), so steady state is reached and the bubbles
    are amortized; 1 for ``none``, single-process training (the reference takes no pipeline)."""
    return 1 if schedule == "none" else 2 * stages


def build(name: str, stages: int, micro_batches: int, **options) -> Schedule:
    """Build schedule ``name``. Options the scheme does not take must be None (unset)."""
    scheme = get_scheme(name)
    for arg, value in (("stages", stages), ("micro_batches", micro_batches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{arg} must be a positive integer, got {value!r}")
    given = {k: v for k, v in options.items() if v is not None}
    unknown = [k for k in given if k not in scheme.options]
    if unknown:
        raise ScheduleError(f"schedule {name!r} does not take option(s) {', '.join(unknown)} "
                            f"(it takes: {', '.join(scheme.options) or 'none'})")
    for key, value in given.items():
        scheme.option(key).check(value)
    _check_size(scheme, stages, micro_batches, given)
    return scheme.fn(stages, micro_batches, **given)


def _check_size(scheme: Scheme, stages: int, micro_batches: int, given: dict) -> None:
    for arg, value, limit in (("stages", stages, MAX_STAGES),
                              ("micro_batches", micro_batches, MAX_MICRO_BATCHES)):
        if value > limit:
            raise ScheduleError(f"{arg} {value} exceeds the limit of {limit}")
    per_rank = 1
    for o in scheme.declared:
        value = given.get(o.name)
        if o.cells and value is not None and value > 1:
            per_rank *= value
    if stages * micro_batches * per_rank > MAX_CELLS:
        many = "/".join(sorted(n for n, (o, _) in option_declarations().items() if o.cells))
        raise ScheduleError(f"stages x micro_batches x {many} = {stages * micro_batches * per_rank:,} "
                            f"exceeds the limit of {MAX_CELLS:,} schedule cells")
