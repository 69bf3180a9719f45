"""Building a user's model per stage: layers, ties, partition checks, meta materialization.

Two ways in, both deterministic across ranks:

- ``make_layers()`` returns every layer (called once per rank, seeded): shared Parameters
  (ties) are found by identity before anything is copied, and each held stage replica is
  one ``deepcopy`` of its layers (so ties inside a stage stay one Parameter).
- ``make_layer(i)`` with ``num_layers``: a rank builds only the layers it holds, each seeded
  by ``layer_seed(seed, i)`` so every replica of a layer gets the same weights (use
  :func:`build_layers` to build the same model in one process). Ties must be named
  (``ties=[("0.wte.weight", "11.weight")]``).

Layers on the meta device are materialized per stage (``to_empty`` on the runtime's device,
then ``init(layer)``, by default every submodule's ``reset_parameters()``, seeded per layer).
"""

from __future__ import annotations

import copy
import warnings
from typing import Callable, Sequence

import torch
from torch import nn

from chimera.errors import UserError
from chimera.ir import ScheduleError
from chimera.rng import seeded  # noqa: F401  (re-exported: chimera.hf and users import it here)
from chimera.runtime.boundary import Stage
from chimera.runtime.shared import Tie


def layer_seed(seed: int, index: int) -> int:
    return seed * 1_000_003 + index


def build_layers(make_layer: Callable[[int], nn.Module], num_layers: int, seed: int = 0) -> list[nn.Module]:
    """The layers ``Pipeline(make_layer, num_layers=...)`` builds, all in one process (for a
    single-device reference or an export)."""
    out = []
    for i in range(num_layers):
        with seeded(layer_seed(seed, i)):
            out.append(make_layer(i))
    return out


def check_partition(ranges: Sequence, num_layers: int, stages: int) -> list[range]:
    """Contiguous, non-empty ranges covering layers 0..num_layers-1 once each, in order."""
    if len(ranges) != stages:
        raise ScheduleError(f"partition has {len(ranges)} stages, the schedule needs {stages}")
    out, expected = [], 0
    for k, r in enumerate(ranges):
        idx = list(r)
        if not idx or idx != list(range(idx[0], idx[0] + len(idx))):
            raise ScheduleError(f"partition: stage {k} ({r}) must be a non-empty contiguous range")
        if idx[0] > expected:
            raise ScheduleError(f"partition: layers {expected}..{idx[0] - 1} are in no stage (a gap "
                                f"before stage {k})")
        if idx[0] < expected:
            raise ScheduleError(f"partition: layers {idx[0]}..{expected - 1} are in two stages "
                                f"(stage {k} overlaps the one before)")
        expected = idx[-1] + 1
        out.append(range(idx[0], expected))
    if expected != num_layers:
        what = (f"layers {expected}..{num_layers - 1} are in no stage" if expected < num_layers
                else f"stage {stages - 1} ends at layer {expected - 1}, past the model's last layer "
                     f"{num_layers - 1}")
        raise ScheduleError(f"partition: {what}")
    return out


def refuse_sharded_ties(tied: Sequence[str], option: str = "shard_optimizer=True") -> None:
    """The one refusal of a sharded optimizer with weights tied across stages (the API's and
    ``chimera train``'s): ``tied`` names the ties (their first names; empty: nothing to
    refuse), ``option`` is how the caller spells sharding."""
    if tied:
        raise UserError(f"{option} with weights tied across stages ({', '.join(tied)}) is not "
                        "supported: a tie's gradient sum needs whole gradients, a sharded replica "
                        f"holds a slice; untie them or train without {option.split('=')[0]}")


def _is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


def default_init(layer: nn.Module) -> None:
    for m in layer.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()


