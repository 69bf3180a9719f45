"""Apply a plan to one layer: resolve it, check it whole, then shard.

Every check runs before the first parameter is touched: a plan that fails leaves the layer
as it was, and says why in one line (``UserError``): a pattern that matches nothing, a
submodule two patterns claim, an entry for a module it cannot shard, T not dividing what it
must split (heads, key/value heads, an MLP or projection width), and a dropout under T > 1
that the plan does not draw from the TP random streams (``chimera.tp.random``; it would draw
from torch's global RNG, each rank its own masks). A vocabulary is padded instead.

Sharding needs no communication: every rank of the TP group built the same whole layer
(from the same seed), and each keeps its slice of every sharded parameter.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from chimera.errors import UserError
from chimera.tp.group import TPGroup
from chimera.tp.layers import TPModule
from chimera.tp.plans import Entry, Plan, styles
from chimera.tp.styles import Colwise, Dropout, EmbeddingRowwise, LocalHeads, Rowwise, SharedInput, VocabHead

SHARDING = (Colwise, Rowwise, EmbeddingRowwise, VocabHead)  # entries that replace the module

DROPOUT_ATTRIBUTES = "drop"  # a float attribute whose name holds this is a dropout rate


def resolve(layer: nn.Module, plan: Plan, tp: int) -> dict[str, tuple[Entry, ...]]:
    """Submodule name -> its entries, every entry checked for ``tp`` ranks; raises UserError."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise UserError(f"tensor parallel: T must be a positive integer, got {tp!r}")
    names = [name for name, _ in layer.named_modules() if name]
    chosen: dict[str, tuple[str, tuple[Entry, ...]]] = {}
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
        for problem in filter(None, (_problem(modules[name], entries, e, tp) for e in entries)):
            raise UserError(f"tensor parallel: {name} ({type(modules[name]).__name__}): {problem}")
    _refuse_ties(layer, [n for n, (_, entries) in chosen.items() if any(isinstance(e, SHARDING) for e in entries)])
    resolved = {name: entries for name, (_, entries) in chosen.items()}
    if tp > 1:
        _refuse_dropout(layer, tp, resolved)
    return resolved


def _problem(module: nn.Module, entries: tuple, entry: Entry, tp: int) -> str | None:
    """Why ``entry`` (one of ``entries``) cannot shard ``module`` over ``tp`` ranks, or None."""
    if isinstance(module, TPModule):
        return "already sharded (parallelize a layer once)"
    if sum(isinstance(e, SHARDING) for e in entries) > 1:
        return f"sharded twice ({', '.join(map(repr, entries))})"
    return entry.problem(module, tp)


def _refuse_ties(layer: nn.Module, sharded: list[str]) -> None:
    """A Parameter of a sharded module that another module of the layer holds too (a tie):
    each would get a slice of its own, and the tie would be cut without a word."""
    owners: dict[int, list[str]] = {}
    for name, p in layer.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    for name in sharded:
        for p in layer.get_submodule(name).parameters():
            if len(owners[id(p)]) > 1:
                raise UserError(f"tensor parallel: {' and '.join(owners[id(p)])} are one Parameter "
                                f"(tied within one layer), which TP cannot shard; hold them in two layers")


def _routed(entries: tuple) -> set[str]:
    """The dropout rates of a module that its entries draw from the TP streams: an
    ``nn.Dropout``'s ``p`` (``Dropout``), an attention's rate (``LocalHeads(dropout=...)``)."""
    return {"p" if isinstance(e, Dropout) else e.dropout for e in entries
            if isinstance(e, Dropout) or (isinstance(e, LocalHeads) and e.dropout)}


def _refuse_dropout(layer: nn.Module, tp: int, resolved: dict) -> None:
    """A dropout rate above 0 that the plan does not route through the TP streams
    (``chimera.tp.random``) would draw from torch's global RNG: a replicated tensor's mask
    would differ across the T ranks (virtual ranks share that RNG in no fixed order)."""
    for name, module in layer.named_modules():
        rates = {key: value for key, value in vars(module).items()
                 if DROPOUT_ATTRIBUTES in key.lower() and isinstance(value, float) and value > 0}
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            rates["p"] = module.p
        for key in _routed(resolved.get(name, ())):
            rates.pop(key, None)
        for key, value in rates.items():
            where = f"{name}.{key}" if name else key
            raise UserError(f"tensor parallel: T={tp} with dropout in {type(layer).__name__} "
                            f"({where}={value}), which its plan does not draw from the TP random "
                            "streams (tp.Dropout, LocalHeads(dropout=...)): each rank would draw "
                            "its own masks; set dropout to 0")


def parallelize(layer: nn.Module, plan: Plan, tp: TPGroup, *, sharded_logits: bool = False) -> nn.Module:
    """Shard ``layer`` in place over the TP group ``tp`` as ``plan`` says; returns it.

    Each matched projection, embedding or head is replaced by its sharded module
    (``layers``), holding this rank's slices as plain Parameters; attention modules get their
    local head counts. Its input must be replicated over the group, and its output is
    replicated and plain where the plan pairs every column-parallel projection with a
    row-parallel one (the built-in plans do). Parameters the plan does not name stay whole.
    ``sharded_logits``: the loss takes ``ShardedLogits``, so a ``VocabHead(logits="auto")``
    keeps its logits sharded (else it gathers them). At T = 1 the plan is checked and the
    layer returned unchanged."""
    resolved = resolve(layer, plan, tp.size)
    if sharded_logits:
        resolved = {name: tuple(VocabHead("sharded") if e == VocabHead("auto") else e for e in entries)
                    for name, entries in resolved.items()}
    if tp.size == 1:
        return layer
    shared = [name for name, entries in resolved.items()
              if any(isinstance(e, SharedInput) for e in entries)]
    # deepest first: an entry on a parent (LocalHeads' forward) then sees its sharded children
    for name in sorted(resolved, key=lambda n: -n.count(".")):
        module = layer.get_submodule(name)
        below_shared = any(name.startswith(s + ".") for s in shared)
        for entry in resolved[name]:
            module = entry.apply(module, tp, below_shared)
        parent, _, child = name.rpartition(".")
        setattr(layer.get_submodule(parent), child, module)
    return layer
