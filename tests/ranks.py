"""Ranks for the tests: ``run_ranks(worker, world)`` runs ``worker(rank, world)`` on ``world``
ranks and returns what each rank returned, in rank order; the first failure is raised.

- In process (the default): virtual ranks (``chimera.runtime.virtual.run_virtual``), threads
  of this process whose ``torch.distributed`` calls go to an in-process stand-in. The runtime
  is the real one; no process starts and nothing (torch, transformers) is imported again.
  For every test whose subject is not the transport. Seed torch's global RNG only under
  ``chimera.rng.seeded`` (the threads share it).
- ``processes=True``: spawned gloo processes (``chimera.spawn``, the API's launcher), for the
  tests whose subject needs them: the real ``torch.distributed``, the NCCL emulation over
  gloo, the launcher, per-process state (environment variables, signals). ``worker`` must then
  be a top-level function of an importable module (or a ``functools.partial`` of one), and
  what it returns must be something ``torch.save`` writes. ``timeout_s``: ranks still running
  then are killed and the test fails (a hang fails one test instead of stopping the run).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import tempfile
import threading
from typing import Callable

import pytest
import torch

import chimera.api as chimera
from chimera.runtime.virtual import run_virtual
from limits import limit


def run_ranks(worker: Callable[[int, int], object], world: int, processes: bool = False,
              timeout_s: float | None = None) -> list:
    """``worker(rank, world)`` on ``world`` ranks (virtual, or spawned gloo processes); their
    results by rank."""
    if not processes:
        return run_virtual(world, lambda rank: worker(rank, world))
    with tempfile.TemporaryDirectory(prefix="chimera-ranks-") as tmp:
        out = os.path.join(tmp, "result")
        start = functools.partial(chimera.spawn, functools.partial(_saved, worker=worker, out=out),
                                  world=world)
        if timeout_s is None:
            start()
        else:
            _bounded(start, timeout_s)
        return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(world)]


def _bounded(start: Callable[[], None], timeout_s: float) -> None:
    """``start()`` on a thread of its own; after ``limit(timeout_s)`` its ranks are killed."""
    timeout_s = limit(timeout_s)
    failed: list[BaseException] = []

    def body() -> None:
        try:
            start()
        except BaseException as exc:  # noqa: BLE001 - raised below, in the test's thread
            failed.append(exc)

    thread = threading.Thread(target=body, name="run-ranks", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        for proc in multiprocessing.active_children():
            proc.kill()
        thread.join(limit(30))
        pytest.fail(f"spawned ranks still running after {timeout_s:.0f}s")
    if failed:
        raise failed[0]


def _saved(rank: int, world: int, worker, out: str) -> None:
    """In a spawned rank: the worker's result, written for the launcher to read."""
    torch.save(worker(rank, world), f"{out}.{rank}")
