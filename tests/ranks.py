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
  what it returns must be something ``torch.save`` writes.
"""

from __future__ import annotations

import functools
import os
import tempfile
from typing import Callable

import torch

import chimera.api as chimera
from chimera.runtime.virtual import run_virtual


def run_ranks(worker: Callable[[int, int], object], world: int, processes: bool = False) -> list:
    """``worker(rank, world)`` on ``world`` ranks (virtual, or spawned gloo processes); their
    results by rank."""
    if not processes:
        return run_virtual(world, lambda rank: worker(rank, world))
    with tempfile.TemporaryDirectory(prefix="chimera-ranks-") as tmp:
        out = os.path.join(tmp, "result")
        chimera.spawn(functools.partial(_saved, worker=worker, out=out), world=world)
        return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(world)]


def _saved(rank: int, world: int, worker, out: str) -> None:
    """In a spawned rank: the worker's result, written for the launcher to read."""
    torch.save(worker(rank, world), f"{out}.{rank}")
