"""Checkpoints that survive a crash and a change of layout (torch.distributed.checkpoint).

What one holds, keyed so that it depends on neither D, W nor the schedule:

- ``model.<name>``: every parameter once, under its model-wide name
  (``blocks.3.attn.qkv.weight``; HF's for an HF model, a tie under its first name), written by the rank holding the stage's pipe-0 replica
  in data replica 0 (``Trainer.checkpoint_parameters``) and read back by every replica.
- ``optim.<name>.exp_avg | exp_avg_sq | step``: AdamW's state of that parameter.
- ``rng.cpu.rank<r>``: each rank's torch RNG state (restored when the world size matches).
- ``meta.json``: the step to resume at (the data position: a mini-batch is a function of
  the step), the model, the layout that wrote it, and the size and SHA-256 of every file.

On disk (a file system every rank sees)::

    DIR/step-00000004/        .metadata  __0_0.distcp  __1_0.distcp  meta.json
    DIR/.tmp-step-00000006/   being written: never read, removed by the next save

Every rank writes into ``.tmp-*``; rank 0 then adds ``meta.json`` and renames the folder
into place, so a ``step-*`` folder is complete or absent. The last ``keep`` are kept.

A directory belongs to one run: ``meta.json`` names the run (``run_id``), and
``chimera.train.lease`` keeps it that way (a lock while a run writes, no mixing of runs,
pruning only the run's own checkpoints).
Nothing is unpickled freely: DCP reads tensors with ``torch.load(weights_only=True)``, its
index goes through a restricted unpickler, and our metadata is JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import time
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from chimera.errors import UserError
from chimera.runtime.grid import collective_device
from chimera.train import resume
from chimera.train.faults import collective

FORMAT = "chimera-checkpoint/1"
META = "meta.json"
_NAME = re.compile(r"^step-(\d{8})$")
_OPTIM_KEYS = ("exp_avg", "exp_avg_sq", "step")


class CheckpointError(UserError):
    """A checkpoint that cannot be used: missing, corrupt, or written for another model."""


class NonFiniteCheckpoint(RuntimeError):
    """Refused to write a checkpoint whose parameters or optimizer state are not finite."""


class CheckpointIOError(RuntimeError):
    """Writing or reading a checkpoint failed on some rank (disk, permissions, a dead peer)."""


def _dcp(what: str, fn, *args, **kwargs) -> None:
    """Run DCP's save or load; its failures (a BaseException there) become CheckpointIOError."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # DCP warns about single-process use even when asked for
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            fn(*args, **kwargs)
    except (CheckpointException, RuntimeError, OSError) as exc:
        raise CheckpointIOError(f"rank {_rank_world()[0]}: {what} failed: {_cause(exc)}") from exc


def _cause(exc: BaseException) -> str:
    """One line saying why DCP failed: its CheckpointException's first line is only "ranks:
    ...", so the rank's own exception is dug out ("[Errno 28] No space left on device")."""
    failures = getattr(exc, "failures", None) or {}
    inner = next((pair[0] for pair in failures.values() if isinstance(pair, tuple)), None)
    if inner is not None:
        return f"{type(inner).__name__}: {_cause(inner)}"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} ({exc.filename})" if exc.filename else exc.strerror
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# -- where checkpoints live ---------------------------------------------------------------
def step_dir(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def published(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, folder) of every published checkpoint, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _NAME.match(p.name)) and p.is_dir()]
    return sorted(found)


def latest(directory: str | os.PathLike) -> Path | None:
    found = published(directory)
    return found[-1][1] if found else None


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
    _write_synced(tmp, json.dumps(meta, indent=1))
    os.rename(tmp, path / META)
    _fsync(path)


# -- reading safely -----------------------------------------------------------------------
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
        "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` index and refuses every other class or function."""

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name not in _DCP_CLASSES.get(module, ()):
            raise pickle.UnpicklingError(f"the checkpoint index refers to {module}.{name}, "
                                         "which a checkpoint never needs")
        return super().find_class(module, name)


