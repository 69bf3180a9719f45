"""A checkpoint's ``config.toml`` that still runs after its run folder is moved.

The paths a run reads (``--data``, ``--val-data``, ``--data-mix``, ``--tokenizer``, ``--model
hf:PATH``) and its checkpoint folder are written into the checkpoint's config.toml so that
``chimera train --config STEP/config.toml`` reads the same files from any current folder and after the run
folder (``--checkpoint-dir``) is moved: a path inside the run folder relative to the
checkpoint's own folder (``checkpoint_dir = ".."``), any other absolute. The files a run
writes besides checkpoints (``--trace``, ``--png``, ``--log-json``, ``--tensorboard``) are
written as given: relative to the folder the resumed run starts in. ``resolve`` reads
them back: the relative paths of a checkpoint's config.toml (one beside a checkpoint's
``meta.json``) are relative to its folder; a config.toml written by hand keeps its paths as
given (relative to the current folder).
"""

from __future__ import annotations

import os
from pathlib import Path

# section -> its fields that hold a path (the model: only as hf:PATH)
PATHS = {"corpus": ("data", "val_data", "tokenizer", "data_mix"), "ckpt": ("checkpoint_dir",),
         "net": ("model",)}
HF_PREFIX = "hf:"  # chimera.models.source.HF_PREFIX, which imports torch (the config does not)
META = "meta.json"  # chimera.train.checkpoint.disk.META: beside it, config.toml is a checkpoint's


def _split(field: str, value: str) -> tuple[str, str, str] | None:
    """(prefix, path, suffix) of a path field's value; None when it names no file (a preset)."""
    if field == "model":
        return (HF_PREFIX, value[len(HF_PREFIX):], "") if value.startswith(HF_PREFIX) else None
    if field == "data_mix":  # PATH:WEIGHT
        path, _, weight = value.rpartition(":")
        return "", path, ":" + weight
    return "", value, ""


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _each(tables: dict, rewrite) -> dict:
    """``tables`` with ``rewrite(field, path) -> path`` applied to every path they hold."""
    for section, fields in PATHS.items():
        table = tables.get(section)
        if not isinstance(table, dict):
            continue
        for field in fields:
            value = table.get(field)
            values = value if isinstance(value, list) else [value]
            out = []
            for v in values:
                parts = _split(field, v) if isinstance(v, str) and v else None
                out.append(v if parts is None else parts[0] + rewrite(field, parts[1]) + parts[2])
            if value is not None:
                table[field] = out if isinstance(value, list) else out[0]
    return tables


def portable_toml(cfg, step: str | os.PathLike) -> str:
    """``cfg`` as TOML for the checkpoint folder ``step`` (inside ``cfg.ckpt.checkpoint_dir``):
    paths inside the run folder relative to ``step``, others absolute."""
    import tomli_w  # lazy: writing is for runs and checkpoints

    step = Path(step).resolve()
    run = Path(cfg.ckpt.checkpoint_dir).resolve() if cfg.ckpt.checkpoint_dir else step.parent

    def written(field: str, path: str) -> str:
        path = Path(path).resolve()
        return os.path.relpath(path, step) if _inside(path, run) else str(path)
    return tomli_w.dumps(_each(cfg.sections(), written))


def is_checkpoint_config(path: str | os.PathLike) -> bool:
    return (Path(path).parent / META).is_file()


def resolve(tables: dict, path: str | os.PathLike) -> dict:
    """The tables of the TOML file ``path``, its relative paths made absolute against its
    folder when it is a checkpoint's config.toml (unchanged otherwise)."""
    if not is_checkpoint_config(path):
        return tables
    folder = Path(path).resolve().parent
    return _each(tables, lambda field, p: p if os.path.isabs(p) else os.path.normpath(folder / p))
