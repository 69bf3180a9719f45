"""torch's global RNG, one per process, shared by its threads.

Virtual ranks (``chimera.runtime.virtual``) are threads of one process, so a rank that seeds
the global generator to build its layers (Hugging Face's init draws from it) and a rank that
forks and restores it around a probe would otherwise interleave: the restore lands in the
middle of the other's build, whose weights then differ from run to run. Every use that seeds
or restores it takes :data:`LOCK` for its whole duration; hold it only around local work
(never across a collective or a p2p wait, or the other ranks cannot reach theirs).
"""

from __future__ import annotations

import contextlib
import threading

import torch

LOCK = threading.RLock()


def _devices(device: torch.device | None = None) -> list:
    if device is not None:
        return [device] if device.type == "cuda" else []
    return [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []


@contextlib.contextmanager
def forked(device: torch.device | None = None):
    """The global RNG (and ``device``'s, on CUDA) as it was before, afterwards."""
    with LOCK, torch.random.fork_rng(devices=_devices(device)):
        yield


@contextlib.contextmanager
def seeded(seed: int):
    """Run a build with ``seed`` without touching the caller's RNG state (no reseeding of
    the user's global generator)."""
    with forked():
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def kept(device: torch.device | None = None):
    """The global RNG as it was before, afterwards, holding :data:`LOCK` only to take and to
    put back the state: for local work that waits on other ranks in between (a probe of
    tensor-parallel layers, whose collectives need the other threads to reach theirs). The
    work must draw nothing from the global RNG (tensor-parallel layers refuse dropout): a
    draw would land in another virtual rank's seeded build."""
    devices = _devices(device)
    with LOCK:
        cpu = torch.get_rng_state()
        cuda = [torch.cuda.get_rng_state(d) for d in devices]
    try:
        yield
    finally:
        with LOCK:
            torch.set_rng_state(cpu)
            for d, state in zip(devices, cuda):
                torch.cuda.set_rng_state(state, d)
