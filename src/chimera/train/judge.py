"""``chimera judge``: give a checkpoint that was never judged its verdict, as its run would.

A run judges checkpoint ``step-s`` by the loss of its weights on mini-batch ``s`` (the next
step's loss, or for the run's last checkpoint a forward-only probe:
``chimera.train.checkpoint.keeper``). A run killed right after publishing ``step-s`` leaves it
*unconfirmed*, and ``chimera generate`` and ``chimera export`` refuse it
(``chimera.train.checkpoint.serve``). Judging it here is the run's own probe:

- the run's config (``config.toml``, beside ``meta.json``) as one process
  (``equivalence.reference_config``: the same mini-batch whatever layout wrote it), on
  this machine's CPU (or ``device``), its data where ``data`` says if it moved;
- the checkpoint loaded, one forward-only pass over mini-batch ``s`` (``Trainer.probe_loss``:
  eval mode, no gradients);
- the run's rule (``chimera.train.health``): the loss history and ``--spike-factor`` the
  checkpoint recorded, so a NaN, an infinity or a spike puts it in doubt;
- the verdict written into ``meta.json`` by ``CheckpointManager.judge`` under the folder's
  lease (refused while a live run holds it), which prunes after a healthy verdict as the run
  would (its ``--keep-checkpoints``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from chimera.errors import UserError
from chimera.train import checkpoint
from chimera.train.checkpoint import CheckpointError, CheckpointManager, state
from chimera.train.checkpoint.lease import claim
from chimera.train.checkpoint.record import CONFIG, UNCONFIRMED, health_of, read_meta
from chimera.train.checkpoint.serve import folder, steps_in
from chimera.train.config import TrainConfig
from chimera.train.health import LossHistory

BY = "chimera judge: a forward-only probe"


@dataclass
class Verdict:
    path: Path
    step: int
    loss: float
    why: str | None  # None: healthy
    reference: float | None  # the median of the recorded healthy losses


def judge(path: str | os.PathLike, data: str | None = None, device: str = "cpu") -> list[Verdict]:
    """Judge the checkpoint folder ``path``, or every checkpoint of the run folder ``path``
    that was never judged (none: an empty list). Raises CheckpointError (one line)."""
    p = folder(path)
    if (p / checkpoint.META).exists():
        targets = [p]
    else:
        targets = [f for f in steps_in(p) if health_of(read_meta(f))["status"] == UNCONFIRMED]
    return [judge_one(step, data, device) for step in targets]


def judge_one(path: Path, data: str | None = None, device: str = "cpu") -> Verdict:
    """The verdict on the checkpoint folder ``path``, recorded in its ``meta.json``."""
    from chimera.train.loop import Trainer  # lazy: the pipeline's modules load when needed

    record = health_of(read_meta(path))
    cfg = _config(path, data, device)
    lease = claim(path.parent, resume=True)  # a live run on the folder: refused now
    with CheckpointManager(path.parent, cfg.ckpt.keep_checkpoints, lease=lease) as manager:
        checkpoint.verify(path, cfg.net.model, cfg.get("model_source").fingerprint())
        with torch.random.fork_rng():  # loading restores the run's RNG: not this process's
            trainer = Trainer(cfg)
            step = state.load(trainer, path)
            loss = trainer.probe_loss(step)
        history = LossHistory(record.get("recent_losses", ()), cfg.run.spike_factor)
        why = history.doubt(loss)
        manager.judge(path, why, {"by": f"{BY} of mini-batch {step}", "loss": loss,
                                  "grad_norm": None})
    return Verdict(path, step, loss, why, history.reference())


def _config(path: Path, data: str | None, device: str) -> TrainConfig:
    """The run's config as one process on ``device``, writing nothing."""
    from chimera.train.equivalence import reference_config  # lazy: imports the launcher

    if not (path / CONFIG).is_file():
        raise CheckpointError(f"checkpoint {path} has no {CONFIG} (written before runs recorded "
                              "their config): it cannot be judged")
    cfg = TrainConfig.from_toml(path / CONFIG)
    where = data if data is not None else cfg.corpus.data
    if where is not None and not os.path.exists(where):
        raise UserError(f"checkpoint {path}: the run's data {where} is not there (from "
                        f"{os.getcwd()}): pass --data FILE, where it is now")
    quiet = dict(checkpoint_dir=None, resume=False, checkpoint_every=0, eval_every=0,
                 progress=False, tensorboard=None, log_json=None, trace="", png="", fault=None,
                 emulate_nccl=None, compile=False)
    return reference_config(cfg).replace(data=where, device=device, **quiet)