def _safe_reader(path: Path):
    """DCP's file reader, with the index read by :class:`_IndexUnpickler`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _IndexUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def read_index(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Key -> (shape, dtype) of every tensor in a checkpoint; raises CheckpointError."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = _safe_reader(Path(path)).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read its index (.metadata): {exc}") from None
    index = {}
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {path}: entry {key!r} is not a tensor")
        index[key] = (tuple(md.size), md.properties.dtype)
    return index


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


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


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


# -- what goes in -------------------------------------------------------------------------
def _tensors(optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor],
             whole: dict | None = None) -> dict[str, torch.Tensor]:
    """Flat DCP state of ``params``: each parameter and its AdamW state, by name. ``whole``:
    the whole AdamW state of parameters a sharded optimizer holds in slices (by parameter),
    so a checkpoint does not depend on sharding."""
    state = {}
    for name, p in params.items():
        adam = (whole or {}).get(p)
        if adam is None:
            _init_adam_state(optimizer, p)  # a skipped first step leaves none yet
            adam = optimizer.state[p]
        state[f"model.{name}"] = p.detach()
        for key in _OPTIM_KEYS:
            state[f"optim.{name}.{key}"] = adam[key]
    return state


def _first_nonfinite(state: dict[str, torch.Tensor]) -> str | None:
    for key, value in state.items():
        # a NaN or inf makes the sum non-finite; the exact test only runs where it is
        if value.is_floating_point() and not torch.isfinite(value.sum()) \
                and not bool(torch.isfinite(value).all()):
            return key
    return None


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier(what: str) -> None:
    if _rank_world()[1] > 1:
        collective(what, dist.barrier)


def save(trainer, directory: str | os.PathLike, step: int, keep: int, lease=None,
         health: dict | None = None) -> Path:
    """Write the state after ``step`` optimizer steps to ``directory/step-<step>``.

    Collective: every rank calls it. Raises NonFiniteCheckpoint (on every rank, before
    anything is written) when some parameter or optimizer state is NaN or infinite.
    ``lease``: rank 0's claim on the directory for the whole run (``lease.claim_all``);
    without one, rank 0 claims it for this save alone, continuing its newest checkpoint's run.
    ``health``: the record ``meta.json`` keeps (``health_of``; None: none, read as healthy).
    """
    import torch.distributed.checkpoint as dcp

    rank, world = _rank_world()
    whole = trainer.whole_optimizer_state()  # sharded: gathered over each group (collective)
    state = _tensors(trainer.optimizer, trainer.checkpoint_parameters(), whole)
    state[f"rng.cpu.rank{rank}"] = torch.get_rng_state()
    _refuse_nonfinite(state, step, world)
    from chimera.train.lease import claim_all  # (it reads checkpoints: imports this module)

    own = lease or claim_all(directory, resume=True)
    try:
        final = step_dir(directory, step)
        tmp = final.with_name(f".tmp-{final.name}")
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier("checkpoint: creating the folder")
        start = time.perf_counter()
        _dcp(f"writing {final.name}", dcp.save, state,
             storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
        error = None
        if rank == 0:
            error = _publish_on_rank0(trainer, own.run_id, tmp, final, world, keep,
                                      time.perf_counter() - start, health)
        agree(error, f"publishing {final.name}")
    finally:
        if lease is None:
            own.release()
    return final


def _publish_on_rank0(trainer, run_id: str, tmp: Path, final: Path, world: int, keep: int,
                      seconds: float, health: dict | None) -> str | None:
    """Add ``meta.json``, publish, prune; the error text if the disk refused (full, read-only)."""
    from chimera.train.lease import prune

    try:
        _write_meta(trainer, tmp, final, run_id, world, seconds, health)
        _publish(tmp, final)
        prune(final.parent, keep, run_id)
    except OSError as exc:
        return f"rank 0: publishing {final.name} failed: {exc.strerror or exc} ({exc.filename or tmp})"
    return None


def agree(error: str | None, what: str, kind: type[Exception] = CheckpointIOError) -> None:
    """Every rank raises ``kind`` when any had ``error`` (the ranks without one quietly: the
    rank that failed says why)."""
    flag = torch.tensor([0.0 if error is None else 1.0], device=collective_device())
    if _rank_world()[1] > 1:
        collective(f"checkpoint: {what}", dist.all_reduce, flag)
    if flag.item():
        exc = kind(error or f"{what} failed on another rank")
        exc.reported = error is None  # chimera train prints each rank's own message
        raise exc


def _refuse_nonfinite(state: dict, step: int, world: int) -> None:
    bad = _first_nonfinite(state)
    flag = torch.tensor([0.0 if bad is None else 1.0], device=collective_device())
    if world > 1:
        collective("checkpoint: agreeing that the state is finite", dist.all_reduce, flag)
    if flag.item():
        where = f" ({bad} on this rank)" if bad else " (on another rank)"
        raise NonFiniteCheckpoint(f"refusing to write the checkpoint of step {step}: the state "
                                  f"holds NaN or infinite values{where}")


def _write_meta(trainer, tmp: Path, final: Path, run_id: str, world: int, seconds: float,
                health: dict | None) -> None:
    cfg = trainer.cfg
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
             for p in sorted(tmp.iterdir()) if p.is_file()}
    meta = {
        "format": FORMAT, "step": int(final.name[len("step-"):]), "run_id": run_id,
        "model": cfg.model, "model_config": cfg.model_source.fingerprint(),
        "data": {"next_step": int(final.name[len("step-"):]), "seed": cfg.seed,
                 "global_batch": cfg.global_batch, "source": cfg.data,
                 "tokenizer": tokenizer_record(cfg), "mask_id": cfg.mask_id},
        "layout": {"schedule": cfg.schedule, "stages": cfg.stages,
                   "data_parallel": cfg.data_parallel, "world": world, "dtype": cfg.dtype},
        "files": files, "save_seconds": round(seconds, 4), "written_at": time.time(),
        # the optimizer settings and batch, for --resume to compare; fp16's loss scale
        "run": {**resume.record(cfg), **trainer.run_state()},
    }
    if health is not None:
        meta["health"] = health
    _write_synced(tmp / META, json.dumps(meta, indent=1))
    _fsync(tmp / ".metadata")


def tokenizer_record(cfg) -> dict | None:
    """What ``chimera generate`` needs to turn the run's token ids back into text: the
    tokenizer file (absolute path) and its SHA-256; None for byte tokens. Reads
    the data's tokenizer: ``--tokenizer``, or the one ``chimera tokenize`` left beside its
    token files (``DataInfo.tokenizer``); None for byte tokens and for bare token files."""
    info = getattr(cfg, "data_info", None)
    path = getattr(info, "tokenizer", None) or getattr(cfg, "tokenizer", None)
    if not path:
        return None
    path = Path(path).resolve()
    return {"path": str(path), "sha256": sha256_of(path)}


def model_fingerprint(model) -> dict:
    """The model's whole config (a ModelConfig: the preset with the data's vocabulary), as
    ``meta.json`` records it; dropout is left out (it changes no weight)."""
    cfg = asdict(model)
    return {k: v for k, v in cfg.items() if k not in ("dropout",)}


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` (atomic); an older folder of that name is moved aside first."""
    old = final.with_name(f".old-{final.name}")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


