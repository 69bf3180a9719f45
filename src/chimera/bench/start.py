"""One start instant for every rank of a bench step (the ranks share one machine's clock)."""

from __future__ import annotations

import time

import torch

from chimera.runtime.transport import ReduceOp, current


def start_together(margin_s: float = 0.02) -> float:
    """Start every rank at one instant; return it (``time.perf_counter`` seconds).

    A barrier releases ranks up to ~15 ms apart on 8 oversubscribed ranks (measured: rank 0
    left it 9 ms after rank 1), and a step timed from each rank's own release then counts
    that skew. Instead the ranks agree on an instant ``margin_s`` after the last of them
    reached this call and each sleeps until it: ``perf_counter`` is the system's monotonic
    clock, one time axis for every process on a machine (the bench spawns its ranks on one).
    A rank that arrives past the instant starts late and its lateness counts in its time."""
    now = torch.tensor([time.perf_counter()], dtype=torch.float64)
    current().all_reduce(now, op=ReduceOp.MAX)
    t0 = float(now) + margin_s
    left = t0 - time.perf_counter()
    if left > 0:
        time.sleep(left)
    return t0
