"""One run's checkpoint folder, owned by one object: the lease, publishing, pruning, the
verdict on each checkpoint, and restoring.

    manager = CheckpointManager(folder, keep=3, transport=trainer.context.transport)
    manager.claim(resume=True)              # refused while another live run holds the folder
    start = manager.restore(trainer)        # the newest checkpoint not in doubt (0: none)
    manager.save(trainer, step, health)     # whole or absent; the last good one is never lost
    manager.judge(path, why, judged_by)     # healthy, or in doubt (why); then pruned
    manager.release()

Every method but ``last_good`` and ``resumable`` is collective: every rank calls it in the
same order. Rank 0 holds the lease and does the file system's part; the others learn of a
failure through ``agree`` and raise too, so none of them hangs. The ranks are those of the
manager's transport (the run's, handed down); without one, a process with no peers
(``OneRank``: ``chimera generate``, a launcher's checks before any process group exists).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch

from chimera.runtime.context import collective_device
from chimera.runtime.transport import OneRank, Transport
from chimera.train.checkpoint import state
from chimera.train.checkpoint.disk import (CheckpointError, agree, barrier, publish, published,
                                           rank_world, step_dir)
from chimera.train.checkpoint.lease import Lease, claim_all, prune
from chimera.train.checkpoint.record import (HEALTHY, IN_DOUBT, health_of, newest_healthy,
                                             read_meta, resumable, set_health, write_meta)
from chimera.train.faults import collective


class CheckpointManager:
    """The checkpoints of one run in ``directory``: keeps the newest ``keep`` of them (and
    the newest healthy one, whatever ``keep`` says). ``transport``: the run's ranks, every
    one of which calls the collective methods (None: this process alone, ``OneRank``).
    ``lease``: a lease claimed already (``claim`` otherwise; without either, each save
    claims the folder for itself alone)."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3,
                 transport: Transport | None = None, *, lease: Lease | None = None):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self.directory, self.keep, self.lease = Path(directory), keep, lease
        self.transport = transport if transport is not None else OneRank()

    # -- the lease -------------------------------------------------------------------------
    def claim(self, resume: bool) -> Lease:
        """Rank 0 takes the folder's lease for the run (the others a token). Refused
        (CheckpointError, on every rank) while another live run holds it, and, unless
        ``resume``, when it holds checkpoints already; resuming continues their run id."""
        self.lease = claim_all(self.transport, self.directory, resume)
        return self.lease

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    # -- publishing ------------------------------------------------------------------------
    def save(self, trainer, step: int, health: dict | None = None) -> Path:
        """Publish the state after ``step`` optimizer steps as ``step-<step>`` and prune.

        Every rank writes into ``.tmp-step-<step>``; rank 0 adds ``meta.json`` and renames
        the folder into place, so a crash at any moment leaves the published checkpoints as
        they were. NonFiniteCheckpoint (every rank, nothing written) when the state holds a
        NaN or an infinity. ``health``: the record ``meta.json`` keeps (``health_of``; None:
        none, read as healthy).
        """
        tensors = state.gather(trainer, step)
        own = self.lease or claim_all(self.transport, self.directory, resume=True)
        try:
            return self._publish(trainer, tensors, step, own.run_id, health)
        finally:
            if own is not self.lease:
                own.release()

    def _publish(self, trainer, tensors: dict, step: int, run_id: str,
                 health: dict | None) -> Path:
        rank, world = rank_world(self.transport)
        final = step_dir(self.directory, step)
        tmp = final.with_name(f".tmp-{final.name}")
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier(self.transport, "checkpoint: creating the folder")
        start = time.perf_counter()
        state.write(self.transport, tensors, tmp, final.name)
        error = None
        if rank == 0:
            try:
                write_meta(trainer, tmp, final, run_id, world, time.perf_counter() - start, health)
                publish(tmp, final)
                prune(self.directory, self.keep, run_id)
            except OSError as exc:  # a full or read-only disk: every rank must hear of it
                error = (f"rank 0: publishing {final.name} failed: {exc.strerror or exc} "
                         f"({exc.filename or tmp})")
        agree(self.transport, error, f"publishing {final.name}")
        return final

    def prune(self) -> None:
        """Keep the run's newest ``keep`` checkpoints and its newest healthy one; another
        run's are never touched (rank 0, holding the lease)."""
        if rank_world(self.transport)[0] == 0 and self.lease is not None:
            prune(self.directory, self.keep, self.lease.run_id)

    # -- judging ---------------------------------------------------------------------------
    def judge(self, path: Path, why: str | None, judged_by: dict) -> None:
        """Record the verdict on the published checkpoint ``path``: healthy (``why`` None)
        or in doubt, ``why``. A healthy verdict lets the older one kept back go (prune).
        ``judged_by``: what judged it (``by``, ``loss``, ``grad_norm``), kept in meta.json."""
        error = None
        if rank_world(self.transport)[0] == 0:
            try:  # (any failure on rank 0 must reach the others through agree, not hang them)
                record = health_of(read_meta(path))
                record.update(status=IN_DOUBT if why else HEALTHY, judged_by=judged_by)
                if why:
                    record["reason"] = f"{judged_by['by']}: {why}"
                set_health(path, record)
                if not why:
                    self.prune()
            except (OSError, CheckpointError) as exc:
                why_not = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                error = f"rank 0: recording the health of {path.name} failed: {why_not}"
        agree(self.transport, error, f"recording the health of {path.name}")

    def last_good(self) -> Path | None:
        """The newest healthy checkpoint: the one to go back to when the run diverges."""
        return newest_healthy([path for _, path in published(self.directory)])

    def resumable(self) -> tuple[Path | None, list[tuple[Path, str]]]:
        """The newest checkpoint not in doubt, and the newer ones passed over (folder, why)."""
        return resumable(self.directory)

    # -- restoring -------------------------------------------------------------------------
    def restore(self, trainer) -> int:
        """Load the newest checkpoint not in doubt into ``trainer``; return the step to
        continue at (0: none). Rank 0 chooses it and tells the others, so all load the same."""
        path = self._agree_on_resumable()
        return 0 if path is None else state.load(trainer, path)

    def _agree_on_resumable(self) -> Path | None:
        found, _ = self.resumable()  # rank 0's choice is everyone's (broadcast)
        step = torch.tensor([-1 if found is None else int(found.name[len("step-"):])],
                            device=collective_device(self.transport))
        if rank_world(self.transport)[1] > 1:
            collective(self.transport, "checkpoint: choosing the one to resume from",
                       self.transport.broadcast, step, 0)
        return None if step.item() < 0 else step_dir(self.directory, int(step.item()))


def save(trainer, directory: str | os.PathLike, step: int, keep: int, lease: Lease | None = None,
         health: dict | None = None) -> Path:
    """``CheckpointManager(directory, keep, transport, lease=lease).save(trainer, step,
    health)`` over the trainer's ranks: without a lease, rank 0 claims the folder for this
    save alone, continuing its newest checkpoint's run."""
    manager = CheckpointManager(directory, keep, trainer.context.transport, lease=lease)
    return manager.save(trainer, step, health)


def restore(trainer, directory: str | os.PathLike) -> int:
    """``CheckpointManager(directory, transport=...).restore(trainer)`` over the trainer's
    ranks."""
    return CheckpointManager(directory, transport=trainer.context.transport).restore(trainer)
