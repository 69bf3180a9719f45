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

from dataclasses import dataclass


@dataclass(frozen=True)
class ClosedForm:
    bubble: float | None
    bubble_text: str
    activations: tuple[float, float] | None  # (min, max) over ranks
    activations_text: str
    weights: float
    weights_text: str
    cost: str  # the unit cost the bubble formula assumes


def closed_form(name: str, d: int, n: int, pipes: int = 2, chunks: int = 2,
                strategy: str = "direct") -> ClosedForm | None:
    if name in ("gpipe", "1f1b"):
        acts = (float(n), float(n)) if name == "gpipe" else (1.0, float(min(d, n)))
        return ClosedForm((d - 1) / (n + d - 1), "(D-1)/(N+D-1)", acts,
                          "N" if name == "gpipe" else "[1, D]", 1.0, "1", "1:1")
    if name == "interleaved":
        return ClosedForm((d - 1) / (chunks * n + d - 1), "(D-1)/(vN+D-1)", None, "-", 1.0, "1", "1:1")
    if name == "zb-h1":
        return ClosedForm((d - 1) / (3 * n + d - 1), "(D-1)/(3N+D-1)", (float(d), float(d)), "D",
                          1.0, "1", "1:1:1")
    if name == "chimera" and pipes == 2 and strategy == "direct" and n % d == 0:
        return ClosedForm((d - 2) / (2 * n + d - 2), "(D-2)/(2N+D-2)", (d / 2 + 1, float(d)),
                          "[D/2+1, D]", 2.0, "2", "1:1")
    if name == "chimera" and pipes == 2 and strategy != "direct":
        return _doubled(d, n, strategy)
    if name == "chimera":
        return ClosedForm(None, "-", None, "-", float(pipes), "Q", "1:1")
    return None


def _doubled(d: int, n: int, strategy: str) -> ClosedForm | None:
    """Two-pipe forward doubling (N a multiple of 2D) or backward halving (N of D), B = 2F."""
    if strategy == "doubling" and n % (2 * d) == 0:
        return ClosedForm((d - 2) / (2 * n + d - 2), "(D-2)/(2N+D-2), B=2F", (1.5 * d + 1, 2.0 * d),
                          "[3D/2+1, 2D]", 2.0, "2", "1:2")
    if strategy == "halving" and n % d == 0:
        return ClosedForm((d - 2) / (4 * n + d - 2), "(D-2)/(4N+D-2), B=2F", (0.75 * d + 0.5, float(d)),
                          "[3D/4+1/2, D]", 2.0, "2", "1:2")
    return ClosedForm(None, "-", None, "-", 2.0, "2", "1:1")
