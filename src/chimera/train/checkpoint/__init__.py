"""Checkpoints that survive a crash and a change of layout (torch.distributed.checkpoint).

- ``disk``: where checkpoints live, writing a folder whole, reading it safely (the index
  through a restricted unpickler), refusing a corrupt one;
- ``record``: ``meta.json`` (the step, the model, the layout, the run, every file's SHA-256)
  and the checkpoint's health;
- ``state``: what a checkpoint holds (parameters and AdamW state by model-wide name, RNG) and
  how it is written and read;
- ``lease``: a checkpoint directory belongs to one run;
- ``manager``: ``CheckpointManager``, the one owner of a run's folder: the lease, publishing,
  pruning, the verdict on each checkpoint, restoring (``save`` and ``restore`` are its
  one-call forms);
- ``keeper``: judges each checkpoint by the loss of the step after it, so a diverging run
  never loses the last good one.
"""

from chimera.train.checkpoint.disk import (FORMAT, META, CheckpointError, CheckpointIOError,
                                           NonFiniteCheckpoint, agree, latest, published,
                                           read_index, sha256_of, step_dir)
from chimera.train.checkpoint.manager import CheckpointManager, restore, save
from chimera.train.checkpoint.record import (HEALTHY, IN_DOUBT, UNCONFIRMED, health_of,
                                             model_fingerprint, newest_healthy, owner, read_meta,
                                             resumable, set_health, tokenizer_path,
                                             tokenizer_record, verify)
from chimera.train.checkpoint.state import load_model_state

__all__ = ["FORMAT", "META", "HEALTHY", "IN_DOUBT", "UNCONFIRMED", "CheckpointError",
           "CheckpointIOError", "CheckpointManager", "NonFiniteCheckpoint", "agree", "health_of",
           "latest", "load_model_state", "model_fingerprint", "newest_healthy", "owner",
           "published", "read_index", "read_meta", "restore", "resumable", "save", "set_health",
           "sha256_of", "step_dir", "tokenizer_path", "tokenizer_record", "verify"]
