"""Weights in and out: a layer's tensors read one key at a time from a ``save_pretrained``
folder's safetensors, and a pipeline's state written back as one.

Reading: a layer is built on the meta device, given memory, and every tensor HF would load
is read by its own key (``safe_open(...).get_tensor(key)``), so a rank reads the tensors of
the stages it holds and nothing else. What a checkpoint never holds (non-persistent buffers:
RoPE frequencies, BERT's position ids) is written by HF's own ``_init_weights``, as
``from_pretrained`` does; a config alone initializes everything that way. A tensor that
nothing wrote is refused by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from chimera.errors import UserError

INDEX = "model.safetensors.index.json"


class Checkpoint:
    """The safetensors of a folder: which file holds each key; ``read`` logs every key read."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self.files = {k: folder / f for k, f in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise UserError(f"{index}: not a safetensors index ({exc})") from None
        else:
            self.files = {}
            for path in sorted(folder.glob("*.safetensors")):
                with _opened(path) as f:
                    self.files.update({k: path for k in f.keys()})
        self.read: list[str] = []

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every key's shape, from the files' headers (no tensor is read); UserError for a
        file that is corrupt, truncated or missing."""
        out = {}
        for path in sorted(set(self.files.values())):
            with _opened(path) as f:
                out.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        return out

    @staticmethod
    def present(folder: Path) -> bool:
        return (folder / INDEX).exists() or any(folder.glob("*.safetensors"))

    def find(self, candidates: list[str]) -> str | None:
        return next((k for k in candidates if k in self.files), None)

    def get(self, key: str) -> torch.Tensor:
        self.read.append(key)
        with _opened(self.files[key]) as f:
            return f.get_tensor(key)


@contextlib.contextmanager
def _opened(path: Path):
    """``safe_open``, a damaged file one line: safetensors checks the header against the
    file's size, so a truncated or overwritten file fails here, before any tensor is read."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as exc:
        raise UserError(f"{path}: not a readable safetensors file ({str(exc).splitlines()[0]}); "
                        "save the weights again") from None


def check_shapes(folder: Path, expected: list[tuple[tuple, list[str]]],
                 shapes: dict[str, tuple]) -> None:
    """``expected``: (shape, candidate keys best first, as ``load_layer`` reads them) per
    tensor; ``shapes``: the checkpoint's. UserError naming the first missing or different."""
    for want, candidates in expected:
        key = next((k for k in candidates if k in shapes), None)
        if key is None:
            raise UserError(f"{folder}: no tensor {candidates[0]}; the weights do not match the "
                            "config")
        if shapes[key] != want:
            raise UserError(f"{folder}: {key} has shape {shapes[key]}, the config makes {want}")


def clear_init_flags(layer: nn.Module) -> None:
    """HF marks initialized modules and tensors ``_is_hf_initialized`` (its init then skips
    them); copies of an initialized model carry the mark: drop it before initializing."""
    for m in layer.modules():
        m.__dict__.pop("_is_hf_initialized", None)
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            if t is not None:
                t.__dict__.pop("_is_hf_initialized", None)


def cast_parameters(layer: nn.Module, dtype: torch.dtype) -> None:
    """Floating parameters and persistent buffers to ``dtype``; non-persistent buffers keep
    the dtype HF made them in (RoPE frequencies stay float32 in a bfloat16 model, as in HF)."""
    memo: dict[int, torch.Tensor] = {}
    for m in layer.modules():
        for k, p in m._parameters.items():
            if p is not None and p.is_floating_point():
                if id(p) not in memo:
                    memo[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                m._parameters[k] = memo[id(p)]
        for k, b in m._buffers.items():
            if b is not None and b.is_floating_point() and k not in m._non_persistent_buffers_set:
                m._buffers[k] = b.to(dtype)


def tie_within(layer: nn.Module, pairs: list[tuple[str, str]]) -> None:
    """(target, source) local names: the target becomes the source's Parameter."""
    for target, source in pairs:
        owner, _, attr = target.rpartition(".")
        setattr(layer.get_submodule(owner) if owner else layer, attr, layer.get_parameter(source))


def _tensors(layer: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(layer.named_parameters(remove_duplicate=False))
    out.update(layer.named_buffers(remove_duplicate=False))
    return out


def _poison(tensors: dict[str, torch.Tensor]) -> None:
    """NaN (or the smallest integer) everywhere: what init and loading leave unwritten shows."""
    with torch.no_grad():
        for t in tensors.values():
            if t.is_floating_point():
                t.fill_(float("nan"))
            elif t.dtype != torch.bool:
                t.fill_(torch.iinfo(t.dtype).min)


def _unwritten(tensors: dict[str, torch.Tensor]) -> list[str]:
    out = []
    for name, t in tensors.items():
        if t.is_floating_point():
            if bool(t.isnan().any()):
                out.append(name)
        elif t.dtype != torch.bool and bool((t == torch.iinfo(t.dtype).min).any()):
            out.append(name)
    return out


def load_layer(layer: nn.Module, index: int, names: dict[str, list[str]], ckpt: Checkpoint | None,
               hf_init) -> None:
    """Give a meta ``layer`` memory and values: each tensor from the first of its candidate
    keys in ``ckpt`` (``names``: local name -> HF keys, best first), the rest from
    ``hf_init`` (HF's ``_initialize_weights``, children before parents as in HF)."""
    from transformers import initialization  # start-up time: transformers loads its model classes lazily too

    tensors = _tensors(layer)
    _poison(tensors)
    with torch.no_grad():
        for local, t in tensors.items():
            key = None if ckpt is None or local not in names else ckpt.find(names[local])
            if ckpt is not None and local in names and key is None:
                raise UserError(f"{ckpt.folder}: no tensor {names[local][0]} (layer {index}); the "
                                 "weights do not match the config")
            if key is None:
                continue
            value = ckpt.get(key)
            if tuple(value.shape) != tuple(t.shape):
                raise UserError(f"{ckpt.folder}: {key} has shape {tuple(value.shape)}, the config "
                                 f"makes {tuple(t.shape)}")
            t.copy_(value)
            t._is_hf_initialized = True
        with initialization.guard_torch_init_functions():
            _post_order(layer, hf_init)
    clear_init_flags(layer)
    missing = _unwritten(tensors)
    if missing:
        raise ValueError(f"layer {index}: nothing wrote {', '.join(missing[:4])} (neither the "
                         "checkpoint nor HF's initialization)")


def _post_order(module: nn.Module, fn) -> None:
    for child in module.children():
        _post_order(child, fn)
    fn(module)




def save_folder(folder: Path, tensors: dict[str, torch.Tensor], config) -> None:
    """``config.json`` and ``model.safetensors`` as ``save_pretrained`` writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(folder))
    plain = {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
    path = folder / "model.safetensors"
    try:
        save_file(plain, str(path), metadata={"format": "pt"})
    except SafetensorError as exc:  # its I/O errors carry the errno in the text only
        code = re.search(r"os error (\d+)", str(exc))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None
