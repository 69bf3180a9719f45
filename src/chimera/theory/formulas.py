"""The paper's closed forms for bubbles and memory, for tables and tests (unit time).

Bubble ratios assume equal forward and backward slots (``--cost 1:1``) except ZB-H1, which
assumes F = I = W (``--cost 1:1:1``), and Chimera's forward doubling and backward halving,
which are for B = 2F (``--cost 1:2``): their units chain with no gap (the official slot rule,
``schedules.chimera_slots``), so doubling keeps the basic unit's ratio and halving, on 2N
half-size micro-batches, that of 2N. These two are derived here and checked by the tests,
not printed in the paper. Memory is per rank, in Ma (activations) and Mθ
(weights); ``None`` where no simple closed form exists.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from chimera.schedules.registry import get_scheme


@dataclass(frozen=True)
class ClosedForm:
    bubble: float | None
    bubble_text: str
    activations: tuple[float, float] | None  # (min, max) over ranks
    activations_text: str
    weights: float
    weights_text: str
    cost: str  # the unit cost the bubble formula assumes


def closed_form(name: str, d: int, n: int, **options) -> ClosedForm | None:
    """The paper's form for scheme ``name`` with ``options`` as ``build`` takes them (absent or
    None: the generator's default). None for a scheme without one, or an option the form does
    not take (its parameters) set to other than its default: a new option has no form yet."""
    form = _FORMS.get(name)
    if form is None:
        return None
    scheme = get_scheme(name)
    given = {o.name: o.default for o in scheme.declared}
    given.update((k, v) for k, v in options.items() if v is not None)
    taken = list(inspect.signature(form).parameters)[2:]  # after (d, n)
    if any(not scheme.is_default(k, v) for k, v in given.items() if k not in taken):
        return None
    return form(d, n, **{k: given[k] for k in taken})


def _gpipe(d: int, n: int) -> ClosedForm:
    return _linear(d, n, (float(n), float(n)), "N")


def _one_f_one_b(d: int, n: int) -> ClosedForm:
    return _linear(d, n, (1.0, float(min(d, n))), "[1, D]")


def _linear(d: int, n: int, acts: tuple[float, float], acts_text: str) -> ClosedForm:
    return ClosedForm((d - 1) / (n + d - 1), "(D-1)/(N+D-1)", acts, acts_text, 1.0, "1", "1:1")


def _interleaved(d: int, n: int, chunks: int) -> ClosedForm:
    return ClosedForm((d - 1) / (chunks * n + d - 1), "(D-1)/(vN+D-1)", None, "-", 1.0, "1", "1:1")


def _zb_h1(d: int, n: int) -> ClosedForm:
    return ClosedForm((d - 1) / (3 * n + d - 1), "(D-1)/(3N+D-1)", (float(d), float(d)), "D",
                      1.0, "1", "1:1:1")


def _chimera(d: int, n: int, pipes: int, strategy: str) -> ClosedForm:
    if pipes == 2 and strategy == "direct" and n % d == 0:
        return ClosedForm((d - 2) / (2 * n + d - 2), "(D-2)/(2N+D-2)", (d / 2 + 1, float(d)),
                          "[D/2+1, D]", 2.0, "2", "1:1")
    if pipes == 2 and strategy != "direct":
        return _doubled(d, n, strategy)
    return ClosedForm(None, "-", None, "-", float(pipes), "Q", "1:1")


def _doubled(d: int, n: int, strategy: str) -> ClosedForm:
    """Two-pipe forward doubling (N a multiple of 2D) or backward halving (N of D), B = 2F."""
    if strategy == "doubling" and n % (2 * d) == 0:
        return ClosedForm((d - 2) / (2 * n + d - 2), "(D-2)/(2N+D-2), B=2F", (1.5 * d + 1, 2.0 * d),
                          "[3D/2+1, 2D]", 2.0, "2", "1:2")
    if strategy == "halving" and n % d == 0:
        return ClosedForm((d - 2) / (4 * n + d - 2), "(D-2)/(4N+D-2), B=2F", (0.75 * d + 0.5, float(d)),
                          "[3D/4+1/2, D]", 2.0, "2", "1:2")
    return ClosedForm(None, "-", None, "-", 2.0, "2", "1:1")


_FORMS = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved, "zb-h1": _zb_h1,
          "chimera": _chimera}
