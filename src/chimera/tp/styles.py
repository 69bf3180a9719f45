"""The plan entries: how one submodule is sharded.

Each entry says why it cannot shard a module over T ranks (``problem``: one line, or None)
and shards it (``apply``: the module to put in its place, :mod:`chimera.tp.layers`). A plan
written with torch's ``ParallelStyle``s or HF's strings is read into these (``plans``).

- ``Colwise``: an ``nn.Linear`` or HF ``Conv1D`` column-parallel; ``parts`` > 1 a fused
  projection (GPT-2's q/k/v: 3) split part by part, so each rank holds whole heads of each;
  ``gather_output``: its output gathered whole (HF's ``colwise_rep``);
- ``Rowwise``: row-parallel (on an ``nn.Embedding``: ``EmbeddingRowwise``); ``split_input``:
  given the whole input (HF's ``rowwise_rep``);
- ``EmbeddingRowwise``, ``VocabHead``: the vocabulary sharded, padded to a multiple of T
  (the head's logits gathered, or kept sharded for a vocab-parallel loss);
- ``Replicated``: left whole on every rank (HF's ``replicate``);
- ``Dropout``: an ``nn.Dropout`` drawing its mask from the TP rank's replicated or sharded
  stream (``chimera.tp.random``); ``LocalHeads(dropout=...)`` does so for attention
  probabilities;
- ``LocalHeads``: on an attention module, its head counts divided by T;
- ``SharedInput``: on a sub-block (attention, MLP) whose input feeds several column-parallel
  projections (q, k, v; gate, up): one allreduce of that input's gradient at the sub-block's
  entry, where each projection would otherwise allreduce its own (5 allreduces in a Llama
  layer's backward instead of 2). Every column-parallel projection below it must take that
  input (or a replicated function of it).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

from torch import nn

from chimera.errors import UserError
from chimera.tp.group import TPGroup, copy_to_tp
from chimera.tp.layers import (ColumnParallel, GatheredHead, RowParallel, ShardedHead, VocabEmbedding,
                               is_conv1d, widths)
from chimera.tp.random import STREAMS, TPDropout, TPRandom
from chimera.tp.shard import padded_size


def _width_problem(module: nn.Module, size_of: Callable, what: str, tp: int, parts: int = 1) -> str | None:
    if not (isinstance(module, nn.Linear) or is_conv1d(module)):
        return "column/row-wise entries take an nn.Linear or HF Conv1D (rowwise: an nn.Embedding too)"
    size = size_of(module)
    if size % (tp * parts):
        split = f" in {parts} parts" if parts > 1 else ""
        return f"T={tp} does not divide the {what} {size}{split}"
    return None


@dataclass(frozen=True)
class Colwise:
    parts: int = 1
    gather_output: bool = False

    def problem(self, module: nn.Module, tp: int) -> str | None:
        if isinstance(module, nn.Embedding):
            return "a column-wise embedding (its output sharded) is not supported: use embedding_rowwise"
        if self.gather_output and self.parts > 1:
            return "a fused projection's output cannot be gathered in its original order"
        return _width_problem(module, lambda m: widths(m)[1], "output width", tp, self.parts)

    def apply(self, module: nn.Module, tp: TPGroup, shared: bool) -> nn.Module:
        return ColumnParallel(module, tp, parts=self.parts, copy_input=not shared,
                              gather=self.gather_output)


@dataclass(frozen=True)
class Rowwise:
    split_input: bool = False

    def problem(self, module: nn.Module, tp: int) -> str | None:
        if isinstance(module, nn.Embedding):
            return EmbeddingRowwise().problem(module, tp)
        return _width_problem(module, lambda m: widths(m)[0], "input width", tp)

    def apply(self, module: nn.Module, tp: TPGroup, shared: bool) -> nn.Module:
        if isinstance(module, nn.Embedding):
            return EmbeddingRowwise().apply(module, tp, shared)
        return RowParallel(module, tp, split_input=self.split_input)


@dataclass(frozen=True)
class EmbeddingRowwise:
    """An ``nn.Embedding`` sharded by vocabulary (``VocabEmbedding``)."""

    def problem(self, module: nn.Module, tp: int) -> str | None:
        if not isinstance(module, nn.Embedding):
            return "embedding_rowwise takes an nn.Embedding"
        if module.scale_grad_by_freq or module.sparse or module.max_norm is not None:
            # each counts or renormalizes rows of the local lookup, where other ranks'
            # tokens stand in as row 0
            return "embedding_rowwise does not take max_norm, scale_grad_by_freq or sparse embeddings"
        return None

    def apply(self, module: nn.Module, tp: TPGroup, shared: bool) -> nn.Module:
        return VocabEmbedding(module, tp, padded=padded_size(module.num_embeddings, tp.size))


HEAD_LOGITS = ("auto", "gathered", "sharded")


@dataclass(frozen=True)
class VocabHead:
    """An ``nn.Linear`` LM head column-parallel over the vocabulary. ``logits``:
    ``"gathered"``, whole on every rank (``GatheredHead``), ``"sharded"``, this rank's
    columns (``ShardedHead``: for a loss that takes ``ShardedLogits``), or ``"auto"``:
    sharded where the pipeline's loss takes them (``tp.takes_sharded_logits``), else
    gathered (``parallelize(..., sharded_logits=...)`` decides)."""

    logits: str = "auto"

    def problem(self, module: nn.Module, tp: int) -> str | None:
        if self.logits not in HEAD_LOGITS:
            return f"VocabHead(logits={self.logits!r}): one of {', '.join(HEAD_LOGITS)}"
        return None if isinstance(module, nn.Linear) else "VocabHead takes an nn.Linear"

    def apply(self, module: nn.Module, tp: TPGroup, shared: bool) -> nn.Module:
        head = ShardedHead if self.logits == "sharded" else GatheredHead
        return head(module, tp, copy_input=not shared, padded=padded_size(module.out_features, tp.size))


@dataclass(frozen=True)
class Dropout:
    """An ``nn.Dropout`` whose mask comes from the TP rank's ``stream`` (``chimera.tp.random``):
    ``"replicated"`` on a replicated tensor (after a row-parallel projection or the
    vocab-parallel embedding: every TP rank draws the same mask), ``"sharded"`` on a sharded
    one (a column-parallel output: each rank its own)."""

    stream: str = "replicated"

    def problem(self, module: nn.Module, tp: int) -> str | None:
        if self.stream not in STREAMS:
            return f"Dropout(stream={self.stream!r}): one of {', '.join(STREAMS)}"
        return None if type(module) is nn.Dropout else "Dropout takes an nn.Dropout"

    def apply(self, module: nn.Module, tp: TPGroup, shared: bool) -> nn.Module:
        if module.p == 0:
            return module
        out = TPDropout(module.p, _random(tp, "a dropout"), self.stream)
        out.train(module.training)
        return out


def _random(tp: TPGroup, what: str) -> TPRandom:
    if tp.random is None:
        raise UserError(f"tensor parallel: {what} above 0 draws from the TP group's random streams, "
                        "and this TPGroup has none (TPGroup(random=TPRandom(...)); Pipeline makes them)")
    return tp.random


@dataclass(frozen=True)
class Replicated:
    """HF's ``replicate``: every rank keeps the whole module."""

    def problem(self, module: nn.Module, tp: int) -> str | None:
        return None

    def apply(self, module: nn.Module, tp: TPGroup, shared: bool) -> nn.Module:
        return module


