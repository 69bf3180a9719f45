"""Is a step healthy? The rule that decides which checkpoints a run publishes and keeps.

A step is **in doubt** when its loss or gradient norm is NaN or infinite, or when its loss
is a **spike**: above both ``factor`` times the median loss of the last ``WINDOW`` healthy
steps and that median plus ``MIN_RISE`` nats (default factor 2: the loss more than doubled;
the absolute floor keeps a loss near zero from counting a rise of 0.02 to 0.05). The median,
not the mean, so that one odd batch does not move the reference; only healthy steps enter
the history, so a diverging run does not teach the rule that divergence is normal. Large
trainers use the same kind of rule to decide when to roll back (PaLM restarts ~100 steps
before a spike; OPT and BLOOM rolled back by hand on loss spikes).

A checkpoint's weights are judged by the step that follows it: the loss of step s is the
loss of the weights after s updates, i.e. checkpoint ``step-s``. The loss is all-reduced, so
every rank reaches the same verdict and takes the same branch (saves are collective).

Torch-free: the loop and the checkpoint code call it with plain floats.
"""

from __future__ import annotations

import math
import statistics

WINDOW = 32  # healthy steps the reference median is taken over
DEFAULT_FACTOR = 2.0  # a spike: the loss more than doubled ...
MIN_RISE = 1.0  # ... and rose by more than one nat


class LossHistory:
    """The losses of the last ``WINDOW`` healthy steps and the verdict on a new one."""

    def __init__(self, losses=(), factor: float = DEFAULT_FACTOR):
        self.losses = [float(x) for x in losses if math.isfinite(x)][-WINDOW:]
        self.factor = factor  # 0: no spike rule, only non-finite values are in doubt

    def reference(self) -> float | None:
        return statistics.median(self.losses) if self.losses else None

    def doubt(self, loss: float, grad_norm: float | None = None) -> str | None:
        """Why a step with this loss (and gradient norm) is in doubt; None when healthy."""
        if not math.isfinite(loss):
            return f"the loss is {loss}"
        if grad_norm is not None and not math.isfinite(grad_norm):
            return f"the gradient norm is {grad_norm}"
        ref = self.reference()
        if self.factor and ref is not None and loss > max(self.factor * ref, ref + MIN_RISE):
            return (f"the loss {loss:.4g} is a spike: above {self.factor:g}x the median "
                    f"{ref:.4g} of the last {len(self.losses)} healthy steps")
        return None

    def judge(self, loss: float, grad_norm: float | None = None) -> str | None:
        """:meth:`doubt`, and a healthy loss joins the history."""
        why = self.doubt(loss, grad_norm)
        if why is None:
            self.losses = (self.losses + [float(loss)])[-WINDOW:]
        return why
