"""Apply a plan to one layer: resolve it, check it whole, then shard.

Every check runs before the first parameter is touched: a plan that fails leaves the layer
as it was, and says why in one line (``UserError``): a pattern that matches nothing, a
submodule two patterns claim, a style for a module it cannot shard, and T not dividing
what it must split (heads, key/value heads, an MLP or projection width). A vocabulary is
padded instead (``vocab``).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel,
                                               parallelize_module)

from chimera.errors import UserError
from chimera.tp.plans import Plan, styles
from chimera.tp.styles import Colwise, LocalHeads, Replicated, Rowwise, is_conv1d, widths
from chimera.tp.vocab import VocabEmbedding, VocabHead


def tp_mesh(group, device_type: str = "cpu") -> DeviceMesh:
    """The 1-D mesh of an existing TP process group (``"cpu"`` on gloo, ``"cuda"`` on NCCL):
    the runtime creates every group in one global order, so the mesh must not make its own."""
    return DeviceMesh.from_group(group, device_type)


def resolve(layer: nn.Module, plan: Plan, tp: int) -> dict[str, tuple[ParallelStyle, ...]]:
    """Submodule name -> its styles, every entry checked for ``tp`` ranks; raises UserError."""
    if not isinstance(tp, int) or tp < 1:
        raise UserError(f"tensor parallel: T must be a positive integer, got {tp!r}")
    names = [name for name, _ in layer.named_modules() if name]
    chosen: dict[str, tuple[str, tuple[ParallelStyle, ...]]] = {}
    for pattern, value in plan.items():
        matched = [n for n in names if fnmatchcase(n, pattern)]
        if not matched:
            raise UserError(f"tensor parallel: plan pattern {pattern!r} matches no submodule of "
                            f"{type(layer).__name__} (it has {', '.join(names[:12])}"
                            f"{', ...' if len(names) > 12 else ''})")
        for name in matched:
            if name in chosen:
                raise UserError(f"tensor parallel: {name} is matched by both "
                                f"{chosen[name][0]!r} and {pattern!r}")
            chosen[name] = (pattern, styles(value))
    modules = dict(layer.named_modules())
    for name, (_, entries) in chosen.items():
        for problem in filter(None, (_problem(modules[name], e, tp) for e in entries)):
            raise UserError(f"tensor parallel: {name} ({type(modules[name]).__name__}): {problem}")
    return {name: entries for name, (_, entries) in chosen.items()}


def _problem(module: nn.Module, entry: ParallelStyle, tp: int) -> str | None:
    """Why ``entry`` cannot shard ``module`` over ``tp`` ranks, or None."""
    if any(isinstance(p, DTensor) for p in module.parameters()):
        return "already sharded (parallelize a layer once)"
    if isinstance(entry, (LocalHeads, Replicated, VocabEmbedding, VocabHead)):
        return entry.problem(module, tp)
    if isinstance(entry, (ColwiseParallel, RowwiseParallel)):
        return _width_problem(module, entry, tp)
    return None  # a style of the user's own: torch's parallelize_module applies it as it is


def _width_problem(module: nn.Module, entry: ParallelStyle, tp: int) -> str | None:
    colwise = isinstance(entry, ColwiseParallel)
    if isinstance(module, nn.Embedding):
        size, what = (module.embedding_dim, "embedding width") if colwise else \
            (module.num_embeddings, "vocabulary (use VocabEmbedding, which pads it)")
        return None if size % tp == 0 else f"T={tp} does not divide the {what} {size}"
    if not (isinstance(module, nn.Linear) or is_conv1d(module)):
        return "column/row-wise styles take an nn.Linear, nn.Embedding or HF Conv1D"
    if is_conv1d(module) and not isinstance(entry, (Colwise, Rowwise)):
        return "torch's styles do not take HF's Conv1D: use 'colwise' / 'rowwise' (tp.Colwise, tp.Rowwise)"
    n_in, n_out = widths(module)
    parts = getattr(entry, "parts", 1) if colwise else 1
    size, what = (n_out, "output width") if colwise else (n_in, "input width")
    if size % (tp * parts):
        split = f" in {parts} parts" if parts > 1 else ""
        return f"T={tp} does not divide the {what} {size}{split}"
    return None


def parallelize(layer: nn.Module, plan: Plan, mesh: DeviceMesh) -> nn.Module:
    """Shard ``layer`` in place over the 1-D ``mesh`` as ``plan`` says; returns it.

    Its input must be replicated over the mesh and its output is replicated and plain where
    the plan pairs every column-parallel projection with a row-parallel one (the built-in
    plans do). Parameters the plan does not name stay plain and replicated."""
    if mesh.ndim != 1:
        raise UserError(f"tensor parallel: the mesh must be 1-D (one TP group), got {mesh.ndim}-D")
    for name, entries in resolve(layer, plan, mesh.size()).items():
        for entry in entries:
            parallelize_module(layer.get_submodule(name), mesh, entry)
    return layer