def attribute(module: nn.Module, path: str):
    """``module.a.b`` for ``path`` "a.b" (a head count may live in the module's config)."""
    value = module
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _has(module: nn.Module, path: str) -> bool:
    try:
        attribute(module, path)
    except AttributeError:
        return False
    return True


@dataclass(frozen=True)
class LocalHeads:
    """On an attention module: its heads are split over the T ranks.

    ``heads`` / ``kv_heads``: where the module keeps its (key/value) head count, as an
    attribute path (``"n_head"``, ``"config.num_key_value_heads"``): read to check that T
    divides them. ``divide``: the attributes its forward reads that count heads (or their
    width), set to value / T. ``forward``: a replacement forward, for a module whose own one
    takes a width from its input, which stays full-width under TP. ``dropout``: the
    attribute holding the attention probabilities' dropout rate, which ``forward`` applies
    with the TP rank's sharded stream (``module.tp_random``: each rank its own heads)."""

    heads: str
    kv_heads: str | None = None
    divide: tuple[str, ...] = ()
    forward: Callable | None = None
    dropout: str | None = None

    def problem(self, module: nn.Module, tp: int) -> str | None:
        if self.dropout is not None and self.forward is None:
            return "LocalHeads(dropout=...) needs the forward that applies it"
        paths = [p for p in (self.heads, self.kv_heads, *self.divide, self.dropout) if p is not None]
        missing = [p for p in paths if not _has(module, p)]
        if missing:
            return f"LocalHeads: the module has no {', '.join(missing)} (a plan for another model?)"
        for what, path in (("heads", self.heads), ("key/value heads", self.kv_heads)):
            count = None if path is None else attribute(module, path)
            if count is not None and count % tp:
                return f"T={tp} does not divide the {count} {what} ({path})"
        return None

    def apply(self, module: nn.Module, tp: TPGroup, shared: bool) -> nn.Module:
        if self.dropout is not None and getattr(module, self.dropout) > 0:
            module.tp_random = _random(tp, f"attention dropout ({self.dropout})")
        for name in self.divide:
            setattr(module, name, getattr(module, name) // tp.size)
        if self.forward is not None:
            module.forward = types.MethodType(self.forward, module)
        return module


@dataclass(frozen=True)
class SharedInput:
    """One copy-to-TP of a sub-block's input: ``kwarg`` names it where the caller passes it
    by keyword, else it is the first positional argument."""

    kwarg: str | None = None

    def problem(self, module: nn.Module, tp: int) -> str | None:
        return None

    def apply(self, module: nn.Module, tp: TPGroup, shared: bool) -> nn.Module:
        module.register_forward_pre_hook(_SharedCopy(self.kwarg, tp), with_kwargs=True)
        return module


class _SharedCopy:
    """The pre-hook of a ``SharedInput``: its input through ``copy_to_tp`` (a class, not a
    closure: a deep copy of the layer copies it)."""

    def __init__(self, kwarg: str | None, tp: TPGroup):
        self.kwarg, self.tp = kwarg, tp

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        if self.kwarg is not None and self.kwarg in kwargs:
            return args, {**kwargs, self.kwarg: copy_to_tp(kwargs[self.kwarg], self.tp)}
        if not args:
            raise TypeError(f"tensor parallel: {type(module).__name__} was called without its shared "
                            f"input ({self.kwarg or 'first positional argument'})")
        return (copy_to_tp(args[0], self.tp), *args[1:]), kwargs
