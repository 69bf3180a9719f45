"""Which checkpoint a user is served (``chimera generate``, ``chimera export``): never one in
doubt or not yet judged without saying so.

- A step folder (``step-<n>``, with ``meta.json``) is served when it is healthy. In doubt or
  unconfirmed (its run stopped before the step that judges it), it is refused in one line
  naming the newest healthy checkpoint beside it, unless ``allow_in_doubt``: then it is
  served with a warning, every time.
- A run's ``--checkpoint-dir`` serves its newest healthy checkpoint, with a note naming the
  newer ones passed over (unconfirmed or in doubt); a folder without a healthy one is
  refused. ``allow_in_doubt`` serves its newest checkpoint, whatever its verdict (a warning
  when it is not healthy).

``chimera judge`` (``chimera.train.judge``) gives an unconfirmed checkpoint its
verdict. ``--resume`` is not served here: it continues from the newest checkpoint not in
doubt, unconfirmed included, because its first step judges it (``keeper``).
"""

from __future__ import annotations

import os
from pathlib import Path

from chimera.train.checkpoint.disk import META, CheckpointError, published
from chimera.train.checkpoint.record import (HEALTHY, UNCONFIRMED, health_of, newest_healthy,
                                             read_meta)

ALLOW = "--allow-in-doubt"


def choose(path: str | os.PathLike, allow_in_doubt: bool = False) -> tuple[Path, list[str]]:
    """The checkpoint folder ``--checkpoint path`` serves, and the lines to tell the user
    (notes and warnings). CheckpointError (one line) when it is refused."""
    p = folder(path)
    if (p / META).exists():
        return _step_folder(p, allow_in_doubt)
    found = steps_in(p)
    if allow_in_doubt:
        return _step_folder(found[-1], True)
    for step in found:
        read_meta(step)  # an unreadable meta.json is refused by name, as --resume does
    good = newest_healthy(found)
    newer = found[found.index(good) + 1:] if good is not None else found
    if good is None:
        raise CheckpointError(f"--checkpoint {path}: no healthy checkpoint in it; newest "
                              f"{_verdict(newer[-1])}; {_way_out(newer[-1])}")
    notes = [f"serving {good.name}, the newest healthy checkpoint in {path}; passing over "
             f"{', '.join(_verdict(f) for f in newer)}"] if newer else []
    return good, notes


def folder(path: str | os.PathLike) -> Path:
    """``--checkpoint path`` as a folder (CheckpointError when it is missing or a file)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"--checkpoint {path}: no such directory")
    if not p.is_dir():
        raise CheckpointError(f"--checkpoint {path}: not a directory (give a run's "
                              "--checkpoint-dir or one of its step-<n> folders)")
    return p


def steps_in(run: Path) -> list[Path]:
    """The published checkpoints of the run folder ``run``, oldest first (CheckpointError:
    none)."""
    found = [step for _, step in published(run)]
    if not found:
        raise CheckpointError(f"--checkpoint {run}: no checkpoint in it (no step-<n> folder "
                              f"and no {META})")
    return found


def _step_folder(p: Path, allow_in_doubt: bool) -> tuple[Path, list[str]]:
    status = health_of(read_meta(p))["status"]
    if status == HEALTHY:
        return p, []
    if allow_in_doubt:
        return p, [f"warning: serving checkpoint {p}, which is {_verdict(p, named=False)} "
                   f"({ALLOW})"]
    good = newest_healthy([step for _, step in published(p.parent)])
    where = (f"newest healthy checkpoint {good}" if good is not None else
             f"no healthy checkpoint in {p.parent}")
    raise CheckpointError(f"checkpoint {p} is {_verdict(p, named=False)}: {where}; {_way_out(p)}")


def _verdict(p: Path, named: bool = True) -> str:
    """What is wrong with checkpoint ``p`` (unconfirmed or in doubt), for a message."""
    record = health_of(read_meta(p))
    if record["status"] == UNCONFIRMED:
        why = "not judged yet (its run stopped before the step that judges it)"
    else:
        why = f"in doubt ({record.get('reason', 'no reason recorded')})"
    return f"{p.name}, {why}" if named else why


def _way_out(p: Path) -> str:
    judge = (f"`chimera judge --checkpoint {p}` judges it, "
             if health_of(read_meta(p))["status"] == UNCONFIRMED else "")
    return f"{judge}{ALLOW} serves it anyway"