def _materialize(layer: nn.Module, index: int, device, init, seed: int) -> None:
    """Meta layer -> real memory, written by ``init``. Floating tensors start as NaN so that
    one ``init`` leaves unwritten (a module's own Parameter without ``reset_parameters``, a
    non-persistent buffer) is refused by name instead of training on uninitialized memory."""
    layer.to_empty(device=device)
    tensors = dict(layer.named_parameters())
    tensors.update(layer.named_buffers())
    with torch.no_grad():
        for t in tensors.values():
            if t.is_floating_point():
                t.fill_(float("nan"))
    with seeded(seed):
        init(layer)
    unwritten = [n for n, t in tensors.items() if t.is_floating_point() and bool(t.isnan().any())]
    if unwritten:
        raise UserError(f"layer {index} was built on the meta device and init left "
                         f"{', '.join(unwritten[:4])} unwritten: pass Pipeline(init=fn) that sets "
                         "every parameter and buffer (the default calls reset_parameters())")


class LayerSource:
    """Where the layers come from; builds one stage replica's ``Stage`` on demand."""

    def __init__(self, layers, num_layers: int | None, seed: int, ties: Sequence | None,
                 init: Callable[[nn.Module], None] | None = None):
        self.seed, self.init = seed, init or default_init
        self.factory = None
        if num_layers is not None:  # make_layer(i): nothing built beyond what a rank holds
            self.factory, self.num_layers, self.layers = layers, num_layers, None
            found: list[tuple[str, ...]] = []
        else:
            if callable(layers) and not isinstance(layers, nn.Module):
                with seeded(seed):
                    layers = list(layers())
            self.layers = [as_module(layer, i) for i, layer in enumerate(layers)]
            self.num_layers = len(self.layers)
            found = find_ties(self.layers)
        self.tie_names = merge_ties(found + [tuple(t) for t in (ties or [])])
        self.stages_of: list[range] = []

    def costs(self) -> list[float]:
        """Per layer, 1 + its parameter count (for a balanced partition)."""
        if self.layers is not None:
            return [1.0 + sum(p.numel() for p in layer.parameters()) for layer in self.layers]
        try:
            with seeded(self.seed), torch.device("meta"):
                return [1.0 + sum(p.numel() for p in as_module(self.factory(i), i).parameters())
                        for i in range(self.num_layers)]
        except Exception:  # noqa: BLE001 -- a factory that cannot build on meta: count layers
            return [1.0] * self.num_layers

    def ties(self, ranges: list[range]) -> list[Tie]:
        stage_of = {i: k for k, r in enumerate(ranges) for i in r}
        out = []
        for names in self.tie_names:
            for n in names:
                if not n.split(".", 1)[0].isdigit() or int(n.split(".", 1)[0]) not in stage_of:
                    raise UserError(f"tie {names}: {n!r} is not a model-wide parameter name "
                                     f"('<layer index>.<name in the layer>', layers 0..{self.num_layers - 1})")
            out.append(Tie(tuple(names), tuple(stage_of[int(n.split(".", 1)[0])] for n in names)))
        return out

    def stage(self, indices: range, ties: list[Tie], device: torch.device, compile_opts,
              shard: Callable[[int, nn.Module], nn.Module] | None = None,
              adapt: Callable[[int, nn.Module], nn.Module] | None = None,
              freeze: Callable[[nn.Module], nn.Module] | None = None) -> Stage:
        """The layers ``indices`` as one Stage: built (or copied), materialized, each given
        its adapters by ``adapt(index, layer)`` (LoRA) and sharded by ``shard(index, layer)``
        (tensor parallelism: whole layers in, this rank's shards out, before ties are made one
        Parameter again and before compiling), tied, frozen by ``freeze(stage)``, compiled."""
        def ready(i: int, layer: nn.Module) -> nn.Module:  # one whole layer alive at a time
            if _is_meta(layer):
                _materialize(layer, i, device, self.init, layer_seed(self.seed, i))
            layer = layer if adapt is None else adapt(i, layer)
            return layer if shard is None else shard(i, layer)

        if self.layers is not None:
            layers = copy.deepcopy([self.layers[i] for i in indices])  # one memo: ties inside survive
            for i, layer in zip(indices, layers):
                _carry_compile(self.layers[i], layer, i)
            layers = [ready(i, layer) for i, layer in zip(indices, layers)]
        else:
            layers = [ready(i, self._build(i)) for i in indices]
        stage = Stage(dict(zip(indices, layers)))
        retie(stage, ties)
        if freeze is not None:
            freeze(stage)
        if compile_opts is not None:
            stage.compile(**compile_opts)
        return stage

    def _build(self, i: int) -> nn.Module:
        with seeded(layer_seed(self.seed, i)):
            return as_module(self.factory(i), i)


