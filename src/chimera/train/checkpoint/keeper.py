"""A run's checkpoints and their health: never lose the last good one.

- A checkpoint is published only after a healthy step (``chimera.train.health``), recorded
  in its ``meta.json`` as *unconfirmed*: the loss that tells whether its weights are good is
  the next step's (or, at the end of the run, a forward-only probe of the next mini-batch).
- That verdict is written into the checkpoint (*healthy* or *in doubt*). Pruning keeps the
  run's newest healthy checkpoint whatever ``--keep-checkpoints`` says (``CheckpointManager``), so
  a run diverging after a good checkpoint cannot delete it; ``--resume`` passes over the
  checkpoints in doubt (``record.resumable``).
- ``--skip-nonfinite`` skips at most ``--skip-limit`` steps in a row, and a run whose last
  step is in doubt ends with an error (exit 1), never as a success.

Every rank calls every method in the same order: the verdicts come from all-reduced losses,
so all ranks take the same branches, and saves are collective.
"""

from __future__ import annotations

import sys

from chimera.train.checkpoint.disk import NonFiniteCheckpoint, step_dir
from chimera.train.checkpoint.manager import CheckpointManager
from chimera.train.checkpoint.record import UNCONFIRMED, health_of, read_meta
from chimera.train.health import LossHistory
from chimera.train.loop import NonFiniteLoss


class RunInDoubt(NonFiniteLoss):
    """The run ended with its last step (or its final weights) in doubt, or skipped too many
    steps in a row."""


class Keeper:
    """One rank's view of the run's checkpoints: what is pending judgement, why the newest
    step is in doubt, how many steps were skipped in a row. ``manager``: the run's
    checkpoints (it publishes and records the verdicts; None: no --checkpoint-dir)."""

    def __init__(self, cfg, trainer, manager: CheckpointManager | None, rank: int, start: int):
        self.cfg, self.trainer, self.manager, self.rank = cfg, trainer, manager, rank
        self.directory = cfg.ckpt.checkpoint_dir
        record, same_data = self._start_record(start)
        # losses measured on other data say nothing about this data's (a fine-tune's jump)
        recent = record.get("recent_losses", ()) if same_data else ()
        self.history = LossHistory(recent, cfg.run.spike_factor)
        # the checkpoint whose weights the next step judges (the start one if nobody has)
        unjudged = record.get("status") == UNCONFIRMED
        self.pending = step_dir(self.directory, start) if unjudged else None
        self.doubt: str | None = None  # why the newest step is in doubt
        self.skipped_in_a_row = 0

    def _start_record(self, start: int) -> tuple[dict, bool]:
        """The health record of the checkpoint resumed from, and whether it was trained on
        the same data as this run."""
        if not (self.directory and start):
            return {}, False
        meta = read_meta(step_dir(self.directory, start))
        data = meta.get("data") or {}
        return health_of(meta), data.get("source") == self.cfg.corpus.data

    # -- the loop calls these ---------------------------------------------------------------
    def after_step(self, step: int, log) -> None:
        """Judge step ``step``, and with it the checkpoint of the weights it ran on."""
        why = self.history.judge(log.loss, log.grad_norm)
        self.doubt = None if why is None else f"step {step}: {why}"
        self._judge_pending(step, why, log.loss, log.grad_norm)
        if why is not None and not log.skipped:
            self._say(f"{self.doubt}: in doubt")
        self._count_skips(step, log.skipped)

    def stopped(self, step: int, exc: NonFiniteLoss) -> None:
        """Step ``step`` had a non-finite loss and stops the run: its weights are in doubt."""
        why = self.history.doubt(exc.loss, exc.grad_norm) or "a non-finite loss or gradient norm"
        self._judge_pending(step, why, exc.loss, exc.grad_norm)
        exc.args = (f"{exc}{self._fallback()}",)

    def publish(self, step: int, log) -> None:
        """The checkpoint after ``step`` updates, unless the step that made it is in doubt."""
        if self.doubt is not None:
            self._say(f"checkpoint step-{step:08d} not published ({self.doubt}){self._fallback()}")
            return
        record = {"status": UNCONFIRMED, "recent_losses": self.history.losses,
                  "made_by": {"step": step - 1, "loss": log.loss, "grad_norm": log.grad_norm}}
        try:
            self.pending = self.manager.save(self.trainer, step, health=record)
        except NonFiniteCheckpoint as exc:  # the update itself overflowed
            exc.args = (f"{exc}{self._fallback()}",)
            raise

    def finish(self, steps: int) -> None:
        """After the last step: judge the final checkpoint by a forward-only probe of the next
        mini-batch (it has no step after it); RunInDoubt if the run ends in doubt."""
        if self.pending is not None and self.pending.name == f"step-{steps:08d}":
            loss = self.trainer.probe_loss(steps)
            why = self.history.doubt(loss)
            self._judge_pending(steps, why, loss, None, by="a forward-only probe")
            if why is not None:
                self.doubt = f"the final weights: {why}"
        if self.doubt is not None:
            raise RunInDoubt(f"the run ended in doubt ({self.doubt}){self._fallback()}")

    # -- inside ----------------------------------------------------------------------------
    def _judge_pending(self, step: int, why: str | None, loss, grad_norm, by: str = "") -> None:
        """Record the verdict on the pending checkpoint if ``step`` ran on its weights."""
        path, self.pending = self.pending, None
        if path is None or path.name != f"step-{step:08d}":
            return
        self.manager.judge(path, why, {"by": by or f"step {step}", "loss": loss,
                                       "grad_norm": grad_norm})
        if why is not None:
            self._say(f"checkpoint {path.name} is in doubt ({why}): --resume passes over it")

    def _count_skips(self, step: int, skipped: bool) -> None:
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        if self.skipped_in_a_row >= self.cfg.run.skip_limit:
            raise RunInDoubt(f"step {step}: {self.skipped_in_a_row} steps in a row skipped with a "
                             f"non-finite loss or gradient norm (--skip-limit "
                             f"{self.cfg.run.skip_limit}): the run is not recovering"
                             f"{self._fallback()}")

    def _fallback(self) -> str:
        """Where to go back to, for a message."""
        if self.manager is None:
            return ""
        found = self.manager.last_good()
        if found is None:
            return "; no healthy checkpoint to go back to"
        return f"; newest healthy checkpoint {found} (--resume continues from it)"

    def _say(self, text: str) -> None:
        if self.rank == 0:
            print(f"chimera train: {text}", file=sys.stderr, flush=True)
