"""Where a bench rank starts: its run context, and one start instant for every rank of a step
(the ranks share one machine's clock)."""

from __future__ import annotations

import time

import torch

from chimera.runtime.context import RunContext, RuntimeOptions
from chimera.runtime.transport import ReduceOp, TorchDist, Transport


def bench_context(comm_timeout: float) -> RunContext:
    """The run of a bench rank in its gloo group (``workers.gloo_group``, the default
    ``torch.distributed`` group): that group, the CPU, the bench's ``comm_timeout`` (the other
    options from ``CHIMERA_*``). Made once where the rank starts and handed to every row it
    runs."""
    options = RuntimeOptions.from_env(comm_timeout=comm_timeout)
    return RunContext(TorchDist(), torch.device("cpu"), options)


def start_together(transport: Transport, margin_s: float = 0.02) -> float:
    """Start every rank of ``transport`` at one instant; return it (``time.perf_counter``
    seconds).

    A barrier releases ranks up to ~15 ms apart on 8 oversubscribed ranks (measured: rank 0
    left it 9 ms after rank 1), and a step timed from each rank's own release then counts
    that skew. Instead the ranks agree on an instant ``margin_s`` after the last of them
    reached this call and each sleeps until it: ``perf_counter`` is the system's monotonic
    clock, one time axis for every process on a machine (the bench spawns its ranks on one).
    A rank that arrives past the instant starts late and its lateness counts in its time."""
    now = torch.tensor([time.perf_counter()], dtype=torch.float64)
    transport.all_reduce(now, op=ReduceOp.MAX)
    t0 = float(now) + margin_s
    left = t0 - time.perf_counter()
    if left > 0:
        time.sleep(left)
    return t0
