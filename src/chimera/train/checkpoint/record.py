"""``meta.json``: what a checkpoint records besides its tensors, and its health.

- the step to resume at (the data position: a mini-batch is a function of the step), the
  model, the layout that wrote it, the run's settings (``chimera.train.resume``) and the
  size and SHA-256 of every file;
- the run that wrote it (``run_id``: ``chimera.train.checkpoint.lease``);
- its health (``chimera.train.health``), read to resume and to prune.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from chimera.train import resume
from chimera.train.checkpoint import disk
from chimera.train.checkpoint.disk import (FORMAT, META, CheckpointError, published, read_index,
                                           sha256_of)

CONFIG = "config.toml"  # the run's TrainConfig (TrainConfig.from_toml reads it back)
TOKENIZER = "tokenizer.json"  # the run's tokenizer, kept inside: a moved checkpoint decodes

# -- health (chimera.train.health): recorded in meta.json, read to resume and to prune -------
HEALTHY, UNCONFIRMED, IN_DOUBT = "healthy", "unconfirmed", "in doubt"


def health_of(meta: dict) -> dict:
    """A checkpoint's health record. ``status``: healthy (the loss of its weights, the next
    step's, was judged healthy), unconfirmed (published after a healthy step, its weights not
    judged yet: the run ended or died first) or in doubt. A checkpoint written before health
    was recorded counts as healthy."""
    return meta.get("health") or {"status": HEALTHY}


def _status(path: Path) -> tuple[str, str]:
    """(status, why) of a published checkpoint; an unreadable one is in doubt."""
    try:
        record = health_of(read_meta(path))
    except CheckpointError as exc:
        return IN_DOUBT, str(exc)
    return record["status"], record.get("reason", "")


def resumable(directory: str | os.PathLike) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint not in doubt, and the newer ones passed over (folder, why).
    A checkpoint whose meta.json cannot be read is not passed over: --resume refuses it."""
    skipped = []
    for _, path in reversed(published(directory)):
        try:
            record = health_of(read_meta(path))
        except CheckpointError:
            return path, skipped
        if record["status"] != IN_DOUBT:
            return path, skipped
        skipped.append((path, record.get("reason", "in doubt")))
    return None, skipped


def newest_healthy(paths: list[Path]) -> Path | None:
    return next((p for p in reversed(paths) if _status(p)[0] == HEALTHY), None)


def set_health(path: Path, record: dict) -> None:
    """Replace the health record of a published checkpoint (rank 0, under the lease):
    meta.json is rewritten beside itself and renamed over, so it is whole at every moment."""
    meta = read_meta(path)
    meta["health"] = record
    tmp = path / f".{META}.tmp"
    disk.write_synced(tmp, json.dumps(meta, indent=1))
    os.rename(tmp, path / META)
    disk.fsync(path)


def read_meta(path: str | os.PathLike) -> dict:
    meta_path = Path(path) / META
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path}: unreadable {META}: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: {META} is not a {FORMAT} description")
    bad = _malformed(meta)
    if bad:
        raise CheckpointError(f"checkpoint {path}: {META} is malformed ({bad}); move the folder "
                              "away to resume from the one before")
    return meta


def _malformed(meta: dict) -> str | None:
    """What is wrong with a (perhaps hand-edited) ``meta.json``, or None."""
    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0
    if not count(meta.get("step")):
        return f"step {meta.get('step')!r} is not an integer >= 0"
    if not isinstance(meta.get("model"), str):
        return "model is not a name"
    layout = meta.get("layout")
    if not isinstance(layout, dict) or not count(layout.get("world")):
        return "layout.world is not an integer >= 0"
    files = meta.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(i, dict) and count(i.get("bytes")) and isinstance(i.get("sha256"), str)
            and "/" not in n and n not in ("", ".", "..") for n, i in files.items()):
        return "files is not a table of names with bytes and sha256"
    if ".metadata" not in files or not any(n.endswith(".distcp") for n in files):
        return "files does not list the index (.metadata) and a .distcp file"  # else unchecked
    if not isinstance(meta.get("run_id", ""), str):
        return "run_id is not a string"
    health = meta.get("health", {"status": HEALTHY})
    if not isinstance(health, dict) or health.get("status") not in (HEALTHY, UNCONFIRMED, IN_DOUBT):
        return "health is not a record with a status"
    return None


def owner(path: str | os.PathLike) -> str | None:
    """The run id a checkpoint was written by (None: unreadable, or written before run ids)."""
    try:
        return read_meta(path).get("run_id")
    except CheckpointError:
        return None


