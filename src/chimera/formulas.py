"""The paper's closed forms for bubbles and memory, for tables and tests (unit time).

Bubble ratios assume equal forward and backward slots (``--cost 1:1``) except ZB-H1, which
assumes F = I = W (``--cost 1:1:1``). Memory is per rank, in Ma (activations) and Mθ
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
    if name == "chimera":
        return ClosedForm(None, "-", None, "-", float(pipes), "Q", "1:1")
    return None
