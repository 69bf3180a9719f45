"""A checkpoint's index and model tensors read without importing ``torch.distributed.checkpoint``.

DCP's package imports DTensor and, through it, sympy and torch.fx: seconds of start-up that
one process reading a model (``chimera generate``, ``chimera export``) does not need. Its
index (``.metadata``) is a pickle of a few dataclasses: ``_IndexUnpickler``'s allow-list, read
here into plain stand-ins (``Record``) of the same names; a model tensor is one whole chunk
that ``torch.save`` wrote at a recorded offset of a ``.distcp`` file (the layout of DCP's
``FileSystemWriter``). Anything else (a chunked tensor, a storage transform) is left to DCP
itself: ``model_state`` returns None and the caller reads it through ``dcp.load``.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch

DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


class Record:
    """A stand-in for one of DCP's index classes (``type(r).__name__`` is the class's name):
    the fields its pickle holds, as attributes."""

    def __init__(self, *args, **kwargs):
        self.args = args  # an enum's value
        self.__dict__.update(kwargs)

    def __setstate__(self, state):
        if type(self).__name__ == "TensorProperties":  # (dtype, layout, requires_grad, ...)
            state = {"dtype": state[0]}
        elif isinstance(state, tuple):  # (dict, slots) of a class with __slots__
            state = {**(state[0] or {}), **(state[1] or {})}
        self.__dict__.update(state)


class _LightUnpickler(pickle.Unpickler):
    """The index's allow-list (``disk._DCP_CLASSES``), DCP's classes read as ``Record``s."""

    allowed: dict = {}
    _records: dict = {}

    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name not in self.allowed.get(module, ()):
            raise pickle.UnpicklingError(f"the checkpoint index refers to {module}.{name}, "
                                         "which a checkpoint never needs")
        if module in DCP_MODULES:
            return self._records.setdefault(name, type(name, (Record,), {}))
        return super().find_class(module, name)


def read_metadata(path: Path, allowed: dict):
    """The ``.metadata`` of the checkpoint folder ``path``, DCP's classes as ``Record``s."""
    _LightUnpickler.allowed = allowed
    with open(path / ".metadata", "rb") as f:
        return _LightUnpickler(f).load()


def model_state(path: Path, metadata) -> dict[str, torch.Tensor] | None:
    """Every ``model.*`` tensor by its key, read from the ``.distcp`` files; None when one is
    not stored as one whole ``torch.save`` (DCP reads those)."""
    where = {index.fqn: info for index, info in metadata.storage_data.items()
             if index.fqn.startswith("model.")}
    state = {}
    for key, md in metadata.state_dict_metadata.items():
        if not key.startswith("model."):
            continue
        info, chunks = where.get(key), getattr(md, "chunks", None) or []
        whole = len(chunks) == 1 and not any(chunks[0].offsets) and info is not None
        if not whole or getattr(info, "transform_descriptors", None) or index_of(metadata, key):
            return None
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        tensor = torch.load(io.BytesIO(data), weights_only=True)
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(md.size) \
                or tensor.dtype != md.properties.dtype:
            return None
        state[key] = tensor
    return state


def index_of(metadata, key: str) -> int:
    """How many storage entries beyond the first a key has (0: one whole entry)."""
    return sum(1 for index in metadata.storage_data if index.fqn == key) - 1
