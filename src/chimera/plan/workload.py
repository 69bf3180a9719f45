"""A training job on a machine, and the cost model of one (cut, micro-batch size, recompute).

Per stage: forward = the sum of its layers' times (``Hardware.layer_time`` of their FLOPs, or
the profile's measured seconds scaled by micro-batch size); backward = 2 x forward FLOPs,
plus one more forward with recomputation. Stages are cut by ``modelcfg.partition`` (exact
min-max over the layers' forward + backward cost). A boundary sends one hidden state; a
stage's allreduce moves its gradients (fp32 or 16-bit, as the precision keeps them).

With tensor parallelism (``tensor_parallel``: the T values searched; ``chimera.plan.tensor``)
every figure is one TP rank's: its share of the compute plus the TP collectives in F and B,
its slice of the parameters, gradients and optimizer state, its activations.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from chimera.ir import OpTimes
from chimera.modelcfg import ModelConfig, flops_per_token, partition
from chimera.plan.hardware import Hardware, PlanError, with_profile
from chimera.plan.memory import STATE_BYTES, layer_activation_bytes, layer_input_bytes, state_bytes
from chimera.plan.tensor import (collective_times, compute_divisor, placement_problem,
                                 rank_param_counts)
from chimera.sim.cost import CostModel
from chimera.sim.profile import Profile


@dataclass(frozen=True)
class Workload:
    model: ModelConfig
    gpus: int  # P
    global_batch: int  # G sequences per iteration (the mini-batch)
    hardware: Hardware
    memory_gib: float | None = None  # per rank; default: the hardware's
    profile: Profile | None = None
    name: str = ""  # the model's preset name, for reports
    tensor_parallel: tuple[int, ...] = (1,)  # the T values searched (P = W * D * T)
    gpus_per_node: int | None = None  # default: the hardware's devices_per_node

    def __post_init__(self) -> None:
        for key in ("gpus", "global_batch"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"{key.replace('_', ' ')} must be a positive integer, got {value!r}")
        if self.memory_gib is not None and not self.memory_gib > 0:
            raise PlanError(f"memory must be a positive number of GiB, got {self.memory_gib!r}")
        self._check_tensor()
        if self.profile is not None:
            if len(self.profile.layers) != self.model.n_layers_total:
                raise PlanError(f"profile has {len(self.profile.layers)} layers but the model has "
                                f"{self.model.n_layers_total} (embedding, {self.model.n_layer} blocks, head)")
            object.__setattr__(self, "hardware", with_profile(self.hardware, self.profile))

    def _check_tensor(self) -> None:
        """T values the layout and the runtime's TP allow (``chimera.plan.tensor``); the
        hardware takes ``gpus_per_node`` as its node size."""
        node = self.gpus_per_node
        if node is not None:
            if not isinstance(node, int) or isinstance(node, bool) or node < 1:
                raise PlanError(f"gpus per node must be a positive integer, got {node!r}")
            object.__setattr__(self, "hardware", replace(self.hardware, devices_per_node=node))
        sizes = tuple(self.tensor_parallel)
        if not sizes or any(not isinstance(t, int) or isinstance(t, bool) or t < 1 for t in sizes):
            raise PlanError(f"tensor parallel sizes must be positive integers, got {sizes!r}")
        object.__setattr__(self, "tensor_parallel", tuple(sorted(set(sizes))))
        for t in self.tensor_parallel:
            problem = placement_problem(self.model, t, self.gpus, self.hardware.devices_per_node)
            if problem is None and t > 1 and self.profile is not None:
                problem = "a profile's layers were measured at T=1"
            if problem:
                raise PlanError(f"cannot plan tensor parallel T={t}: {problem}")

    @property
    def capacity(self) -> float:
        """Usable bytes per rank."""
        if self.memory_gib is not None:
            return self.memory_gib * 2**30
        return self.hardware.usable_bytes

    @property
    def precision(self) -> str:
        return self.hardware.precision


@dataclass(frozen=True)
class StageCosts:
    """Everything the planner needs about one cut at one micro-batch size (seconds, bytes)."""

    ranges: tuple[range, ...]
    # per stage; b is the full backward and i its input-gradient half, both with the
    # recomputed forward when recomputing; no hops (they depend on the pipeline's depth)
    times: OpTimes
    act_full: tuple[float, ...]  # bytes kept per micro-batch without recomputation
    act_kept: tuple[float, ...]  # bytes kept per micro-batch as configured (recompute: input)
    send_bytes: tuple[float, ...]  # activation sent from stage s to s + 1
    params: tuple[int, ...]
    grad_bytes: tuple[float, ...]
    recompute: bool = False
    tensor: int = 1  # T: every figure is one TP rank's
    tp_f: tuple[float, ...] = ()  # TP collectives inside f, per stage (empty at T = 1)
    tp_b: tuple[float, ...] = ()  # and inside b (i holds them too; w none); no recomputation
    extra: dict = field(default_factory=dict, compare=False)


class Pricing:
    """Caches cuts and stage costs of one workload; builds CostModels for the simulator."""

    def __init__(self, work: Workload):
        self.work = work
        self.cfg = work.model
        self._cuts: dict[int, tuple[range, ...]] = {}
        self._costs: dict[tuple, StageCosts] = {}
        self.layer_weights = self._layer_weights()

    def _layer_weights(self) -> list[float]:
        """Relative cost of each layer (forward + backward), for cutting stages."""
        if self.work.profile:
            return [lp.forward_s + lp.backward_s for lp in self.work.profile.layers]
        return flops_per_token(self.cfg)

    def cut(self, stages: int) -> tuple[range, ...]:
        if stages not in self._cuts:
            if stages > self.cfg.n_layers_total:
                raise PlanError(f"cannot cut {self.cfg.n_layers_total} layers into {stages} stages")
            self._cuts[stages] = tuple(partition(self.layer_weights, stages))
        return self._cuts[stages]

    def layer_times(self, tokens: float, tensor: int = 1) -> tuple[list[float], list[float]]:
        """(forward, backward) compute seconds of each layer for a micro-batch of ``tokens``
        tokens on one of ``tensor`` TP ranks (a divided layer reads the efficiency curve at
        tokens / T: ``chimera.plan.tensor``)."""
        prof = self.work.profile
        if prof:  # measured at T = 1 (Workload refuses T > 1 with a profile)
            ratio = tokens / (prof.micro_batch * self.cfg.seq_len)
            return ([lp.forward_s * ratio for lp in prof.layers],
                    [lp.backward_s * ratio for lp in prof.layers])
        hw = self.work.hardware
        parts = list(zip(flops_per_token(self.cfg), compute_divisor(self.cfg, tensor)))
        fwd = [hw.layer_time(fl * tokens / k, tokens / k) for fl, k in parts]
        bwd = [hw.layer_time(2 * fl * tokens / k, tokens / k) for fl, k in parts]
        return fwd, bwd

    def layer_comm(self, tokens: float, tensor: int = 1) -> tuple[list[float], list[float]]:
        """(forward, backward) seconds of each layer's TP collectives (zeros at T = 1), on the
        link inside a node."""
        hw = self.work.hardware
        return collective_times(self.cfg, tokens, hw.precision, tensor, hw.allreduce_link(tensor))

    def layer_bytes(self, tokens: float, tensor: int = 1) -> tuple[list[float], list[float]]:
        """(activations kept, input) bytes of each layer for ``tokens`` tokens on one of
        ``tensor`` TP ranks."""
        prof, hw = self.work.profile, self.work.hardware
        if prof:
            ratio = tokens / (prof.micro_batch * self.cfg.seq_len)
            kept = [lp.activation_bytes * ratio for lp in prof.layers]
            outs = [lp.output_bytes * ratio for lp in prof.layers]
            return kept, [tokens * 8] + outs[:-1]
        return (layer_activation_bytes(self.cfg, tokens, hw.precision, hw.flash_attention, tensor),
                layer_input_bytes(self.cfg, tokens, hw.precision))

    def total_time(self, micro_batch: float, recompute: bool, tensor: int = 1) -> float:
        """Forward + backward (+ recomputed forward) of one micro-batch over the whole model,
        TP collectives included."""
        tokens = micro_batch * self.cfg.seq_len
        fwd, bwd = self.layer_times(tokens, tensor)
        if tensor > 1:
            cf, cb = self.layer_comm(tokens, tensor)
            fwd, bwd = [x + y for x, y in zip(fwd, cf)], [x + y for x, y in zip(bwd, cb)]
        return sum(bwd) + sum(fwd) * (2 if recompute else 1)

    def stage_costs(self, stages: int, micro_batch: float, recompute: bool,
                    tensor: int = 1) -> StageCosts:
        """Costs of one *full* micro-batch of ``micro_batch`` sequences on each of ``stages``,
        on one of ``tensor`` TP ranks."""
        key = (stages, micro_batch, recompute, tensor)
        if key not in self._costs:
            self._costs[key] = self._stage_costs(stages, micro_batch, recompute, tensor)
        return self._costs[key]

    def _stage_costs(self, stages: int, micro_batch: float, recompute: bool,
                     tensor: int) -> StageCosts:
        ranges = self.cut(stages)
        tokens = micro_batch * self.cfg.seq_len
        fwd, bwd = self.layer_times(tokens, tensor)
        cf, cb = self.layer_comm(tokens, tensor)
        kept, inputs = self.layer_bytes(tokens, tensor)
        tp_f = tuple(sum(cf[i] for i in r) for r in ranges)
        tp_b = tuple(sum(cb[i] for i in r) for r in ranges)
        f = tuple(sum(fwd[i] for i in r) + c for r, c in zip(ranges, tp_f))
        b0 = tuple(sum(bwd[i] for i in r) for r in ranges)
        i0, w0 = self._split(ranges, tokens, b0)  # TP's backward collectives sit in I
        b0, i0 = (tuple(x + c for x, c in zip(part, tp_b)) for part in (b0, i0))
        redo = f if recompute else (0.0,) * stages
        full = tuple(sum(kept[i] for i in r) for r in ranges)
        entry = tuple(inputs[r.start] for r in ranges)
        counts = rank_param_counts(self.cfg, tensor)
        params = tuple(sum(counts[i] for i in r) for r in ranges)
        grad = STATE_BYTES[self.work.precision][1]
        b, i = (tuple(x + y for x, y in zip(part, redo)) for part in (b0, i0))
        return StageCosts(
            ranges=ranges, times=OpTimes(f, b, i, w0),
            act_full=full, act_kept=entry if recompute else full,
            send_bytes=tuple(inputs[r.stop] if r.stop < len(inputs) else 0.0 for r in ranges),
            params=params, grad_bytes=tuple(p * grad for p in params), recompute=recompute,
            tensor=tensor, tp_f=tp_f if tensor > 1 else (), tp_b=tp_b if tensor > 1 else ())

    def _split(self, ranges, tokens: float, b0: tuple[float, ...]) -> tuple[tuple, tuple]:
        """(I, W) per stage of the compute ``b0``: measured if the profile has them, else half
        of B each."""
        prof = self.work.profile
        if prof and prof.split:
            ratio = tokens / (prof.micro_batch * self.cfg.seq_len)
            i = tuple(sum(prof.layers[k].input_backward_s for k in r) * ratio for r in ranges)
            w = tuple(sum(prof.layers[k].weight_backward_s for k in r) * ratio for r in ranges)
            return i, w
        return tuple(x / 2 for x in b0), tuple(x / 2 for x in b0)

    def cost_model(self, sc: StageCosts, depth: int, width: int, scale: float,
                   shard: bool = False) -> CostModel:
        """The simulator's cost model. ``scale`` is the schedule's micro_scale: the simulator
        multiplies times and bytes by it, so times of the smaller micro-batch are divided back.
        ``shard``: the optimizer of each stage is split over its replica group."""
        hw, t = self.work.hardware, sc.times
        return CostModel(
            f=tuple(x / scale for x in t.f), b=tuple(x / scale for x in t.b),
            i=tuple(x / scale for x in t.i), w=tuple(x / scale for x in t.w),
            p2p=hw.p2p_link(depth * sc.tensor), allreduce=hw.allreduce_link(self.work.gpus),
            act_bytes=tuple(x / scale for x in sc.send_bytes), weight_bytes=sc.grad_bytes,
            data_parallel=width, optimizer=tuple(hw.optimizer_time(p) for p in sc.params),
            shard_optimizer=shard)


def memory_floor(replicas: list[list[tuple[int, int]]], sc: StageCosts, precision: str,
                 recompute: bool, shards: int = 1) -> float:
    """Bytes the fullest rank holds at least: its replicas' state (``replicas[r]``: the
    (pipe, stage) replicas rank r holds) and one micro-batch of activations."""
    worst = 0.0
    for held in replicas:
        params = sum(sc.params[stage] for _, stage in held)
        act = min(sc.act_kept[stage] for _, stage in held)
        if recompute:  # and one of its stages rebuilt during its backward
            act += max(sc.act_full[stage] for _, stage in held)
        worst = max(worst, state_bytes(params, precision, shards=shards) + act)
    return worst


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
