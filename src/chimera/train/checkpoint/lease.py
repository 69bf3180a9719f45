"""A checkpoint directory belongs to one run.

- A run id in every ``meta.json``; resuming continues the newest checkpoint's run id.
- A lease while the run lives: an exclusive ``flock`` on ``DIR/.lock`` held by the process
  that publishes checkpoints (rank 0), released by the kernel however that process ends (no
  stale locks after a crash). The file names the holder, so a refused run can say who has
  the directory; two runs at once cannot interleave their writes.
- A directory holding checkpoints is refused unless the run resumes them.
- Pruning removes only the run's own checkpoints.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from chimera.runtime.transport import Transport
from chimera.train.checkpoint.disk import CheckpointError, agree, latest, published, rank_world
from chimera.train.checkpoint.record import newest_healthy, owner

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
    """The locked descriptor of ``directory``'s lock file; DirectoryBusy when it is held,
    CheckpointError when it cannot be opened."""
    root = Path(directory)
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:  # e.g. a folder named .lock, a read-only disk
        raise CheckpointError(f"checkpoint directory {directory}: cannot open its lock file "
                              f"{root / LOCK}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise DirectoryBusy(f"checkpoint directory {directory} is in use by {holder}: wait for "
                            "that run to end, or choose another --checkpoint-dir") from None
    return fd


def check_free(directory: str | os.PathLike) -> None:
    """Before any rank starts: CheckpointError (one line) while a live run holds
    ``directory`` (rank 0 claims it again under the run-long lease: this only answers early)."""
    if not Path(directory).is_dir():
        return
    try:
        fd = acquire(directory)
    except DirectoryBusy as exc:
        raise CheckpointError(str(exc)) from None
    os.close(fd)


def claim(directory: str | os.PathLike, resume: bool) -> Lease:
    """Rank 0's lease on ``directory`` for a run: refused while another run holds it, and
    (unless ``resume``) when it holds checkpoints already; resuming continues their run id."""
    try:
        fd = acquire(directory)
    except DirectoryBusy as exc:
        raise CheckpointError(str(exc)) from None
    try:
        found = published(directory)
        if found and not resume:
            raise CheckpointError(foreign_message(directory, found[-1][1]))
        run_id = (owner(found[-1][1]) if found else None) or uuid.uuid4().hex[:12]
        lease = Lease(Path(directory), run_id, fd)
        lease.describe(run_id)
    except BaseException:
        os.close(fd)
        raise
    return lease


def foreign_message(directory, newest: Path) -> str:
    return (f"--checkpoint-dir {directory} holds another run's checkpoints (newest {newest.name}): "
            "add --resume to continue that run, or choose an empty directory")


def claim_all(transport: Transport, directory: str | os.PathLike, resume: bool) -> Lease:
    """Collective :func:`claim` over the ranks of ``transport``: rank 0 gets the lease (the
    others a token), every rank raises if it was refused."""
    lease, error = None, None
    if rank_world(transport)[0] == 0:
        try:
            lease = claim(directory, resume)
        except CheckpointError as exc:
            error = str(exc)
    agree(transport, error, f"claiming {directory}", CheckpointError)
    return lease or Lease(Path(directory), "")


def prune(directory: str | os.PathLike, keep: int, run_id: str) -> None:
    """Keep the newest ``keep`` checkpoints of run ``run_id`` (another run's are never
    touched) and, whatever ``keep`` says, its newest healthy one: while the newer ones are
    unconfirmed or in doubt (``record.health_of``), it is the one to go back to. Drop
    leftovers of interrupted saves and removals. Call it holding the lease."""
    root = Path(directory)
    mine = [path for _, path in published(root) if owner(path) == run_id]
    spare = newest_healthy(mine)
    for path in mine[:-keep]:
        if path != spare:
            _remove(path)
    newest = latest(root)
    for path in root.glob(".tmp-step-*"):
        if newest is None or path.name[len(".tmp-"):] < newest.name:
            shutil.rmtree(path, ignore_errors=True)
    for path in root.glob(".del-step-*"):
        shutil.rmtree(path, ignore_errors=True)


def _remove(path: Path) -> None:
    """Renamed out of the published names first: a kill half-way leaves no partial ``step-*``."""
    gone = path.with_name(f".del-{path.name}")
    shutil.rmtree(gone, ignore_errors=True)
    os.rename(path, gone)
    shutil.rmtree(gone, ignore_errors=True)