class FunctionLayer(nn.Module):
    """A plain function (``torch.relu``, a ``def``) as a layer: no parameters, no state."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)

    def extra_repr(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))


def as_module(layer, index: int) -> nn.Module:
    """A layer as a Module: a function is wrapped (as ``nn.Sequential`` would refuse it, but
    an activation between layers is a natural thing to list); anything else is refused."""
    if isinstance(layer, nn.Module):
        _refuse_hf_part(layer, index)
        return layer
    if callable(layer):
        return FunctionLayer(layer)
    raise UserError(f"layer {index} is a {type(layer).__name__}, not an nn.Module or a function")


# transformers' base classes of a whole model and of its decoder/encoder layers (by name: no
# import of transformers here)
_HF_PARTS = {("transformers.modeling_utils", "PreTrainedModel"): "model",
             ("transformers.modeling_layers", "GradientCheckpointingLayer"): "layer"}


def _refuse_hf_part(layer: nn.Module, index: int) -> None:
    """A Hugging Face model, or one of its decoder layers, listed as a layer: its layers need
    the attention mask and rotary embeddings its model's ``forward`` makes (called alone, a
    Llama layer fails on its missing position embeddings and an eager one attends to the
    future); chimera.hf calls them as HF's forward does."""
    kind = next((_HF_PARTS[(c.__module__, c.__name__)] for c in type(layer).__mro__
                 if (c.__module__, c.__name__) in _HF_PARTS), None)
    if kind is not None:
        raise UserError(f"layer {index} is Hugging Face's {type(layer).__name__} (a {kind} of a "
                        "transformers model, which needs the masks and position embeddings its "
                        "model's forward makes): pipeline the model with chimera.hf instead, "
                        "hf.load(model).pipeline(schedule=..., stages=...)")


def _carry_compile(original: nn.Module, copied: nn.Module, index: int) -> None:
    """``deepcopy`` drops a ``module.compile()`` made in ``make_layers``: compile the copy
    again (default options: the original's are not recoverable), and say so."""
    for (name, a), b in zip(original.named_modules(), copied.modules()):
        if getattr(a, "_compiled_call_impl", None) is not None and b._compiled_call_impl is None:
            warnings.warn(f"layer {index}{'.' + name if name else ''} was compiled in make_layers; "
                          "its stage copy is compiled again with default options (pass "
                          "Pipeline(compile={...}) to choose them)", stacklevel=4)
            b.compile()


def find_ties(layers: list[nn.Module]) -> list[tuple[str, ...]]:
    """Model-wide names of every Parameter object used under more than one name."""
    names: dict[int, list[str]] = {}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(f"{i}.{name}")
    return [tuple(n) for n in names.values() if len(n) > 1]


def merge_ties(groups: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Union of overlapping groups; each group's names in model order, first is the name."""
    merged: list[set[str]] = []
    for g in groups:
        g = set(g)
        for m in [m for m in merged if m & g]:
            g |= m
            merged.remove(m)
        merged.append(g)

    def order(n: str) -> tuple:
        head, rest = n.split(".", 1) if "." in n else (n, "")
        return (int(head) if head.isdigit() else -1, rest)
    return sorted((tuple(sorted(m, key=order)) for m in merged if len(m) > 1), key=lambda t: order(t[0]))


def retie(stage: Stage, ties: list[Tie]) -> None:
    """Names of one tie inside one stage point at one Parameter (the first's)."""
    held = {n for n, _ in stage.named_parameters(remove_duplicate=False)}
    for tie in ties:
        names = [n for n in tie.names if n in held]
        if len(names) < 2:
            continue
        first = stage.get_parameter(names[0])
        for n in names[1:]:
            owner, _, attr = n.rpartition(".")
            setattr(stage.get_submodule(owner), attr, first)