# -- what comes out -----------------------------------------------------------------------
def restore(trainer, directory: str | os.PathLike) -> int:
    """Load the newest checkpoint not in doubt (``resumable``) into ``trainer``; return the
    step to continue at (0: none).

    Collective. Rank 0 chooses the checkpoint and tells the others, so all load the same.
    Parameters and AdamW state are read by name, so the layout may differ from the writer's.
    """
    import torch.distributed.checkpoint as dcp

    rank, world = _rank_world()
    path = _agree_on_latest(directory, rank, world)
    if path is None:
        return 0
    meta = read_meta(path)
    index = read_index(path)
    replicas = _replicas_by_name(trainer)
    whole = trainer.whole_optimizer_state(empty=True)  # sharded: read whole, then sliced
    state = _tensors(trainer.optimizer, {name: ps[0] for name, ps in replicas.items()}, whole)
    rng_key = f"rng.cpu.rank{rank}"
    if meta["layout"]["world"] == world and rng_key in index:
        state[rng_key] = torch.empty_like(torch.get_rng_state())
    _check_against_index(state, index, path)
    _dcp(f"reading {path}", dcp.load, state, storage_reader=_safe_reader(path), no_dist=world == 1)
    if rng_key in state:
        torch.set_rng_state(state[rng_key])
    trainer.load_whole_optimizer_state(whole)
    _copy_to_other_replicas(trainer, replicas)
    trainer.equalize_ties()  # a tie is one key, read into each copy: equal, and kept so
    trainer.load_run_state(meta.get("run") or {})
    return int(meta["step"])


def _agree_on_latest(directory, rank: int, world: int) -> Path | None:
    found, _ = resumable(directory)  # rank 0's choice is everyone's (broadcast)
    step = torch.tensor([-1 if found is None else int(found.name[len("step-"):])],
                        device=collective_device())
    if world > 1:
        collective("checkpoint: choosing the one to resume from", dist.broadcast, step, 0)
    return None if step.item() < 0 else step_dir(directory, int(step.item()))


def _replicas_by_name(trainer) -> dict[str, list[torch.Tensor]]:
    out: dict[str, list[torch.Tensor]] = {}
    for name, _pipe, p in trainer.replica_parameters():
        out.setdefault(name, []).append(p)
    return out


def _init_adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> None:
    """The state AdamW creates on its first step, to be overwritten by the checkpoint's."""
    state = optimizer.state[p]
    if not state:  # fused or capturable AdamW keeps its step count on the parameter's device
        on_device = optimizer.defaults.get("fused") or optimizer.defaults.get("capturable")
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _check_against_index(state: dict, index: dict, path: Path) -> None:
    """Every wanted key present with the same shape: the model matches the checkpoint."""
    for key, value in state.items():
        if key not in index:
            raise CheckpointError(f"checkpoint {path} has no {key!r}: it was written for "
                                  "another model or by another optimizer")
        if tuple(value.shape) != index[key][0]:
            raise CheckpointError(f"checkpoint {path}: {key!r} has shape {list(index[key][0])}, "
                                  f"this model's is {list(value.shape)}")


def _copy_to_other_replicas(trainer, replicas: dict[str, list[torch.Tensor]]) -> None:
    """A rank holding two replicas of a stage loaded the first; the others copy it."""
    with torch.no_grad():
        for ps in replicas.values():
            src = trainer.optimizer.state[ps[0]]
            for p in ps[1:]:
                p.copy_(ps[0])
                _init_adam_state(trainer.optimizer, p)
                for key in _OPTIM_KEYS:
                    trainer.optimizer.state[p][key].copy_(src[key])


def load_model_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The parameters of a checkpoint by model-wide name, in one process (no process group).

    ``chimera.models.build_model(cfg, seed).load_state_dict(load_model_state(path))`` gives
    the single-device model the run had reached.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    index = read_index(path)
    state = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in index.items()
             if key.startswith("model.")}
    _dcp(f"reading {path}", dcp.load, state, storage_reader=_safe_reader(path), no_dist=True)
    return {key[len("model."):]: value for key, value in state.items()}