def verify(path: str | os.PathLike, model: str | None = None, model_config: dict | None = None) -> dict:
    """Check a checkpoint before any process starts; return its ``meta.json``.

    Every file must have the size and SHA-256 recorded at save time, the index must
    unpickle safely, and (if given) the model must be the one the checkpoint was written for.
    """
    path = Path(path)
    meta = read_meta(path)
    for name, info in meta.get("files", {}).items():
        f = path / name
        if not f.is_file() or f.stat().st_size != info["bytes"] or sha256_of(f) != info["sha256"]:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} is missing or differs "
                                  "from what was written (move the folder away to resume from "
                                  "the one before)")
    if model is not None and (meta.get("model") != model or
                              (model_config is not None and meta.get("model_config") != model_config)):
        raise CheckpointError(f"checkpoint {path} was written for model {meta.get('model')!r} "
                              f"({meta.get('model_config')}), not {model!r}")
    read_index(path)
    return meta


def write_meta(trainer, tmp: Path, final: Path, run_id: str, world: int, seconds: float,
                health: dict | None) -> None:
    from chimera.train.portable import portable_toml  # imports the config, which imports us

    cfg = trainer.cfg
    # the run: chimera train --config restarts it, from wherever the folder is moved
    disk.write_synced(tmp / CONFIG, portable_toml(cfg, final))
    tokenizer = tokenizer_record(cfg)
    if tokenizer is not None:
        shutil.copyfile(tokenizer["source"], tmp / TOKENIZER)
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
             for p in sorted(tmp.iterdir()) if p.is_file()}
    meta = {
        "format": FORMAT, "step": int(final.name[len("step-"):]), "run_id": run_id,
        "model": cfg.net.model, "model_config": cfg.get("model_source").fingerprint(),
        "data": {"next_step": int(final.name[len("step-"):]), "seed": cfg.optim.seed,
                 "global_batch": cfg.global_batch, "source": cfg.corpus.data,
                 "tokenizer": tokenizer, "mask_id": cfg.get("mask_id")},
        "layout": {"schedule": cfg.pipeline.schedule, "stages": cfg.pipeline.stages,
                   "data_parallel": cfg.pipeline.data_parallel,
                   "tensor_parallel": cfg.pipeline.tensor_parallel, "world": world,
                   "dtype": cfg.net.dtype},
        "files": files, "save_seconds": round(seconds, 4), "written_at": time.time(),
        # the optimizer settings and batch, for --resume to compare; fp16's loss scale
        "run": {**resume.record(cfg), **trainer.run_state()},
    }
    if health is not None:
        meta["health"] = health
    disk.write_synced(tmp / META, json.dumps(meta, indent=1))
    disk.fsync(tmp / ".metadata")


def tokenizer_record(cfg) -> dict | None:
    """What ``chimera generate`` needs to turn the run's token ids back into text: the
    tokenizer's copy in the checkpoint (``file``), the file it was copied from (``source``,
    absolute) and its SHA-256; None for byte tokens. Reads
    the data's tokenizer: ``--tokenizer``, or the one ``chimera tokenize`` left beside its
    token files (``DataInfo.tokenizer``); None for byte tokens and for bare token files."""
    if hasattr(cfg, "corpus"):  # a TrainConfig; else anything with a ``tokenizer``
        info, given = cfg.get("data_info"), cfg.corpus.tokenizer
    else:
        info, given = None, getattr(cfg, "tokenizer", None)
    path = getattr(info, "tokenizer", None) or given
    if not path:
        return None
    path = Path(path).resolve()
    return {"file": TOKENIZER, "source": str(path), "sha256": sha256_of(path)}


def tokenizer_path(meta: dict, folder: str | os.PathLike) -> tuple[Path | None, str | None]:
    """(the run's tokenizer file, None) for a checkpoint ``folder`` and its ``meta``: the copy
    inside it, or of a checkpoint written before there was one, the file it names; (None,
    why) when there is none to read (gone, or changed since the run); (None, None) when the
    run recorded none (bytes, bare token ids)."""
    record = (meta.get("data") or {}).get("tokenizer")
    if not record:
        return None, None
    name = record.get("file") if isinstance(record, dict) else None
    path = Path(folder) / name if isinstance(name, str) else (
        Path(record["path"]) if isinstance(record, dict) and isinstance(record.get("path"), str)
        else None)
    if path is None or not path.is_file():
        return None, f"the run's tokenizer {str(path)!r} is gone"
    if record.get("sha256") and sha256_of(path) != record["sha256"]:
        return None, f"the run's tokenizer {path} changed since the run (its SHA-256 differs)"
    return path, None


def model_fingerprint(model) -> dict:
    """The model's whole config (a ModelConfig: the preset with the data's vocabulary), as
    ``meta.json`` records it; dropout is left out (it changes no weight)."""
    cfg = asdict(model)
    return {k: v for k, v in cfg.items() if k not in ("dropout",)}
