"""The cost profile: measured per-layer costs and links, ``chimera.profile/1`` (no torch).

One schema, one parser, one type for everything that reads a profile: ``chimera simulate
--profile`` (:func:`cost_from_profile`), ``chimera plan --profile`` (``plan.workload``) and
trace replay with the profile's links (:mod:`chimera.sim.replay`). ``chimera profile``
(``bench.profiler``) writes it::

    {"schema": "chimera.profile/1",
     "model": "gpt2-bench",                  # the preset measured (cuts stages as the runtime does)
     "micro_batch": 4,                       # B the layers were measured at
     "layers": [                             # one per layer: embedding, blocks, head
       {"forward_s": 0.0011, "backward_s": 0.0023,
        "input_backward_s": 0.0012, "weight_backward_s": 0.0011,   # optional, all or none
        "activation_bytes": 4194304, "output_bytes": 524288,
        "param_bytes": 1048576}, ...],                             # param_bytes: optional
     "p2p": {"alpha_s": 5e-05, "beta_bytes_per_s": 2e9},
     "allreduce": {"alpha_s": 1e-4, "beta_bytes_per_s": 1e9},   # per ring step
     "optimizer_s_per_byte": 2e-10,          # optional: AdamW step per byte of param_bytes
     "memory_gib": 8}                        # optional: per rank

Times are seconds and bytes are per micro-batch of ``micro_batch`` sequences. ``backward_s``
is the full backward; without the split times, I and W are taken as half of it each.
``optimizer_s_per_byte`` prices a replica's optimizer step (its stage's ``param_bytes`` times
it; absent: the simulator takes the step as free, as profiles written before it assumed, and
the planner estimates it from the hardware's memory bandwidth). Other
fields (the writer's date, threads, link samples) are kept in the file and ignored here.
Standard JSON only: ``Infinity`` and ``NaN`` are refused, as is any negative number.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from chimera.errors import UserError
from chimera.ir import Schedule
from chimera.modelcfg import PRESETS, layer_costs, partition
from chimera.sim.cost import CostModel, Link
from chimera.sim.trace import strict_json

PROFILE_SCHEMA = "chimera.profile/1"
_SPLIT = ("input_backward_s", "weight_backward_s")


class ProfileError(UserError):
    """A file that is not a usable profile: the CLI prints its one line and exits 2."""


@dataclass(frozen=True)
class LayerProfile:
    forward_s: float
    backward_s: float
    activation_bytes: float  # kept for backward, per micro-batch, without recomputation
    output_bytes: float  # the layer's output: what crosses a stage boundary
    input_backward_s: float | None = None  # split backward: I, then W (both or neither)
    weight_backward_s: float | None = None
    param_bytes: float = 0.0  # its gradients' bytes: what its stage allreduces


@dataclass(frozen=True)
class Profile:
    """A parsed ``chimera.profile/1`` file (module docstring)."""

    micro_batch: int
    layers: tuple[LayerProfile, ...]
    p2p: Link
    allreduce: Link  # per ring step
    memory_gib: float | None = None
    model: str = ""
    source: str = field(default="", compare=False)
    optimizer_s_per_byte: float = 0.0

    @property
    def split(self) -> bool:
        """Whether the layers carry measured I and W (all of them do, or none)."""
        return self.layers[0].input_backward_s is not None


# -- reading --------------------------------------------------------------------------------
def load_profile(path: str) -> Profile:
    """Read and check a profile file; :class:`ProfileError` with one line when it is not one."""
    try:
        with open(path) as f:
            data = strict_json(f.read())
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"profile {path!r} is not JSON: {exc.msg} at line {exc.lineno}") from None
    except ValueError as exc:  # Infinity, NaN
        raise ProfileError(f"profile {path!r}: {exc}") from None
    return parse_profile(data, source=path)


def parse_profile(data, source: str = "") -> Profile:
    """The profile in ``data`` (a parsed JSON object); ``source`` names it in errors."""
    where = source or "profile"
    if not isinstance(data, dict) or data.get("schema") != PROFILE_SCHEMA:
        raise ProfileError(f"{where}: not a profile (expected \"schema\": \"{PROFILE_SCHEMA}\")")
    micro = data.get("micro_batch")
    if not isinstance(micro, int) or isinstance(micro, bool) or micro < 1:
        raise ProfileError(f"{where}: micro_batch must be a positive integer, got {micro!r}")
    layers = data.get("layers")
    if not isinstance(layers, list) or not layers:
        raise ProfileError(f"{where}: layers must be a non-empty list (one object per layer)")
    parsed = tuple(_layer(layer, f"{where}: layers[{i}]") for i, layer in enumerate(layers))
    if len({x.input_backward_s is None for x in parsed}) > 1:
        raise ProfileError(f"{where}: either every layer has input_backward_s and "
                           "weight_backward_s, or none has")
    memory = data.get("memory_gib")
    if memory is not None and not (nonnegative_number(memory) and memory > 0):
        raise ProfileError(f"{where}: memory_gib must be a positive number, got {memory!r}")
    optimizer = data.get("optimizer_s_per_byte", 0.0)
    if not nonnegative_number(optimizer):
        raise ProfileError(f"{where}: optimizer_s_per_byte must be a finite number >= 0, "
                           f"got {optimizer!r}")
    return Profile(micro, parsed, _link(data, "p2p", where), _link(data, "allreduce", where),
                   None if memory is None else float(memory), str(data.get("model", "")), source,
                   float(optimizer))


# one layer's figures for one micro-batch; beyond these a typo, and sums of them overflow
MAX_LAYER_SECONDS, MAX_LAYER_BYTES = 1e6, 1e18


def nonnegative_number(x) -> bool:
    """A finite JSON number >= 0 (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _layer(layer, where: str) -> LayerProfile:
    if not isinstance(layer, dict):
        raise ProfileError(f"{where} must be an object with forward_s, backward_s, "
                           "activation_bytes and output_bytes")
    required = ("forward_s", "backward_s", "activation_bytes", "output_bytes")
    for key in required + _SPLIT + ("param_bytes",):
        if (key in required or key in layer) and not nonnegative_number(layer.get(key)):
            raise ProfileError(f"{where}.{key} must be a finite number >= 0, got {layer.get(key)!r}")
        top = MAX_LAYER_SECONDS if key.endswith("_s") else MAX_LAYER_BYTES
        if key in layer and layer[key] > top:  # sums over layers and micro-batches stay finite
            raise ProfileError(f"{where}.{key} is {layer[key]:g}, above the limit of {top:g} for "
                               "one layer and micro-batch")
    if (_SPLIT[0] in layer) != (_SPLIT[1] in layer):
        raise ProfileError(f"{where} needs both input_backward_s and weight_backward_s, or neither")
    split = [float(layer[k]) if k in layer else None for k in _SPLIT]
    return LayerProfile(*(float(layer[k]) for k in required), *split,
                        param_bytes=float(layer.get("param_bytes", 0.0)))


def _link(data: dict, key: str, where: str) -> Link:
    part = data.get(key)
    if not isinstance(part, dict) or not nonnegative_number(part.get("alpha_s")) \
            or not nonnegative_number(part.get("beta_bytes_per_s")) or part["beta_bytes_per_s"] <= 0:
        got = {k: part.get(k) for k in ("alpha_s", "beta_bytes_per_s")} if isinstance(part, dict) else part
        raise ProfileError(f"{where}: profile needs {key}.alpha_s >= 0 and {key}.beta_bytes_per_s > 0 "
                           f"(finite numbers), got {got!r}")
    return Link(float(part["alpha_s"]), float(part["beta_bytes_per_s"]))


# -- pricing a schedule ---------------------------------------------------------------------
def stage_cut(profile: Profile, stages: int, model: str | None = None) -> list[range]:
    """The layers of each stage: the runtime's default cut of the profiled model (balanced by
    FLOPs), or, for a model this package does not know, balanced by the measured times."""
    layers = profile.layers
    cfg = PRESETS.get(model or profile.model)
    if cfg is not None and cfg.n_layers_total == len(layers):
        costs = layer_costs(cfg)
    else:
        costs = [x.forward_s + x.backward_s for x in layers]
    if stages > len(layers):
        raise ProfileError(f"cannot cut the profile's {len(layers)} layers into {stages} stages")
    return partition(costs, stages)


def cost_from_profile(profile: Profile, schedule: Schedule, data_parallel: int = 1,
                      overlap: bool = True, shard_optimizer: bool = False) -> CostModel:
    """The profile priced for ``schedule`` (times per micro-batch of ``profile.micro_batch``;
    ``shard_optimizer``: each replica updates its slice only)."""
    layers, ranges = profile.layers, stage_cut(profile, schedule.stages)

    def per_stage(key: str) -> tuple[float, ...]:
        return tuple(sum(getattr(layers[i], key) for i in r) for r in ranges)

    return CostModel(
        f=per_stage("forward_s"), b=per_stage("backward_s"),
        i=per_stage("input_backward_s") if profile.split else (),
        w=per_stage("weight_backward_s") if profile.split else (),
        p2p=profile.p2p, allreduce=profile.allreduce,
        act_bytes=tuple(layers[r.stop - 1].output_bytes for r in ranges),
        weight_bytes=per_stage("param_bytes"), overlap_allreduce=overlap,
        data_parallel=data_parallel,
        optimizer=tuple(x * profile.optimizer_s_per_byte for x in per_stage("param_bytes")),
        shard_optimizer=shard_optimizer)
