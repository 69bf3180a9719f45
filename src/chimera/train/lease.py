"""A checkpoint directory's lease: one run writes into it at a time.

The lease is an exclusive ``flock`` on ``DIR/.lock``, held by the process that publishes
checkpoints (rank 0) for the whole run, and released by the kernel when that process ends
however it ends (no stale locks after a crash). The file names the holder, so a refused
run can say who has the directory.
"""

from __future__ import annotations

import fcntl
import os
import socket
from dataclasses import dataclass
from pathlib import Path

LOCK = ".lock"


class DirectoryBusy(RuntimeError):
    """Another live process holds the directory's lease."""


@dataclass(frozen=True)
class Lease:
    """Held by rank 0 (``fd`` the locked file); the other ranks of the run hold a token with
    ``fd`` -1, so that every rank knows a run-long lease exists."""

    directory: Path
    run_id: str
    fd: int = -1

    def describe(self, run_id: str) -> None:
        """Write who holds the lease into the lock file (for the refusal of a second run)."""
        text = f"run {run_id}, pid {os.getpid()} on {socket.gethostname()}".encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text, 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)


def acquire(directory: str | os.PathLike) -> int:
    """The locked descriptor of ``directory``'s lock file; DirectoryBusy when it is held."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise DirectoryBusy(f"checkpoint directory {directory} is in use by {holder}: wait for "
                            "that run to end, or choose another --checkpoint-dir") from None
    return fd
