"""Checkpoint folders on disk: where they live, writing them whole, reading them safely.

On disk (a file system every rank sees)::

    DIR/step-00000004/        .metadata  __0_0.distcp  __1_0.distcp  meta.json
    DIR/.tmp-step-00000006/   being written: never read, removed by the next save

Every rank writes into ``.tmp-*``; rank 0 then adds ``meta.json`` and renames the folder
into place, so a ``step-*`` folder is complete or absent.
Nothing is unpickled freely: DCP reads tensors with ``torch.load(weights_only=True)``, its
index goes through a restricted unpickler, and our metadata is JSON.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path

import torch

from chimera.errors import UserError
from chimera.runtime.context import collective_device
from chimera.runtime.transport import Transport
from chimera.train.faults import collective
from chimera.train.checkpoint import light

FORMAT = "chimera-checkpoint/1"
META = "meta.json"
_NAME = re.compile(r"^step-(\d{8})$")


class CheckpointError(UserError):
    """A checkpoint that cannot be used: missing, corrupt, or written for another model."""


class NonFiniteCheckpoint(RuntimeError):
    """Refused to write a checkpoint whose parameters or optimizer state are not finite."""


class CheckpointIOError(RuntimeError):
    """Writing or reading a checkpoint failed on some rank (disk, permissions, a dead peer)."""


def dcp_call(rank: int, what: str, fn, *args, **kwargs) -> None:
    """Run DCP's save or load on ``rank``; its failures (a BaseException there) become
    CheckpointIOError naming the rank."""
    from torch.distributed.checkpoint.api import CheckpointException  # DCP: start-up time

    try:
        with warnings.catch_warnings():  # DCP warns about single-process use even when asked for
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            fn(*args, **kwargs)
    except (CheckpointException, RuntimeError, OSError) as exc:
        raise CheckpointIOError(f"rank {rank}: {what} failed: {_cause(exc)}") from exc


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


def safe_reader(path: Path):
    """DCP's file reader, with the index read by :class:`_IndexUnpickler`."""
    from torch.distributed.checkpoint import FileSystemReader  # DCP: start-up time
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
    """Key -> (shape, dtype) of every tensor in a checkpoint; raises CheckpointError. Reads the
    index without importing DCP (``chimera.train.checkpoint.light``: start-up time)."""
    metadata = read_light_index(Path(path))
    index = {}
    for key, md in metadata.state_dict_metadata.items():
        if type(md).__name__ != "TensorStorageMetadata":
            raise CheckpointError(f"checkpoint {path}: entry {key!r} is not a tensor")
        index[key] = (tuple(md.size), md.properties.dtype)
    return index


def read_light_index(path: Path):
    """The ``.metadata`` of a checkpoint, its DCP classes as ``light.Record``s; CheckpointError."""
    try:
        return light.read_metadata(path, _DCP_CLASSES)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: cannot read its index (.metadata): {exc}") from None


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def rank_world(transport: Transport) -> tuple[int, int]:
    """This rank and the world size of ``transport`` ((0, 1) before a process group exists)."""
    if transport.is_initialized():
        return transport.get_rank(), transport.get_world_size()
    return 0, 1


def barrier(transport: Transport, what: str) -> None:
    if rank_world(transport)[1] > 1:
        collective(transport, what, transport.barrier)


def agree(transport: Transport, error: str | None, what: str,
          kind: type[Exception] = CheckpointIOError) -> None:
    """Every rank of ``transport`` raises ``kind`` when any had ``error`` (the ranks without
    one quietly: the rank that failed says why)."""
    flag = torch.tensor([0.0 if error is None else 1.0], device=collective_device(transport))
    if rank_world(transport)[1] > 1:
        collective(transport, f"checkpoint: {what}", transport.all_reduce, flag)
    if flag.item():
        exc = kind(error or f"{what} failed on another rank")
        exc.reported = error is None  # chimera train prints each rank's own message
        raise exc


def write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` (atomic); an older folder of that name is moved aside first."""
    old = final.with_name(f".old-{final.name}")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)
